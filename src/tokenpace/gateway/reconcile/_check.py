"""The check a gateway runs every ``reconcile_interval``: what the engines ended since the
last check, against the ledger, counted per tenant in metrics.

Each check reads every engine's book from where the last one stopped (``_books``), keeps
the gateway requests seen until they are due (``_compare.due``: the grace, or for a
request without a row that may still be running, ``request_timeout`` and the grace),
reads the rows of the due ones (``Ledger.rows_of``, in a thread: the read blocks) and
counts what ``compare`` finds in ``tokenpace_gateway_ledger_unrecorded_tokens``,
``..._overcharged_tokens`` and ``..._unrecorded_requests``.

It checks the fleet, not this process: every request the engines ended is compared with
the ledger whatever gateway sent it, so with several replicas on one ledger each counts
the same drift (alert on the max over replicas, not the sum). Replicas with ledgers of
their own would each count the others' requests as unrecorded: turn the check off there
(``reconcile_interval: 0``). A process starts with the requests that ended from one
interval before its start (what the process before it may not have checked).

Cost per check: per engine, one call per ``_books.PAGE`` requests it ended; one ledger
read per 500 due requests, off the event loop; in memory, the requests not due yet (those
of the last ``grace`` seconds, and row-less ones that may still run), at most
``MAX_PENDING``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import httpx

from .. import metrics
from ..ledger import LedgerError, UsageRecord
from ._books import BookRead, Cursor, read_book
from ._compare import EngineRequests, Reconciliation, compare, group

logger = logging.getLogger("tokenpace.gateway")

MAX_PENDING = 262_144
"""Gateway requests kept for a later check at most (about four engines' full books); past
it the oldest are dropped uncompared, and the log says how many."""

LOGGED = 20
"""Requests at fault logged per check at most (the rest are counted in one line)."""

RowsOf = Callable[[list[str]], Mapping[str, UsageRecord]]
"""The ledger rows of the given gateway request ids (blocking; ``LedgerError`` when the
database does not answer: the requests wait for a later check)."""


class Reconciler:
    """The periodic check's state: a cursor per engine, the requests not due yet."""

    def __init__(self, *, grace_s: float, hold_s: float, tenant_of: Callable[[str], str],
                 since: float, clock: Callable[[], float] = time.time) -> None:
        """``tenant_of``: the configured tenant of a pacing user or tenant id (``""`` for
        any other: the metrics' labels stay bounded); ``since``: unix time from which
        ended requests are compared."""
        self.grace_s, self.hold_s = grace_s, hold_s
        self.tenant_of = tenant_of
        self.since = since  # engine requests that ended before are not compared
        self.clock = clock
        self._cursors: dict[str, Cursor] = {}  # engine url -> where its next read starts
        self._pending: dict[str, EngineRequests] = {}  # gateway id -> seen, not compared
        self._problems: dict[str, str] = {}  # engine url -> the problem last logged

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def check(self, clients: Mapping[str, httpx.AsyncClient],
                    rows_of: RowsOf) -> Reconciliation:
        """Read every engine in ``clients`` (url -> client with its key), compare the due
        requests with ``rows_of`` (run in a thread) and count the drift in metrics."""
        urls = list(clients)
        reads = await asyncio.gather(*(read_book(clients[u], u, self._cursors.get(u))
                                       for u in urls))
        for read in reads:
            self._take(read)
        for url in list(self._cursors):
            if url not in clients:  # the engine left
                del self._cursors[url]
        self._bound()
        now = self.clock()
        due = [r for r, seen in self._pending.items() if now - seen.last_ended_at >= self.grace_s]
        try:
            rows = await asyncio.to_thread(rows_of, due) if due else {}
        except LedgerError as exc:  # the database is down: compared at a later check
            logger.warning("ledger check: rows not read (%s); %d requests wait", exc,
                           len(self._pending))
            return Reconciliation(pending=due)
        result = compare({r: self._pending[r] for r in due}, rows, now=now,
                         grace_s=self.grace_s, hold_s=self.hold_s, tenant_of=self.tenant_of)
        waiting = set(result.pending)
        for request_id in due:
            if request_id not in waiting:
                del self._pending[request_id]
        self._count(result)
        return result

    def _take(self, read: BookRead) -> None:
        url = read.engine
        if read.problem is not None:
            if self._problems.get(url) != read.problem:
                self._problems[url] = read.problem
                logger.warning("ledger check: engine %s not compared: %s", url, read.problem)
            return
        if self._problems.pop(url, None) is not None:
            logger.info("ledger check: engine %s read again", url)
        if read.forgotten or read.gone:
            logger.warning("ledger check: engine %s %s before they were compared", url,
                           f"forgot {read.forgotten} ended requests" if read.forgotten
                           else "restarted: the requests it ended last were lost")
        self._cursors[url] = read.cursor
        since = self.since
        group((e for e in read.entries if e.ended_at >= since), self._pending)

    def _bound(self) -> None:
        excess = len(self._pending) - MAX_PENDING
        if excess <= 0:
            return
        oldest = sorted(self._pending, key=lambda r: self._pending[r].last_ended_at)[:excess]
        for request_id in oldest:
            del self._pending[request_id]
        logger.warning("ledger check: %d requests dropped uncompared (more than %d waiting)",
                       excess, MAX_PENDING)

    def _count(self, result: Reconciliation) -> None:
        label = self.tenant_of
        for figures in result.tenants.values():
            tenant = label(figures.tenant)
            if figures.unrecorded_tokens:
                metrics.child(metrics.LEDGER_UNRECORDED_TOKENS, tenant).inc(
                    figures.unrecorded_tokens)
            if figures.overcharged_tokens:
                metrics.child(metrics.LEDGER_OVERCHARGED_TOKENS, tenant).inc(
                    figures.overcharged_tokens)
            if figures.unrecorded_requests:
                metrics.child(metrics.LEDGER_UNRECORDED_REQUESTS, tenant).inc(
                    figures.unrecorded_requests)
        for d in result.discrepancies[:LOGGED]:
            logger.warning("ledger check: request %s (tenant %r) %s: engines %d tokens, "
                           "ledger %s", d.request_id, d.tenant, d.kind, d.engine_tokens,
                           "no row" if d.ledger_tokens is None else d.ledger_tokens)
        if len(result.discrepancies) > LOGGED:
            logger.warning("ledger check: %d more requests differ (tokenpace usage "
                           "reconcile lists them)", len(result.discrepancies) - LOGGED)
