"""When each engine's ``/health`` is asked next: every interval while it is up, soon and then
less often while it is down.

An engine is taken out of dispatch two ways: by the periodic check (``DOWN_AFTER_FAILURES``
failed checks in a row) or at once by a refused connection (``Fleet.connect_failed``,
passive health). Either way it comes back only when a probe of its ``/health`` answers. A
restarted engine should take traffic within one health interval of answering, and a dead
one should cost little: the first probe follows ``PROBE_FIRST_S`` after it went down, each
failed one doubles the wait, up to ``HEALTH_INTERVAL_S`` (never longer, so an engine that
answers again is back within one interval). Pure book-keeping on an injected clock.
"""

from __future__ import annotations

import math

HEALTH_INTERVAL_S = 2.0
"""An engine that is up is checked this often; one that is down at least this often."""
HEALTH_TIMEOUT_S = 5.0
DOWN_AFTER_FAILURES = 2
"""Failed periodic checks in a row that take an engine out (one slow answer from a busy
engine is not an outage)."""
PROBE_FIRST_S = 0.25
"""The first probe of an engine that went down, this long after it went."""


def engine_retry_headers() -> dict[str, str]:
    """``retry-after`` of a 503 for want of an engine: a probe of an engine that is down
    runs at least every ``HEALTH_INTERVAL_S``, so one that is back is known by then."""
    return {"retry-after": str(math.ceil(HEALTH_INTERVAL_S))}


class ProbeSchedule:
    """The next check of each engine (by URL), and the back-off of those that are down."""

    def __init__(self) -> None:
        self._next: dict[str, float] = {}
        self._backoff: dict[str, float] = {}  # engines down: the wait after their next probe

    def due(self, url: str, healthy: bool, down_since: float | None, now: float) -> bool:
        """Whether to check the engine now. An engine seen down for the first time (taken
        out between two checks) gets its first probe ``PROBE_FIRST_S`` after it went."""
        if not healthy and url not in self._backoff:
            self._backoff[url] = PROBE_FIRST_S
            went = down_since if down_since is not None else now
            self._next[url] = went + PROBE_FIRST_S
        return now >= self._next.get(url, now)

    def checked(self, url: str, healthy: bool, now: float) -> None:
        """The engine was checked and is ``healthy`` (or not) now."""
        if healthy:
            self._backoff.pop(url, None)
            self._next[url] = now + HEALTH_INTERVAL_S
            return
        wait = self._backoff.get(url, PROBE_FIRST_S)
        self._next[url] = now + wait
        self._backoff[url] = min(2 * wait, HEALTH_INTERVAL_S)

    def sleep_s(self, now: float) -> float:
        """How long until the next check is due, at most ``PROBE_FIRST_S`` (so an engine
        taken out meanwhile gets its first probe on time)."""
        nearest = min(self._next.values(), default=now + PROBE_FIRST_S)
        return max(0.0, min(nearest - now, PROBE_FIRST_S))
