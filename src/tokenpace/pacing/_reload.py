"""Hot reload of a limits file (``--user-output-tokens-per-second @/path/limits.json``).

Operators edit the file while the engine runs. The watcher polls cheaply (one ``stat``
at most every ``interval_ns`` of the injected clock) because the engine has no event loop
to hang an inotify watch on, and it must never block a scheduling step for long.

A broken edit (bad JSON, a bad rate, a file half-written by an editor) keeps the last
good limits: the engine must not fall back to "everyone gets the default" because of a
typo. The error is reported once per distinct file version, not once per poll.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ._limits import LimitsError, UserRateLimits, read_overrides_file

RELOAD_CHECK_NS = 1_000_000_000
"""How often the file's metadata is checked; edits take effect within about this long."""


@dataclass(frozen=True)
class ReloadResult:
    """What a poll found: new limits, or why the file was rejected (never both)."""

    limits: UserRateLimits | None = None
    error: str | None = None


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class LimitsFileWatcher:
    """Re-reads a limits file when its metadata changes; keeps the default rate fixed.

    The default rate comes from the command line, the per-user overrides from the file,
    so a reload only changes overrides (and users that fall back to the default). The
    default may be None (users without an override are not paced): a trusted gateway
    sends the other users' rates with their requests.
    """

    def __init__(
        self,
        path: Path,
        default: float | None,
        clock_ns: Callable[[], int],
        interval_ns: int = RELOAD_CHECK_NS,
    ) -> None:
        self.path = path
        self.default = default
        self._clock_ns = clock_ns
        self._interval_ns = interval_ns
        self._seen = _signature(path)
        self._next_check_ns = 0  # the first poll looks at once; the clock may be swapped in tests

    def poll(self) -> ReloadResult | None:
        """None when nothing changed (or it is not yet time to look); else the outcome."""
        now = self._clock_ns()
        if now < self._next_check_ns:
            return None
        self._next_check_ns = now + self._interval_ns
        signature = _signature(self.path)
        if signature == self._seen:
            return None
        self._seen = signature
        if signature is None:
            return ReloadResult(error=f"limits file {str(self.path)!r} is missing; "
                                "keeping the last good limits")
        try:
            overrides = read_overrides_file(self.path)
        except LimitsError as exc:
            return ReloadResult(error=f"{exc}; keeping the last good limits")
        return ReloadResult(limits=UserRateLimits(self.default, overrides))
