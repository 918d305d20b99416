"""Token times at the source: the engine's event log (``--output-rate-event-log``).

A client that reads a burst of buffered chunks at once sees tokens that the engine spread
out in time; the event log records the instant each token was dispatched. Its ``t_ns`` is
``time.monotonic_ns()`` in the engine process: CLOCK_MONOTONIC, the clock the test's
``time.monotonic()`` reads, so engine instants and client instants compare directly.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from tokenpace.engine import read_charges


@dataclass(frozen=True)
class EngineRequest:
    """One request's tokens as the engine dispatched them (charges net of refunds)."""

    request_id: str
    user: str
    times: tuple[float, ...]  # seconds, sorted

    @property
    def first(self) -> float:
        return self.times[0]

    @property
    def last(self) -> float:
        return self.times[-1]


def engine_requests(event_log: Path, users: Collection[str] | None,
                    since: float = float("-inf")) -> list[EngineRequest]:
    """Requests of ``users`` (None: everyone) whose tokens were dispatched at or after
    ``since``, by first token.

    The module's servers live for many tests (and for repeated runs of one test), so a
    test selects its own requests by the instant it started.
    """
    charges = read_charges(event_log, users)
    found = [
        EngineRequest(request_id, user, tuple(sorted(t / 1e9 for t in stamps)))
        for (user, request_id), stamps in charges.items()
        if stamps and min(stamps) / 1e9 >= since
    ]
    return sorted(found, key=lambda r: r.first)


def wait_for_engine_requests(event_log: Path, users: Collection[str], since: float,
                             tokens: int, timeout_s: float = 10.0,
                             exact: bool = False) -> list[EngineRequest]:
    """:func:`engine_requests` once the log holds ``tokens`` tokens since ``since``
    (``exact``: exactly that many, for speculative decoding, where a step's rejected
    drafts are logged after its charges and net them out a moment later).

    The engine writes the log from a background thread every 200 ms; a log that falls
    short (or, ``exact``, does not settle) after ``timeout_s`` is returned as it is, for
    the caller's assertion to show.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = engine_requests(event_log, users, since)
        count = sum(len(r.times) for r in found)
        if (count == tokens if exact else count >= tokens) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


BURST_S = 0.1  # GCRA's burst tolerance in the engine


@dataclass(frozen=True)
class PacedRate:
    """A user's rate at the engine, with and without the time the engine was away."""

    rate: float  # net rate over the whole span: what the user received
    paced_rate: float  # net rate over the span less ``absent_s``: what the limiter allowed
    absent_s: float
    stalls: int  # restarts forgiven as the engine's absences
    restarts: int  # tokens behind the user's GCRA schedule

    def as_series(self) -> dict[str, float]:
        return {"rate": self.rate, "paced_rate": self.paced_rate,
                "absent_s": self.absent_s, "stalls": self.stalls, "restarts": self.restarts}


MAX_RESTART_SHARE = 0.5
MIN_FORGIVEN = 0.5  # of an interval


def paced_rate(times: Collection[float], limit: float, everyone: list[float]) -> PacedRate:
    """The rate the limiter gave a backlogged user, net of the engine's absences.

    Replays GCRA (``1 / limit`` per token, 0.1 s tolerance) over the user's dispatch
    instants. While the engine steps, a backlogged user is served within a step of the
    limiter allowing it, so its tokens never fall behind the theoretical arrival time
    (TAT). A token that does came after the engine was away: the user's schedule restarts
    and the time behind is lost for good. When nobody at all was dispatched between the
    instant the user was allowed and that token (``everyone``: every charge in the log,
    sorted; one step's tokens share its instant), the engine did not step: a CPU-starved
    process on a loaded machine, not the limiter, so that time leaves the span. A token
    held while others were dispatched stays in: a limiter or scheduler that holds a user
    while the engine runs is a defect. GCRA's bound holds for the rest exactly:
    ``paced_rate <= limit``. A limiter slower than its rate by a factor ``s`` makes its
    tokens restart by ``(s - 1) / limit`` each, nearly all of them once the burst is spent:
    a restart is forgiven only from ``MIN_FORGIVEN`` of an interval up (more than an engine
    step, so ``s`` below 1.5 is never forgiven), and when more than ``MAX_RESTART_SHARE``
    of the tokens restart nothing is (``s`` of 1.5 and above, for 40 tokens and more).
    An absence forgives what it cost beyond the burst that remained; a slow limiter's
    drift that used the burst up before it (at most 0.1 s per absence) goes with it.
    """
    ordered = sorted(times)
    interval = 1 / limit
    tat = ordered[0] + interval
    absent, stalls, restarts = 0.0, 0, 0
    for before, t in zip(ordered, ordered[1:]):
        if t <= tat:
            tat += interval
            continue
        restarts += 1
        waited_from = max(tat - BURST_S, before)  # allowed and not just served
        nobody = bisect.bisect_left(everyone, t) == bisect.bisect_right(everyone, waited_from)
        # What the engine's absence cost, beyond the latest instant a limiter that keeps
        # its rate would have let the token through (``before + interval``): a slow
        # limiter's drift, which used up the burst before the absence, is not forgiven.
        away = min(t - tat, t - before - interval)
        if nobody and away >= MIN_FORGIVEN * interval:
            absent += away
            stalls += 1
        tat = t + interval
    if restarts > MAX_RESTART_SHARE * len(ordered):
        absent = 0.0
    span = ordered[-1] - ordered[0]
    net = len(ordered) - 1 - BURST_S * limit
    return PacedRate(net / span, net / (span - absent), absent, stalls, restarts)


def all_dispatches(event_log: Path, since: float) -> list[float]:
    """Every token the engine dispatched since ``since``, any user, sorted."""
    return sorted(t for r in engine_requests(event_log, None, since) for t in r.times)
