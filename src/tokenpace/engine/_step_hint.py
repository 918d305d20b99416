"""The engine core tells its workers the earliest instant its next step can come.

While every user with work is out of quota the engine blocks in its idle wait until the
earliest one has quota again (or a request arrives). Its model workers, in other
processes, cannot see that: they spin on their input queue after each step and then nap
in growing slices, which on a paced engine with steps every few hundred milliseconds
costs a steady tenth of a core. With the hint they nap at once, and only in short
slices, so a request that ends the engine's wait early is picked up within a slice.

The hint is 8 bytes in a file under /dev/shm, named after the engine core's process id
(the workers are its children and find it through their parent's id): a monotonic
clock instant in nanoseconds (CLOCK_MONOTONIC is one clock for all processes on a host),
or 0 for "a step may come at any time". Writing or reading it is one aligned 8-byte
copy; no lock, no system call.
"""

from __future__ import annotations

import atexit
import mmap
import os
import struct
from pathlib import Path

_FORMAT = struct.Struct("=q")
_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


def hint_path(engine_pid: int) -> Path:
    return _DIR / f"tokenpace-step-hint-{engine_pid}"


class StepHint:
    """One engine's hint, writable by the engine and readable by its workers."""

    def __init__(self, path: Path, create: bool) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, _FORMAT.size)
            self._map = mmap.mmap(fd, _FORMAT.size)
        finally:
            os.close(fd)

    @classmethod
    def create_for_this_engine(cls) -> StepHint:
        """The engine side: a fresh hint of 0, removed at shutdown (``remove``, called by
        the scheduler's ``shutdown`` and at exit). An engine killed outright leaves its
        8 bytes behind; the next engine on the host removes those of dead processes."""
        _remove_stale()
        hint = cls(hint_path(os.getpid()), create=True)
        hint.set(0)
        atexit.register(hint.remove)
        return hint

    @classmethod
    def open_for_parent_engine(cls) -> StepHint | None:
        """The worker side: the hint of the engine that started this process, if any."""
        try:
            return cls(hint_path(os.getppid()), create=False)
        except (OSError, ValueError):
            return None

    def set(self, not_before_ns: int) -> None:
        _FORMAT.pack_into(self._map, 0, not_before_ns)

    def get(self) -> int:
        return int(_FORMAT.unpack_from(self._map, 0)[0])

    def remove(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass


def _remove_stale() -> None:
    for path in _DIR.glob("tokenpace-step-hint-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                path.unlink()
            except OSError:
                pass
        except OSError:
            pass  # alive, someone else's
