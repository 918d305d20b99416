"""Per-step pacing decisions: who may sample a token this step, and who gives way.

The scheduler adapter describes its running requests as ``Candidate`` values and asks the
planner which of them run, which are throttled (their user has no quota) and which are
deferred (no active batch slot is left). The planner owns the limiter calls, so the
charge/refund bookkeeping has one home:

* one charge per request per step, only for steps that sample;
* once a user is refused in a step, its other requests are not asked again that step;
* a user's streams take turns (least recently served stream first), so four streams of
  one paced user each get about a quarter of its tokens;
* when the active-slot limit binds, slots go to the user with the least service so far
  (a virtual counter per user, counted in slot-steps, lifted to the smallest counter of
  the present users when it (re)appears, so that no credit is banked while idle);
* one refund point, ``settle``, for every charge whose step was not dispatched.

Nothing here knows vLLM: keys are opaque, and the clock lives in the limiter.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ._limiter import OutputRateLimiter

MAX_IDLE_WAIT_S = 0.05
"""Longest idle wait: short enough to notice work that became ready by other means (a
grammar finished compiling), long enough that an all-throttled engine stays cool."""


class Candidate(NamedTuple):
    """A running request as the planner sees it."""

    key: Hashable
    user: str
    samples: bool
    """True if this step may sample a token for it (a decode step or a last prefill chunk)."""
    priority: int = 0
    """Lower runs first, as in vLLM's priority policy; 0 for everyone under FCFS."""


@dataclass(slots=True)
class RunningPlan:
    run: list[Hashable] = field(default_factory=list)
    throttled: list[Hashable] = field(default_factory=list)
    """Refused for lack of quota: skipped, keep their KV, do not count as active."""
    deferred: list[Hashable] = field(default_factory=list)
    """Have quota or need none, but no active slot is left this step."""


class Settlement(NamedTuple):
    key: Hashable
    user: str
    dispatched: bool


class StepPlanner:
    """Pacing state that lives across steps: service counters and stream rotation."""

    def __init__(self, limiter: OutputRateLimiter) -> None:
        self.limiter = limiter
        self._step = 0
        self._service: dict[str, int] = {}
        self._last_served: dict[Hashable, int] = {}
        self._charged: dict[Hashable, str] = {}
        self._refused: dict[str, int] = {}  # user -> first instant it has quota again
        # user -> a waiting request refused admission for lack of quota. It gets the user's
        # next token before the user's running streams, or those would take every token
        # and the waiting request would never start.
        self._starved: dict[str, Hashable] = {}

    # -- one step -------------------------------------------------------------------

    def begin_step(self) -> None:
        self._step += 1
        self._charged.clear()
        self._refused.clear()

    def is_paced(self, user: str) -> bool:
        return self.limiter.limits.rate(user) is not None

    def _charge(self, key: Hashable, user: str) -> bool:
        if user in self._refused:
            return False
        if self.limiter.try_take(user):
            self._charged[key] = user
            return True
        self._refused[user] = self.limiter.ready_at_ns(user)
        return False

    def may_admit(self, key: Hashable, user: str) -> bool:
        """Should a waiting request be considered for admission this step?

        Asks without charging: the charge comes with ``charge_admission`` once the
        scheduler knows the step reaches the request's sampling position. A request of a
        user without quota is refused and gets the user's next token (see ``_starved``).
        """
        if key in self._charged or not self.is_paced(user):
            return True
        if user not in self._refused:
            ready = self.limiter.ready_at_ns(user)
            if ready <= self.limiter.now_ns():
                return True
            self._refused[user] = ready
        self._starved.setdefault(user, key)
        return False

    def charge_admission(self, key: Hashable, user: str) -> bool:
        """Charge a waiting request whose admission step samples; False if no quota."""
        if key in self._charged or not self.is_paced(user):
            return True
        return self._charge(key, user)

    def _charge_starved(self, waiting: Callable[[Hashable], bool], can_admit: bool) -> None:
        for user, key in list(self._starved.items()):
            if not waiting(key) or not self.is_paced(user):
                del self._starved[user]
            elif can_admit:
                self._charge(key, user)

    def plan_running(
        self,
        candidates: Sequence[Candidate],
        slots: int,
        waiting: Callable[[Hashable], bool] = lambda key: False,
        can_admit: bool = True,
    ) -> RunningPlan:
        """Decide run / throttled / deferred for every running request.

        ``slots`` is the number of running requests allowed in this step's batch;
        ``waiting(key)`` tells whether a request still waits for admission, and
        ``can_admit`` whether admission can take a request this step at all.
        """
        if self._starved:
            self._charge_starved(waiting, can_admit)
        by_user: dict[str, list[Candidate]] = {}
        for cand in candidates:
            by_user.setdefault(cand.user, []).append(cand)
        last = self._last_served
        for user, cands in by_user.items():
            if len(cands) > 1:
                cands.sort(key=lambda c: (c.priority, last.get(c.key, -1)))
        self._lift_service(by_user)

        plan = RunningPlan()
        if len(candidates) <= slots:
            # Fast path (no slot contention), written out: it runs for every request on
            # every step.
            run, throttled, service = plan.run, plan.throttled, self._service
            rate, charge = self.limiter.limits.rate, self._charge
            for user, cands in by_user.items():
                paced = rate(user) is not None
                served = 0
                for cand in cands:
                    if paced and cand.samples and not charge(cand.key, user):
                        throttled.append(cand.key)
                    else:
                        run.append(cand.key)
                        served += 1
                service[user] += served
            return plan

        heap = [
            (cands[0].priority, self._service[user], order, user, 0)
            for order, (user, cands) in enumerate(by_user.items())
        ]
        heapq.heapify(heap)
        while heap and slots > 0:
            _, _, order, user, pos = heapq.heappop(heap)
            cands = by_user[user]
            if self._place(cands[pos], plan):
                slots -= 1
            if pos + 1 < len(cands):
                nxt = cands[pos + 1]
                heapq.heappush(heap, (nxt.priority, self._service[user], order, user, pos + 1))
        now = self.limiter.now_ns()
        for _, _, _, user, pos in heap:
            out_of_quota = self.is_paced(user) and (
                user in self._refused or self.limiter.ready_at_ns(user) > now
            )
            for cand in by_user[user][pos:]:
                if cand.samples and out_of_quota:
                    plan.throttled.append(cand.key)
                else:
                    plan.deferred.append(cand.key)
        return plan

    def _place(self, cand: Candidate, plan: RunningPlan) -> bool:
        """Run ``cand`` if its user has quota for it (or it does not sample)."""
        if cand.samples and self.is_paced(cand.user) and not self._charge(cand.key, cand.user):
            plan.throttled.append(cand.key)
            return False
        plan.run.append(cand.key)
        self._service[cand.user] += 1
        return True

    def _lift_service(self, by_user: dict[str, list[Candidate]]) -> None:
        """Keep counters of present users only; newcomers start at the smallest one."""
        service = self._service
        present = [service[u] for u in by_user if u in service]
        floor = min(present) if present else 0
        self._service = {u: service.get(u, floor) for u in by_user}

    def settle(self, dispatched: Callable[[Hashable], bool]) -> list[Settlement]:
        """The one refund point: return the token of every charge not dispatched to sample."""
        result: list[Settlement] = []
        for key, user in self._charged.items():
            if self._starved.get(user) == key:
                del self._starved[user]  # had its turn; if not admitted, it asks again
            ok = dispatched(key)
            if ok:
                self._last_served[key] = self._step
            else:
                self.limiter.refund(user)
            result.append(Settlement(key, user, ok))
        self._charged.clear()
        return result

    @property
    def refused_any(self) -> bool:
        """Whether some user was refused a token in the last step."""
        return bool(self._refused)

    def idle_wait_seconds(self, quota_needs: Iterable[str | None]) -> float:
        """How long nothing can run: 0 if some request can, else up to ``MAX_IDLE_WAIT_S``.

        ``quota_needs`` has one item per request that could be scheduled: the user whose
        quota its next step needs, or None for a step that needs none (an intermediate
        prefill chunk), which can always run.
        """
        limiter = self.limiter
        seen: set[str] = set()
        earliest: int | None = None
        for user in quota_needs:
            if user is None:
                return 0.0
            if user in seen:
                continue
            seen.add(user)
            ready = limiter.ready_at_ns(user)  # never before its own reading of the clock
            if ready <= limiter.now_ns():
                return 0.0
            if earliest is None or ready < earliest:
                earliest = ready
        if earliest is None:
            return 0.0
        return min(MAX_IDLE_WAIT_S, max(0.0, (earliest - limiter.now_ns()) / 1e9))

    # -- housekeeping ---------------------------------------------------------------

    def forget(self, alive: Callable[[Hashable], bool]) -> None:
        """Drop rotation state of requests that are gone."""
        self._last_served = {k: v for k, v in self._last_served.items() if alive(k)}
