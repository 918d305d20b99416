"""The ledger's journal: every row, and every request sent to an engine, on local disk
before the database sees it.

A journal is a directory of segments (``segment-<n>.jsonl``), one JSON object a line,
appended to by the gateway's event loop and read, in order, by the ledger's writer thread,
which writes the rows to the database and deletes a segment once everything in it is
written. Two kinds of entry:

- ``{"row": [...]}``: a request's ledger row (its values in ``_schema.RECORD_COLUMNS``
  order; a row of an older version has fewer, columns being only added at the end).
- ``{"open": [...], "engine": url, "kind": route kind, ...}``: a request about to be sent
  to an engine, with the row it would have if it died there (its reservation as the
  charge, marked ``estimated``). An open whose row never came is a request that was in
  flight when the process died; ``Ledger.orphans`` hands them to the gateway at start-up,
  which asks the engine what it generated.

Durability: each entry is one ``os.write`` of a whole line, so it is in the kernel's page
cache, and survives a SIGKILL of the process, before ``append`` returns; the writer thread
fsyncs the segment being written once per flush interval, so a power loss loses at most
that interval. A torn last line (the machine stopped mid-write) is cut off at start.

Bound: ``max_bytes`` of segments. Opens and rows of unserved requests are refused beyond it
(the ledger's ``on_full`` policy says what the gateway does then); rows of served requests
(tokens already generated) may exceed it by ``ROW_RESERVE_BYTES`` so that the requests in
flight when the bound is reached are still recorded.

Reading back: while the writer keeps up, the entries it has not read yet are also held in
memory (at most ``MEMORY_ENTRIES``), so it reads them without parsing the file; past that
(a long database outage) or at start-up (what an earlier process left), it reads the
segments from its cursor until it has caught up, then uses memory again.

One process a directory: the journal takes an exclusive ``flock`` on one slot
(``<directory>/<k>``, the first free ``k``), so several gateway processes (``--workers``)
may share a configured directory, and a process started after one died takes the slot the
dead one left, with its unwritten rows and its requests in flight.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_log = logging.getLogger("tokenpace.gateway.ledger")

SEGMENT_BYTES = 8 * 1024 * 1024
"""A segment is closed and a new one begun past this size; a segment is deleted whole."""

ROW_RESERVE_BYTES = 64 * 1024 * 1024
"""How far served requests' rows may go past ``max_bytes``: about 200,000 rows, far more
than the requests a gateway has in flight when the bound is reached."""

MEMORY_ENTRIES = 65_536
"""Entries held in memory for the reader besides the disk (a few hundred bytes each)."""

MAX_SLOTS = 1024
"""Slots tried before giving up (one per gateway process sharing the directory)."""

_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
"""One encoder for every entry (``json.dumps`` with arguments builds one per call)."""

_SEGMENT = re.compile(r"^segment-(\d{12})\.jsonl$")


class JournalError(OSError):
    """The journal directory cannot be created, locked or read."""


def _segment_name(n: int) -> str:
    return f"segment-{n:012d}.jsonl"


def entry_id(entry: dict[str, Any]) -> str:
    """The request id of a journal entry."""
    body = entry.get("row") or entry.get("open")
    if isinstance(body, list):
        return str(body[0]) if body else ""
    return str(body.get("request_id", "")) if isinstance(body, dict) else ""


class Journal:
    """Append-only segments in one locked slot directory.

    ``append`` may be called from any thread (it holds ``_lock`` for one ``os.write`` and
    a few integer updates); ``read``, ``sync`` and ``remove`` only from the writer thread.
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int,
                 segment_bytes: int = SEGMENT_BYTES,
                 memory_entries: int = MEMORY_ENTRIES) -> None:
        if max_bytes < 1 or segment_bytes < 1:
            raise ValueError(f"max_bytes and segment_bytes must be >= 1, got {max_bytes}, "
                             f"{segment_bytes}")
        root = Path(directory)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise JournalError(f"cannot create the ledger journal {root}: {exc}") from exc
        self.max_bytes = max_bytes
        self._segment_bytes = segment_bytes
        self.directory, self._lock_fd = _take_slot(root)
        self._lock = threading.Lock()
        existing = self._segments()
        self._sizes: dict[int, int] = {}
        for n in existing:
            self._sizes[n] = self._repair(n) if n == existing[-1] else \
                (self.directory / _segment_name(n)).stat().st_size
        self._bytes = sum(self._sizes.values())
        self._current = (existing[-1] + 1) if existing else 1
        self._fd = self._open_segment(self._current)
        self._dirty = False
        # The reader: the entries appended since it caught up (memory mode), or, once
        # spilled, the segment and byte offset of the next entry to read from disk.
        self._memory: deque[tuple[int, dict[str, Any]]] = deque()
        self._memory_entries = memory_entries
        self._spilled = bool(existing)
        self._read_seg = existing[0] if existing else self._current
        self._read_off = 0
        self._read_file: Any = None
        self._read_file_seg = 0
        self.corrupt = 0  # lines that were not JSON objects (skipped)
        self.adopted = self._adopt(root)

    # -- appending (any thread) ---------------------------------------------------------

    def append(self, entry: dict[str, Any], *, reserve: bool = False) -> bool:
        """Append one entry; False (nothing written) when it would pass ``max_bytes``
        (``max_bytes + ROW_RESERVE_BYTES`` with ``reserve``) or the disk refused it.

        Cost: one ``json.dumps`` of the entry and one ``os.write`` (a few microseconds);
        every ``SEGMENT_BYTES``, an ``open`` of the next segment.
        """
        line = (_ENCODER.encode(entry) + "\n").encode()
        # (``entry`` itself is kept for the reader: callers hand over fresh objects.)
        size = len(line)
        limit = self.max_bytes + (ROW_RESERVE_BYTES if reserve else 0)
        with self._lock:
            if self._bytes + size > limit or self._fd < 0:
                return False
            if self._sizes.get(self._current, 0) >= self._segment_bytes:
                self._rotate()
            try:
                written = os.write(self._fd, line)
            except OSError as exc:
                _log.error("ledger journal %s: write failed: %s", self.directory, exc)
                return False
            at = self._sizes.get(self._current, 0)
            if written != size:  # a full disk: cut the partial line off again
                os.ftruncate(self._fd, at)
                return False
            self._sizes[self._current] = at + size
            if not self._spilled:
                if len(self._memory) < self._memory_entries:
                    self._memory.append((self._current, entry))
                else:  # the reader is far behind: it reads the disk from this entry on
                    self._spilled = True
                    self._read_seg, self._read_off = self._current, at
            self._bytes += size
            self._dirty = True
        return True

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def sync(self) -> None:
        """fsync the segment being written, if anything was appended since the last call."""
        with self._lock:
            fd, dirty, self._dirty = self._fd, self._dirty, False
        if dirty and fd >= 0:
            try:
                os.fsync(fd)
            except OSError as exc:
                _log.error("ledger journal %s: fsync failed: %s", self.directory, exc)

    # -- reading (the writer thread) -------------------------------------------------------

    def read(self, max_rows: int) -> list[tuple[int, dict[str, Any]]]:
        """The next entries after the read cursor, with the segment each is in, up to and
        including the ``max_rows``-th row entry: from memory while the reader keeps up,
        else from disk. On disk, a line still being written is left for the next call; a
        line that is not a JSON object is skipped and counted in ``corrupt``."""
        out: list[tuple[int, dict[str, Any]]] = []
        rows = 0
        while rows < max_rows:
            with self._lock:
                # What memory holds comes first: a spill starts after its last entry.
                if self._memory:
                    item = self._memory.popleft()
                elif not self._spilled:
                    return out
                else:
                    item = None
                    current = self._current
                    later = [n for n in self._sizes if n > self._read_seg]
            if item is not None:
                out.append(item)
                rows += "row" in item[1]
                continue
            if self._read_file is not None and self._read_file_seg != self._read_seg:
                self._read_file.close()
                self._read_file = None
            if self._read_file is None:
                try:
                    self._read_file = open(self.directory / _segment_name(self._read_seg), "rb")
                except FileNotFoundError:
                    if not later and self._read_seg >= current:
                        return out
                    self._read_seg, self._read_off = min(later) if later else current, 0
                    continue
                self._read_file_seg = self._read_seg
            self._read_file.seek(self._read_off)  # drops what a partial line left buffered
            line = self._read_file.readline()
            if line.endswith(b"\n"):
                self._read_off += len(line)
                entry = _parse(line)
                if entry is None:
                    self.corrupt += 1
                    continue
                out.append((self._read_seg, entry))
                if "row" in entry:
                    rows += 1
                continue
            if self._read_seg >= current:
                with self._lock:  # caught up, unless an append came meanwhile
                    if (self._read_seg == self._current
                            and self._read_off == self._sizes.get(self._current, 0)):
                        self._spilled = False
                if self._spilled:
                    return out  # a line being written: the next call reads it
                continue
            if line:
                self.corrupt += 1  # a torn line at the end of a closed segment
            self._read_file.close()
            self._read_file = None
            self._read_seg, self._read_off = (min(later) if later else current), 0
        return out

    def rotate_if_read(self) -> bool:
        """Begin a new segment when the reader has read everything in the one being
        written and it holds at least an eighth of ``max_bytes`` (or ``segment_bytes``),
        so that it can be deleted once written; True if it did. The writer thread calls it
        after a batch was written."""
        with self._lock:
            size = self._sizes.get(self._current, 0)
            caught_up = (not self._memory if not self._spilled else
                         self._read_seg == self._current and self._read_off >= size)
            if (not caught_up or self._fd < 0
                    or size < min(self._segment_bytes, max(4096, self.max_bytes // 8))):
                return False
            self._rotate()
            self._read_seg, self._read_off = self._current, 0
        return True

    @property
    def read_segment(self) -> int:
        """The segment of the next entry to read: every segment before it was read to its
        end."""
        with self._lock:
            if self._memory:
                return self._memory[0][0]
            return self._read_seg if self._spilled else self._current

    def remove(self, before: int, keep: set[int]) -> int:
        """Delete the segments numbered below ``before`` except those in ``keep`` (never
        the one being written); returns the bytes freed."""
        with self._lock:
            doomed = [n for n in self._sizes if n < before and n not in keep
                      and n != self._current]
        freed = 0
        for n in doomed:
            try:
                os.unlink(self.directory / _segment_name(n))
            except FileNotFoundError:
                pass
            except OSError as exc:
                _log.error("ledger journal %s: cannot delete %s: %s", self.directory,
                           _segment_name(n), exc)
                continue
            with self._lock:
                size = self._sizes.pop(n, 0)
                self._bytes -= size
            freed += size
        return freed

    def entries(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Every complete entry in the segments as they are now, oldest first, without
        moving the read cursor (start-up's scan for requests that died in flight)."""
        with self._lock:
            segments = sorted(self._sizes)
        for n in segments:
            try:
                with open(self.directory / _segment_name(n), "rb") as f:
                    for line in f:
                        if line.endswith(b"\n"):
                            entry = _parse(line)
                            if entry is not None:
                                yield n, entry
            except FileNotFoundError:
                continue

    def close(self) -> None:
        """Sync and close the segment being written and release the slot; idempotent."""
        self.sync()
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        if self._read_file is not None:
            self._read_file.close()
            self._read_file = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = -1

    # -- segments ---------------------------------------------------------------------

    def _adopt(self, root: Path) -> int:
        """Take over what other slots under ``root`` hold whose process is gone (a worker
        of a gateway started with more ``--workers`` before, or a replica whose journal
        directory is mounted here): their entries are copied into this slot's segments,
        synced, then deleted, so they are written and their requests in flight recovered
        like this slot's own. Returns the entries taken over. Cost: one pass over those
        bytes, at start-up."""
        taken = 0
        for slot in sorted(root.iterdir()) if root.is_dir() else ():
            if slot == self.directory or not slot.name.isdigit() or not slot.is_dir():
                continue
            fd = _lock_slot(slot)
            if fd is None:
                continue  # a live process's
            try:
                names = sorted(n for n in os.listdir(slot) if _SEGMENT.match(n))
                for name in names:
                    with open(slot / name, "rb") as f:
                        for line in f:
                            if line.endswith(b"\n") and _parse(line) is not None:
                                self._append_line(line)
                                taken += 1
                if names:
                    os.fsync(self._fd)
                    for name in names:
                        os.unlink(slot / name)
                    _log.warning("ledger journal %s: took over the entries of slot %s, "
                                 "whose process is gone", self.directory, slot.name)
            finally:
                os.close(fd)
        if taken:
            self._spilled = True  # the reader reads what was copied from disk
        return taken

    def _append_line(self, line: bytes) -> None:
        """Append a line as it is, outside the bound (start-up only: it was on disk)."""
        with self._lock:
            if self._sizes.get(self._current, 0) >= self._segment_bytes:
                self._rotate()
            os.write(self._fd, line)
            self._sizes[self._current] = self._sizes.get(self._current, 0) + len(line)
            self._bytes += len(line)

    def _segments(self) -> list[int]:
        return sorted(int(m.group(1)) for name in os.listdir(self.directory)
                      if (m := _SEGMENT.match(name)))

    def _open_segment(self, n: int) -> int:
        try:
            fd = os.open(self.directory / _segment_name(n),
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            raise JournalError(f"cannot open ledger journal segment {n} in "
                               f"{self.directory}: {exc}") from exc
        self._sizes.setdefault(n, 0)
        return fd

    def _rotate(self) -> None:
        """Close the segment being written and begin the next (under ``_lock``)."""
        try:
            os.fsync(self._fd)
        except OSError:
            pass
        os.close(self._fd)
        self._dirty = False
        self._current += 1
        self._fd = self._open_segment(self._current)

    def _repair(self, n: int) -> int:
        """Cut a torn last line off segment ``n`` (written when the machine stopped);
        returns its size after."""
        path = self.directory / _segment_name(n)
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            f.seek(max(0, size - 1))
            if f.read(1) == b"\n":
                return size
            # Find the last newline, reading backwards in blocks.
            end = size
            while end > 0:
                start = max(0, end - 65536)
                f.seek(start)
                block = f.read(end - start)
                cut = block.rfind(b"\n")
                if cut >= 0:
                    keep = start + cut + 1
                    break
                end = start
            else:
                keep = 0
            f.truncate(keep)
            _log.warning("ledger journal %s: cut a torn line off %s (%d bytes)",
                         self.directory, path.name, size - keep)
            return keep


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def _lock_slot(slot: Path) -> int | None:
    """The slot's lock file, flock'ed; None when another process holds it."""
    try:
        slot.mkdir(exist_ok=True)
        fd = os.open(slot / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise JournalError(f"cannot use the ledger journal slot {slot}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _take_slot(root: Path) -> tuple[Path, int]:
    """The first slot directory under ``root`` that no other process holds, locked."""
    for k in range(MAX_SLOTS):
        slot = root / str(k)
        fd = _lock_slot(slot)
        if fd is not None:
            return slot, fd
    raise JournalError(f"ledger journal {root}: all {MAX_SLOTS} slots are held by other "
                       "processes")
