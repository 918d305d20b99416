"""Engine-side event log of charges and refunds, as JSON lines.

Rates and token spacing measured at a client are blurred by HTTP buffering; this log
records them at the source. Writing happens on a background thread: the scheduler's
per-step path only appends tuples to a deque.

With data parallel every rank's engine appends to the same file and each line carries
``dp_rank``. Each flush is one ``write`` to a file opened with ``O_APPEND``, so lines of
different ranks never interleave mid-line.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from collections.abc import Collection
from pathlib import Path

FLUSH_INTERVAL_S = 0.2


class EventLog:
    """Buffered JSON-lines writer: ``{"t_ns", "user", "request_id", "event"}`` per line,
    plus ``"dp_rank"`` when ``rank`` is given."""

    def __init__(self, path: Path, rank: int | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._extra = {} if rank is None else {"dp_rank": rank}
        self._pending: deque[tuple[int, str, str, str]] = deque()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tokenpace-event-log", daemon=True)
        self._thread.start()

    def record(self, t_ns: int, user: str, request_id: str, event: str) -> None:
        self._pending.append((t_ns, user, request_id, event))

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            self.flush()
        self.flush()

    def flush(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            pending = self._pending
            lines = []
            while pending:
                t_ns, user, request_id, event = pending.popleft()
                lines.append(
                    json.dumps(
                        {"t_ns": t_ns, "user": user, "request_id": request_id, "event": event,
                         **self._extra},
                        separators=(",", ":"),
                    )
                )
            if lines:
                data = ("\n".join(lines) + "\n").encode()
                while data:
                    data = data[os.write(self._fd, data):]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_charges(path: Path, users: Collection[str] | None = None) -> dict[tuple[str, str], list[int]]:
    """Net charges per ``(user, request_id)``: each dispatch instant (``t_ns``) that was not
    refunded, in the order the log holds them (None for ``users``: everyone).

    A refund cancels the latest charge of its request: the scheduler refunds only the
    token it charged in the step that was cancelled (its one refund point). A ``reject``
    (a speculative draft the model rejected, logged when the step's results arrive, with
    its step's dispatch instant as ``t_ns``) cancels a charge of that instant. A missing
    file reads as empty (the writer has not flushed yet).
    """
    charges: dict[tuple[str, str], list[int]] = {}
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines():
        if not line:
            continue
        event = json.loads(line)
        if users is not None and event["user"] not in users:
            continue
        key = (event["user"], event["request_id"])
        if event["event"] == "charge":
            charges.setdefault(key, []).append(event["t_ns"])
        elif event["event"] == "reject":
            stamps = charges.get(key)
            if stamps and event["t_ns"] in stamps:
                del stamps[len(stamps) - 1 - stamps[::-1].index(event["t_ns"])]
        elif charges.get(key):
            charges[key].pop()
    return charges
