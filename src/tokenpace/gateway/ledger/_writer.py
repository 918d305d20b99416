"""The ledger object: the journal in front of the database, the background thread that
drains it, and the lock around the one connection.

Reads go through the same lock (the connection is shared), so they are methods here too;
their SQL lives in ``_queries``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from .. import metrics
from . import _queries as queries
from ._journal import Journal, entry_id
from ._records import BudgetState, LedgerError, UsageRecord, UsageTotal
from ._schema import RECORD_COLUMNS, record_row

_log = logging.getLogger("tokenpace.gateway.ledger")

DEFAULT_JOURNAL_BYTES = 1024 * 1024 * 1024
"""The journal's default bound: about 3 million rows, hours of a database outage at
hundreds of requests per second."""

DEFAULT_CLOSE_TIMEOUT_S = 10.0
"""How long ``close`` waits for the last flush; what is not written by then stays in the
journal for the next start."""

ON_FULL = ("refuse", "drop")
"""What the gateway does when the journal is full (the database unreachable for long):
``refuse`` new requests with 503, or ``drop``: serve them unjournaled and count the rows
that could not be kept in ``tokenpace_gateway_ledger_dropped_rows``."""

INTERRUPTED = "interrupted"
"""The finish reason of a request that was in flight when its gateway process died,
recorded from its journal entry by the next process (``Ledger.orphans``)."""

DEAD_LETTER = "dead-letter.jsonl"
"""Rows the database refused while it answered (a bad value), one JSON object a line, in
the journal's directory: written nowhere else, so an operator can fix and load them."""


class Backend(Protocol):
    """One database connection. Callers serialise all use under the ledger's DB lock."""

    placeholder: str
    """The driver's parameter marker (``?`` or ``%s``)."""

    def write(self, rows: list[tuple[Any, ...]], budgets: list[tuple[Any, ...]]) -> None: ...

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]: ...

    def ping(self) -> None:
        """Raise unless the database answers a trivial query now (within a write's bound)."""

    def close(self) -> None: ...


def check_settings(flush_interval_s: float, max_batch: int, journal_bytes: int,
                   on_full: str = "refuse") -> None:
    """Raise ValueError for settings the writer cannot work with."""
    if not flush_interval_s > 0:
        raise ValueError(f"flush_interval_s must be positive, got {flush_interval_s}")
    if max_batch < 1 or journal_bytes < 1:
        raise ValueError(f"max_batch and the journal's bytes must be >= 1, got {max_batch}, "
                         f"{journal_bytes}")
    if on_full not in ON_FULL:
        raise ValueError(f"on_full must be one of {', '.join(ON_FULL)}, got {on_full!r}")


def _row_tuple(row: Any) -> tuple[Any, ...] | None:
    """A journaled row (a list in ``RECORD_COLUMNS`` order, or a mapping by column) as a
    row tuple; a column its writer did not know yet (an older version, fewer columns:
    columns are only ever added at the end) gets the column's default. None: malformed."""
    if isinstance(row, list):
        if len(row) > len(RECORD_COLUMNS) or not row:
            return None
        return (*row, *(_DEFAULTS.get(c) for c in RECORD_COLUMNS[len(row):]))
    if isinstance(row, dict):
        return tuple(row.get(c, _DEFAULTS.get(c)) for c in RECORD_COLUMNS)
    return None


def _fields(row: Any) -> dict[str, Any]:
    """A journaled row by column name (empty when malformed)."""
    values = _row_tuple(row)
    return {} if values is None else dict(zip(RECORD_COLUMNS, values))


_DEFAULTS: dict[str, Any] = {"served": 1, "route": "", "application": "",
                             "cached_prompt_tokens": 0, "batch_id": "", "estimated": 0}


def _merge_budgets(into: dict[tuple[str, str], BudgetState], levels: Iterable[Any]) -> None:
    """Merge budget levels (states, or journaled ``[tenant, budget, level, at]`` lists)
    into ``into``, the latest of each (tenant, budget) winning; malformed ones skipped."""
    if not isinstance(levels, Iterable):
        return
    for item in levels:
        try:
            state = item if isinstance(item, BudgetState) else BudgetState(
                str(item[0]), str(item[1]), float(item[2]), float(item[3]))
        except (TypeError, ValueError, IndexError, KeyError):
            continue
        key = (state.tenant, state.budget)
        held = into.get(key)
        if held is None or held.at <= state.at:
            into[key] = state


class Ledger:
    """The journal in front of the database and the thread that drains it.

    Every row goes to the journal (``_journal``) first, on the caller's thread: a row that
    ``record`` accepted survives a SIGKILL of the process, a database outage (up to the
    journal's bound) and a restart. The writer thread reads the journal in order, writes
    ``max_batch`` rows a transaction, and deletes what was written. A batch the database
    refuses while it still answers is split until the row at fault is found; that row goes
    to the dead-letter file, every other row is written.

    Two locks: the journal's own (one ``os.write`` long) for appends, so :meth:`record`
    cannot stall the event loop on the database; ``_db_lock`` serialises every use of the
    one database connection (writer thread, :meth:`flush`, reads).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        flush_interval_s: float,
        max_batch: int,
        journal: Journal | None = None,
        on_full: str = "refuse",
        close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
    ) -> None:
        check_settings(flush_interval_s, max_batch, journal.max_bytes if journal else 1,
                       on_full)
        self._backend = backend
        self._interval = flush_interval_s
        self._max_batch = max_batch
        self._on_full = on_full
        self._close_timeout = close_timeout_s
        # Without a journal directory (tools, tests) a private one, removed at close.
        self._scratch: str | None = None
        if journal is None:
            self._scratch = tempfile.mkdtemp(prefix="tokenpace-ledger-")
            journal = Journal(self._scratch, max_bytes=DEFAULT_JOURNAL_BYTES)
        self._journal = journal
        self._dead_letter_path = journal.directory.parent / DEAD_LETTER

        self._dropped = 0
        self._unwritten = 0  # rows appended to the journal and not yet written

        # The writer thread's own state (under _db_lock).
        self._batch: list[tuple[str, tuple[Any, ...]]] = []  # read, not yet committed
        self._budgets: dict[tuple[str, str], BudgetState] = {}  # read, not yet committed
        self._opens: dict[str, int] = {}  # request id -> the segment of its open entry
        self._segment_opens: dict[int, int] = {}  # segment -> opens in it still unanswered
        self._journal_budgets: dict[tuple[str, str], BudgetState] = {}
        self._settled: list[tuple[dict[str, Any], float, float]] = []
        self._orphans = self._scan()

        self._db_lock = threading.Lock()
        self._disconnected = False  # set by close() once the connection is gone
        self._failing = False  # last write failed: log the next failure quietly
        self._closed = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenpace-ledger", daemon=True)
        self._thread.start()

    # -- writing -----------------------------------------------------------------------

    def record(self, rec: UsageRecord) -> None:
        """Journal one request's row. Never blocks on the database and never raises for
        it; a row the journal cannot take (closed, or full: the database unreachable for
        long) is counted in :attr:`dropped`. Rows of served requests may use the
        journal's reserve beyond its bound (their tokens were generated).

        Cost: ``record_row``, one ``json.dumps`` and one ``os.write``."""
        if self._closed or not self._journal.append(
                {"row": list(record_row(rec))}, reserve=rec.served):
            self._drop(1)
            return
        self._unwritten += 1
        if self._unwritten >= self._max_batch:
            self._wake.set()

    def open(self, rec: UsageRecord, *, engine: str, kind: str, **facts: Any) -> bool:
        """Journal a request about to be sent to ``engine``, before it is sent: ``rec`` is
        the row it gets if the process dies before it ends (its reservation as the charge,
        ``estimated``); ``kind``: its route kind, to ask the engine what it generated;
        ``facts``: JSON values kept with the entry for whoever reads it back (the cost
        coefficients, the reservation: see ``server._recovery``).
        False: the journal is full and ``on_full`` is ``refuse`` (the caller refuses the
        request). With ``drop``, True even when the entry could not be kept (the request
        is then not protected against a crash; counted in
        ``tokenpace_gateway_ledger_unjournaled_requests``).

        Cost: one ``json.dumps`` of the row and one ``os.write``."""
        entry = {"open": list(record_row(rec)), "engine": engine, "kind": kind, **facts}
        if not self._closed and self._journal.append(entry):
            return True
        if self._on_full == "refuse":
            return False
        metrics.LEDGER_UNJOURNALED.inc()
        return True

    def orphans(self) -> list[dict[str, Any]]:
        """The open entries of requests that were in flight when an earlier process using
        this journal died (no row was journaled for them): ``{"open": {column: value},
        "engine": url, "kind": route kind}`` each, the latest open of each request. Each
        stays in the journal until a row with its request id is recorded."""
        return list(self._orphans)

    def journaled_settlements(self) -> list[tuple[dict[str, Any], float, float]]:
        """The requests an earlier process journaled both the dispatch and the row of
        (its open entry, the row's cost, the row's ``ended_at``), to bring budget levels
        saved before the row up to date (``server._recovery``)."""
        return list(self._settled)

    def save_budgets(self, states: list[BudgetState]) -> None:
        """Journal the latest level of each (tenant, budget); written to the database with
        the next batch, and read back by :meth:`load_budgets` after a crash even if the
        database never got it. Cost: one journal append per call (the changed levels)."""
        if self._closed or not states:
            return
        levels = [[b.tenant, b.budget, float(b.level), float(b.at)] for b in states]
        if not self._journal.append({"budgets": levels}, reserve=True):
            _log.error("usage ledger: the journal refused %d budget levels", len(levels))

    def flush(self) -> None:
        """Write everything journaled so far, and wait for it.

        Raises :class:`LedgerError` if the database refuses; the unwritten rows stay in
        the journal for the next attempt.
        """
        try:
            with self._db_lock:
                self._write_pending(None)
        except Exception as exc:
            raise LedgerError(f"usage ledger write failed: {exc}") from exc

    def close(self) -> None:
        """Stop the writer thread after one last flush, waiting at most ``close_timeout_s``
        for it; idempotent. Does not raise: it runs at shutdown. Rows that cannot be
        written in time stay in the journal and are written by the next process that
        opens it."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(self._close_timeout)
        if self._thread.is_alive():
            # Blocked in the database: leave it (a daemon thread), the journal keeps all.
            _log.error("usage ledger: the last flush did not finish within %.0f s; the "
                       "unwritten rows stay in the journal %s", self._close_timeout,
                       self._journal.directory)
            self._journal.close()
            return
        with self._db_lock:
            self._backend.close()
            self._disconnected = True
        self._journal.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    @property
    def dropped(self) -> int:
        """Rows thrown away because the journal was full or the ledger closed."""
        return self._dropped

    @property
    def dead_letter_path(self) -> Path:
        return self._dead_letter_path

    @property
    def journal(self) -> Journal:
        return self._journal

    def _drop(self, n: int) -> None:
        self._dropped += n
        metrics.LEDGER_DROPPED_ROWS.inc(n)
        dropped = self._dropped
        if dropped & (dropped - 1) == 0:
            # Powers of two only, so a long outage does not flood the log.
            _log.error("usage ledger journal full or closed: %d rows dropped so far", dropped)

    # -- the writer thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            if not stopping:
                self._wake.wait(self._interval)
                self._wake.clear()
                stopping = self._stop.is_set()
            deadline = time.monotonic() + self._close_timeout if stopping else None
            self._journal.sync()
            try:
                with self._db_lock:
                    self._write_pending(deadline)
            except Exception as exc:
                # The thread must survive any error: the next flush retries.
                metrics.LEDGER_WRITE_FAILURES.inc()
                if self._failing:
                    _log.debug("usage ledger write still failing: %s", exc)
                else:
                    _log.error("usage ledger write failed, will retry (rows wait in the "
                               "journal %s): %s", self._journal.directory, exc)
                self._failing = True
            else:
                if self._failing:
                    _log.info("usage ledger writes resumed")
                self._failing = False
            metrics.LEDGER_JOURNAL_BYTES.set(self._journal.size_bytes)
            if stopping:
                return

    def _write_pending(self, deadline: float | None) -> None:
        """Write what the journal holds, ``max_batch`` rows a transaction, then delete the
        segments read to their end whose opens all have rows. Under ``_db_lock``.

        Rows leave the journal only after their transaction commits (or they went to the
        dead-letter file), so a failed write loses nothing; the batch read but not written
        is kept and tried first next time."""
        while True:
            # A batch left from a failed attempt was read earlier: more may wait behind it.
            carried = bool(self._batch or self._budgets)
            if not carried:
                for segment, entry in self._journal.read(self._max_batch):
                    request_id = entry_id(entry)
                    if "open" in entry:
                        self._note_open(request_id, segment)
                    elif "row" in entry:
                        row = _row_tuple(entry["row"])
                        if row is None:
                            self._journal.corrupt += 1
                        else:
                            self._batch.append((request_id, row))
                    elif "budgets" in entry:
                        _merge_budgets(self._budgets, entry["budgets"])
            if not self._batch and not self._budgets:
                self._remove_written()
                return
            self._commit([row for _, row in self._batch], self._budgets)
            for request_id, _ in self._batch:
                self._answer_open(request_id)
            self._unwritten = max(0, self._unwritten - len(self._batch))
            more = carried or len(self._batch) >= self._max_batch
            self._batch, self._budgets = [], {}
            self._remove_written()
            if not more or (deadline is not None and time.monotonic() >= deadline):
                return

    def _commit(self, rows: list[tuple[Any, ...]],
                budgets: dict[tuple[str, str], BudgetState]) -> None:
        """One transaction; if the database refuses it while it answers, the rows are
        split until each bad one is found (one transaction per half: about 2 log2(n)
        more for one bad row in n) and the bad ones go to the dead-letter file."""
        budget_rows = [(b.tenant, b.budget, float(b.level), float(b.at))
                       for b in budgets.values()]
        try:
            self._backend.write(rows, budget_rows)
            return
        except Exception as exc:
            if not self._about_rows(exc):
                raise
        if budget_rows:
            try:
                self._backend.write([], budget_rows)
            except Exception as exc:
                if not self._about_rows(exc):
                    raise
                # Levels are snapshots: the next one replaces these.
                _log.error("usage ledger: budget levels refused, skipped: %s", exc)
        if rows:
            self._write_rows(rows)

    def _write_rows(self, rows: list[tuple[Any, ...]]) -> None:
        try:
            self._backend.write(rows, [])
            return
        except Exception as exc:
            if not self._about_rows(exc):
                raise
            if len(rows) == 1:
                self._dead_letter(rows[0], exc)
                return
        mid = len(rows) // 2
        self._write_rows(rows[:mid])
        self._write_rows(rows[mid:])

    def _about_rows(self, exc: Exception) -> bool:
        """Whether a failed write was refused for what its rows hold rather than for the
        database's state: not an operational error (connection lost, lock held, timeout,
        disk) of either driver, and the database answers a trivial query now."""
        if isinstance(exc, OSError) or any(
                c.__name__ == "OperationalError" for c in type(exc).__mro__):
            return False
        try:
            self._backend.ping()
            return True
        except Exception:
            return False

    def _dead_letter(self, row: tuple[Any, ...], exc: Exception) -> None:
        line = json.dumps({"row": dict(zip(RECORD_COLUMNS, row)), "error": str(exc)[:2000],
                           "at": time.time()}, separators=(",", ":"), default=str) + "\n"
        try:
            fd = os.open(self._dead_letter_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as write_exc:
            _log.error("usage ledger: cannot write the dead-letter file %s: %s",
                       self._dead_letter_path, write_exc)
        metrics.LEDGER_DEAD_LETTER_ROWS.inc()
        _log.error("usage ledger: the database refused request %s's row, moved to %s: %s",
                   row[0], self._dead_letter_path, exc)

    def _note_open(self, request_id: str, segment: int) -> None:
        self._answer_open(request_id)  # a second dispatch of the same request
        self._opens[request_id] = segment
        self._segment_opens[segment] = self._segment_opens.get(segment, 0) + 1

    def _answer_open(self, request_id: str) -> None:
        segment = self._opens.pop(request_id, None)
        if segment is not None:
            left = self._segment_opens[segment] - 1
            if left:
                self._segment_opens[segment] = left
            else:
                del self._segment_opens[segment]

    def _remove_written(self) -> None:
        """Delete the segments read to their end whose opens all have rows (the batch read
        from them was written: called only with no batch pending)."""
        if not self._batch:
            self._journal.rotate_if_read()
            self._journal.remove(self._journal.read_segment, set(self._segment_opens))

    def _scan(self) -> list[dict[str, Any]]:
        """The journal as an earlier process left it: the opens without a row, and how
        many rows wait. Reads every segment once (at start-up only)."""
        opens: dict[str, dict[str, Any]] = {}
        answered: dict[str, tuple[float, float]] = {}
        rows = 0
        for _, entry in self._journal.entries():
            request_id = entry_id(entry)
            if "open" in entry:
                opens[request_id] = {**entry, "open": _fields(entry["open"])}
            elif "row" in entry:
                row = _fields(entry["row"])
                try:
                    answered[request_id] = (float(row.get("cost") or 0.0),
                                            float(row.get("ended_at") or 0.0))
                except (TypeError, ValueError):
                    answered[request_id] = (0.0, 0.0)
                rows += 1
            elif "budgets" in entry:
                _merge_budgets(self._journal_budgets, entry["budgets"])
        self._unwritten = rows
        orphans = [e for r, e in opens.items() if r not in answered]
        self._settled = [(e, *answered[r]) for r, e in opens.items() if r in answered]
        if rows or orphans:
            _log.warning("usage ledger journal %s: %d rows from an earlier process to write, "
                         "%d requests that were in flight when it stopped",
                         self._journal.directory, rows, len(orphans))
        return orphans

    # -- reading -----------------------------------------------------------------------

    def load_budgets(self) -> list[BudgetState]:
        """The budget levels saved by the last run, read once at start-up: the database's,
        or the journal's where a newer level never reached the database."""
        try:
            saved = queries.load_budgets(self._query)
        except LedgerError as exc:
            # The database does not answer: the levels the journal kept are all there is.
            _log.error("usage ledger: budget levels not read from the database (%s); "
                       "using the journal's", exc)
            saved = []
        levels = {(b.tenant, b.budget): b for b in saved}
        _merge_budgets(levels, self._journal_budgets.values())
        return sorted(levels.values(), key=lambda b: (b.tenant, b.budget))

    def rows(self, since: float | None = None) -> list[UsageRecord]:
        """Rows that ended at or after ``since`` (unix seconds), oldest first."""
        return queries.rows(self._query, self._backend.placeholder, since)

    def rows_of(self, request_ids: Iterable[str]) -> dict[str, UsageRecord]:
        """The rows of ``request_ids`` the database has, by request id (rows still in the
        journal are not: they are written within ``flush_interval_s``). Blocks on the
        database: call it off the event loop. See :func:`._queries.rows_of`."""
        return queries.rows_of(self._query, self._backend.placeholder, request_ids)

    def usage(self, since: float | None = None, by: str = "tenant") -> list[UsageTotal]:
        """Totals per tenant, model, lane, route or application for rows that ended at or
        after ``since``, ordered by key (see :func:`._queries.usage`)."""
        return queries.usage(self._query, self._backend.placeholder, since, by)

    def usage_buckets(self, start: float, end: float, width: float,
                      group_by: tuple[str, ...] = (), tenants: tuple[str, ...] = (),
                      models: tuple[str, ...] = ()) -> list[tuple[Any, ...]]:
        """Totals per time bucket of the rows that ended in ``[start, end)`` (the usage
        API; see :func:`._queries.usage_buckets`). Blocks on the database: call it off
        the event loop."""
        return queries.usage_buckets(self._query, self._backend.placeholder, start, end,
                                     width, group_by, tenants, models)

    def _query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run one read on the shared connection, under the DB lock."""
        with self._db_lock:
            if self._disconnected:
                raise LedgerError("usage ledger is closed")
            try:
                return self._backend.query(sql, params)
            except Exception as exc:
                raise LedgerError(f"usage ledger read failed: {exc}") from exc
