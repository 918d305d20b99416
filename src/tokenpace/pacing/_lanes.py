"""Lanes: a request's priority decides who runs when slots or the step's tokens are short.

Under vLLM's priority policy a lower ``priority`` value runs first. Stock vLLM lets a
higher-priority arrival wait until some running request ends (it preempts only when KV
blocks run out, and a preempted request recomputes its prompt). A lane holds lower-priority
running requests instead, the way throttled requests are held: they stay in ``running``
with their KV blocks, are skipped for the step, and resume without recompute.

Three decisions, all pure (nothing here knows vLLM):

* **Admission past the limit** (``admit_past_limit``): when the active limit is reached
  and a waiting request outranks some running ones, up to that many more requests are
  admitted, within the room ``running`` has beyond the active limit (``--max-num-seqs``
  minus ``--max-num-active-seqs``). From the next step on the planner's slot contention
  gives the active slots by priority, so the outranked requests are the ones held.
* **A reserve per lower lane** (``reserve``): while slots are short, each priority level
  below the best one present keeps ``ceil(min_share x slots)`` slots (at least one; all
  reserves together at most half the slots), taken from its own requests in the planner's
  usual order. So no lane with runnable requests is starved of slots.
* **Prefill isolation** (``yields``): in a step that may run a better lane's prefill (its
  request is running a prompt chunk, or waits and can be admitted), a lower lane's prompt
  chunk sits out; its decode steps (one token each) still run. A prompt chunk sits out at
  most ``max_yields`` steps in a row (``ceil(1 / min_share) - 1``), so it runs in at least
  one step of every ``ceil(1 / min_share)``.

``min_share`` 0 is strict priority: no reserve, prompt chunks sit out for as long as a
better lane prefills (a lower lane can then starve).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

DEFAULT_MIN_SHARE = 0.1


class LaneStream(Protocol):
    """What the lane decisions read of a running request (``Stream`` is one)."""

    priority: int
    yielded: int


@dataclass(frozen=True, slots=True)
class LanePolicy:
    """The lanes' bounds; see the module docstring."""

    min_share: float = DEFAULT_MIN_SHARE

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_share <= 0.5:
            raise ValueError(f"min_share must be from 0 to 0.5, got {self.min_share!r}")

    def reserve(self, slots: int) -> int:
        """Slots each lower priority level keeps while slots are short (0: strict)."""
        if self.min_share <= 0 or slots < 2:
            return 0
        return max(1, math.ceil(self.min_share * slots - 1e-9))

    def reserves(self, slots: int) -> int:
        """The most slots all lower levels' reserves take together."""
        return slots // 2 if self.reserve(slots) else 0

    @property
    def max_yields(self) -> int | None:
        """Steps in a row a lower lane's prompt chunk sits out (None: no bound)."""
        if self.min_share <= 0:
            return None
        return max(1, math.ceil(1 / self.min_share - 1e-9)) - 1

    def admit_past_limit(self, best_waiting: int, running_priorities: Iterable[int],
                         slots: int, room: int) -> int:
        """How many waiting requests may be admitted beyond the active limit.

        ``best_waiting``: the best priority waiting; ``running_priorities``: those of the
        running requests placed in this step; ``room``: free places in ``running``. At most
        one per placed request it outranks, less what the lower levels keep as reserves
        (those would not be held)."""
        if room <= 0:
            return 0
        outranked: dict[int, int] = {}
        for p in running_priorities:
            if p > best_waiting:
                outranked[p] = outranked.get(p, 0) + 1
        if not outranked:
            return 0
        kept = 0
        reserve, cap = self.reserve(slots), self.reserves(slots)
        for p in sorted(outranked):
            take = min(reserve, outranked[p], cap - kept)
            kept += take
        return min(room, sum(outranked.values()) - kept)

    def yields(self, prefills: Sequence[LaneStream], best: int | None) -> list[LaneStream]:
        """The prompt chunks that sit out this step, and the yield counts updated.

        ``prefills``: the running requests placed to run a prompt chunk this step;
        ``best``: the best priority of a waiting request that can be admitted in this step
        (None: none). A chunk sits out when some better-priority prompt may run; one that
        sat out ``max_yields`` steps in a row runs (its count starts again)."""
        top = best
        for s in prefills:
            if top is None or s.priority < top:
                top = s.priority
        out: list[LaneStream] = []
        limit = self.max_yields
        for s in prefills:
            if top is not None and s.priority > top and (limit is None or s.yielded < limit):
                s.yielded += 1
                out.append(s)
            else:
                s.yielded = 0
        return out
