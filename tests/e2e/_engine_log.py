"""Token times at the source: the engine's event log (``--output-rate-event-log``).

A client that reads a burst of buffered chunks at once sees tokens that the engine spread
out in time; the event log records the instant each token was dispatched. Its ``t_ns`` is
``time.monotonic_ns()`` in the engine process: CLOCK_MONOTONIC, the clock the test's
``time.monotonic()`` reads, so engine instants and client instants compare directly.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path


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
    charges: dict[tuple[str, str], list[int]] = {}
    text = event_log.read_text() if event_log.exists() else ""
    for line in text.splitlines():
        if not line:
            continue
        event = json.loads(line)
        if users is not None and event["user"] not in users:
            continue
        key = (event["user"], event["request_id"])
        if event["event"] == "charge":
            charges.setdefault(key, []).append(event["t_ns"])
        elif charges.get(key):
            charges[key].pop()  # a refund cancels the latest charge of that request
    found = [
        EngineRequest(request_id, user, tuple(sorted(t / 1e9 for t in stamps)))
        for (user, request_id), stamps in charges.items()
        if stamps and min(stamps) / 1e9 >= since
    ]
    return sorted(found, key=lambda r: r.first)


def wait_for_engine_requests(event_log: Path, users: Collection[str], since: float,
                             tokens: int, timeout_s: float = 10.0) -> list[EngineRequest]:
    """:func:`engine_requests` once the log holds ``tokens`` tokens since ``since``.

    The engine writes the log from a background thread every 200 ms; a log that falls
    short after ``timeout_s`` is returned as it is, for the caller's assertion to show.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = engine_requests(event_log, users, since)
        if sum(len(r.times) for r in found) >= tokens or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


BURST_S = 0.1  # GCRA's burst tolerance in the engine


@dataclass(frozen=True)
class PacedRate:
    """A user's rate at the engine, with and without the time the engine was away."""

    rate: float  # net rate over the whole span: what the user received
    paced_rate: float  # net rate over the span less ``absent_s``: what the limiter allowed
    absent_s: float
    stalls: int

    def as_series(self) -> dict[str, float]:
        return {"rate": self.rate, "paced_rate": self.paced_rate,
                "absent_s": self.absent_s, "stalls": self.stalls}


def paced_rate(times: Collection[float], limit: float, everyone: list[float]) -> PacedRate:
    """The rate the limiter gave a backlogged user, net of the engine's absences.

    GCRA never holds a backlogged user longer than ``1 / limit`` between two tokens, and
    its burst tolerance makes good a gap of up to ``1 / limit + 0.1 s`` afterwards. A
    longer gap in which the engine dispatched no token for anyone (``everyone``: every
    charge in the log, sorted; tokens of one step share its instant) is time the engine
    did not step: a CPU-starved process on a loaded machine, not the limiter. That time
    beyond ``1 / limit + 0.1 s`` is lost for good (the limiter restarts the user's
    schedule), so it is left out of the span; GCRA's bound then holds for the rest
    exactly: ``paced_rate <= limit``. A gap in which other users got tokens stays in: a
    limiter or scheduler that holds a user while the engine runs is a defect.
    """
    ordered = sorted(times)
    forgiven = 1 / limit + BURST_S
    absent, stalls = 0.0, 0
    for a, b in zip(ordered, ordered[1:]):
        if b - a <= forgiven:
            continue
        inside = bisect.bisect_left(everyone, b) - bisect.bisect_right(everyone, a)
        if inside == 0:
            absent += b - a - forgiven
            stalls += 1
    span = ordered[-1] - ordered[0]
    net = len(ordered) - 1 - BURST_S * limit
    return PacedRate(net / span, net / (span - absent), absent, stalls)


def all_dispatches(event_log: Path, since: float) -> list[float]:
    """Every token the engine dispatched since ``since``, any user, sorted."""
    return sorted(t for r in engine_requests(event_log, None, since) for t in r.times)
