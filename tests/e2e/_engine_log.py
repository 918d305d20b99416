"""Token times at the source: the engine's event log (``--output-rate-event-log``).

A client that reads a burst of buffered chunks at once sees tokens that the engine spread
out in time; the event log records the instant each token was dispatched. Its ``t_ns`` is
``time.monotonic_ns()`` in the engine process: CLOCK_MONOTONIC, the clock the test's
``time.monotonic()`` reads, so engine instants and client instants compare directly.
"""

from __future__ import annotations

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


def engine_requests(event_log: Path, users: Collection[str],
                    since: float = float("-inf")) -> list[EngineRequest]:
    """Requests of ``users`` whose tokens were dispatched at or after ``since``, by first token.

    The module's servers live for many tests (and for repeated runs of one test), so a
    test selects its own requests by the instant it started.
    """
    charges: dict[tuple[str, str], list[int]] = {}
    text = event_log.read_text() if event_log.exists() else ""
    for line in text.splitlines():
        if not line:
            continue
        event = json.loads(line)
        if event["user"] not in users:
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


def net_rate(times: Collection[float], limit: float) -> float:
    """Tokens per second net of the GCRA burst allowance.

    GCRA lets ``1 + 0.1 x limit`` tokens through at once, then ``limit`` per second, so
    ``N`` tokens span at least ``(N - 1 - 0.1 x limit) / limit`` seconds.
    """
    span = max(times) - min(times)
    return (len(times) - 1 - 0.1 * limit) / span if span > 0 else float("inf")
