"""The ledger object: the in-memory queue in front of the database, the background thread
that drains it, and the lock around the one connection.

Reads go through the same lock (the connection is shared), so they are methods here too;
their SQL lives in ``_queries``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from itertools import islice
from typing import Any, Protocol

from .. import metrics
from . import _queries as queries
from ._records import BudgetState, LedgerError, UsageRecord, UsageTotal
from ._schema import record_row

_log = logging.getLogger("tokenpace.gateway.ledger")

DEFAULT_MAX_QUEUE = 100_000
"""Rows held in memory while the database is unreachable; one row is a few hundred bytes."""


class Backend(Protocol):
    """One database connection. Callers serialise all use under the ledger's DB lock."""

    placeholder: str
    """The driver's parameter marker (``?`` or ``%s``)."""

    def write(self, rows: list[tuple[Any, ...]], budgets: list[tuple[Any, ...]]) -> None: ...

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]: ...

    def close(self) -> None: ...


def check_settings(flush_interval_s: float, max_batch: int, max_queue: int) -> None:
    """Raise ValueError for settings the writer cannot work with."""
    if not flush_interval_s > 0:
        raise ValueError(f"flush_interval_s must be positive, got {flush_interval_s}")
    if max_batch < 1 or max_queue < 1:
        raise ValueError(f"max_batch and max_queue must be >= 1, got {max_batch}, {max_queue}")


class Ledger:
    """The queue in front of the database and the thread that drains it.

    Two locks: ``_queue_lock`` guards the in-memory queue and is only ever held for a few
    list operations, so :meth:`record` cannot stall the event loop; ``_db_lock`` serialises
    every use of the one database connection (writer thread, :meth:`flush`, reads).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        flush_interval_s: float,
        max_batch: int,
        max_queue: int,
    ) -> None:
        check_settings(flush_interval_s, max_batch, max_queue)
        self._backend = backend
        self._interval = flush_interval_s
        self._max_batch = max_batch
        self._max_queue = max_queue

        self._queue_lock = threading.Lock()
        self._queue: deque[tuple[Any, ...]] = deque()
        self._budgets: dict[tuple[str, str], BudgetState] = {}
        self._dropped = 0

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
        """Queue one request's row. Never blocks on the database and never raises for it;
        when the queue is full (database unreachable for long) the row is counted in
        :attr:`dropped` instead."""
        row = record_row(rec)
        with self._queue_lock:
            if self._closed or len(self._queue) >= self._max_queue:
                self._dropped += 1
                metrics.LEDGER_DROPPED_ROWS.inc()
                dropped = self._dropped
                full = False
            else:
                self._queue.append(row)
                full = len(self._queue) >= self._max_batch
                dropped = 0
        if full:
            self._wake.set()
        elif dropped and (dropped & (dropped - 1)) == 0:
            # Powers of two only, so a long outage does not flood the log.
            _log.error("usage ledger queue full or closed: %d rows dropped so far", dropped)

    def save_budgets(self, states: list[BudgetState]) -> None:
        """Remember the latest level of each (tenant, budget); written at the next flush."""
        with self._queue_lock:
            if self._closed:
                return
            for state in states:
                self._budgets[(state.tenant, state.budget)] = state

    def flush(self) -> None:
        """Write everything queued so far, and wait for it.

        Raises :class:`LedgerError` if the database refuses; the unwritten rows stay
        queued for the next attempt.
        """
        try:
            self._write_pending()
        except Exception as exc:
            raise LedgerError(f"usage ledger write failed: {exc}") from exc

    def close(self) -> None:
        """Stop the writer thread after one last flush; idempotent.

        Does not raise: it runs at shutdown. Rows that still cannot be written are logged
        and added to :attr:`dropped`.
        """
        with self._queue_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join()
        try:
            self._write_pending()
        except Exception as exc:
            with self._queue_lock:
                lost = len(self._queue)
                self._queue.clear()
                self._budgets.clear()
                self._dropped += lost
            metrics.LEDGER_DROPPED_ROWS.inc(lost)
            _log.error("usage ledger closed with %d rows unwritten: %s", lost, exc)
        with self._db_lock:
            self._backend.close()
            self._disconnected = True

    @property
    def dropped(self) -> int:
        """Rows thrown away because the queue was full, the ledger closed, or the final
        flush failed."""
        return self._dropped

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                return  # close() does the last flush itself
            try:
                self._write_pending()
            except Exception as exc:
                # The thread must survive any error: the next flush retries.
                metrics.LEDGER_WRITE_FAILURES.inc()
                if self._failing:
                    _log.debug("usage ledger write still failing: %s", exc)
                else:
                    _log.error("usage ledger write failed, will retry: %s", exc)
                self._failing = True
            else:
                if self._failing:
                    _log.info("usage ledger writes resumed")
                self._failing = False

    def _write_pending(self) -> None:
        """Write the rows queued when the call began, ``max_batch`` per transaction.

        Rows leave the queue only after their transaction commits, so a failed write loses
        nothing. Only this method removes rows, always from the left, under ``_db_lock``,
        so the rows read for a batch are still the first ones when they are removed.
        """
        with self._db_lock:
            with self._queue_lock:
                remaining = len(self._queue)
            while True:
                with self._queue_lock:
                    batch = list(islice(self._queue, min(self._max_batch, remaining)))
                    budgets, self._budgets = self._budgets, {}
                if not batch and not budgets:
                    return
                budget_rows = [
                    (b.tenant, b.budget, float(b.level), float(b.at)) for b in budgets.values()
                ]
                try:
                    self._backend.write(batch, budget_rows)
                except BaseException:
                    with self._queue_lock:
                        # A newer snapshot saved meanwhile wins over the one that failed.
                        for key, state in budgets.items():
                            self._budgets.setdefault(key, state)
                    raise
                with self._queue_lock:
                    for _ in batch:
                        self._queue.popleft()
                remaining -= len(batch)
                if remaining <= 0:
                    return

    # -- reading -----------------------------------------------------------------------

    def load_budgets(self) -> list[BudgetState]:
        """The budget levels saved by the last run, read once at start-up."""
        return queries.load_budgets(self._query)

    def rows(self, since: float | None = None) -> list[UsageRecord]:
        """Rows that ended at or after ``since`` (unix seconds), oldest first."""
        return queries.rows(self._query, self._backend.placeholder, since)

    def usage(self, since: float | None = None, by: str = "tenant") -> list[UsageTotal]:
        """Totals per tenant, model, lane, route or application for rows that ended at or
        after ``since``, ordered by key (see :func:`._queries.usage`)."""
        return queries.usage(self._query, self._backend.placeholder, since, by)

    def _query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run one read on the shared connection, under the DB lock."""
        with self._db_lock:
            if self._disconnected:
                raise LedgerError("usage ledger is closed")
            try:
                return self._backend.query(sql, params)
            except Exception as exc:
                raise LedgerError(f"usage ledger read failed: {exc}") from exc
