"""Usage ledger: one row per request, and the budget buckets' levels, in SQLite or Postgres.

The gateway calls :meth:`Ledger.record` on its event loop for every request that ends, so
recording must never wait on the database: rows go into an in-memory queue and one
background thread writes them in batches, one transaction per batch. If the database is
briefly unavailable (locked, restarting) the rows stay queued and the next flush tries
again; only when the queue reaches its bound are new rows dropped, and counted.

Budget levels are written in the same transaction as the rows, so that after a restart the
buckets carry on from the last flush instead of starting full (which would hand every tenant
a fresh burst on each restart).

SQLite (the default) is the standard library's; psycopg 3 is imported only when a
``postgresql://`` URL is opened, so it is an optional dependency.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import threading
from collections import deque
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

from . import _metrics as metrics

__all__ = [
    "DEFAULT_MAX_QUEUE",
    "BudgetState",
    "Ledger",
    "LedgerError",
    "UsageRecord",
    "UsageTotal",
    "open_ledger",
    "parse_ledger_url",
    "resolve_ledger_url",
]

_log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 100_000
"""Rows held in memory while the database is unreachable; one row is a few hundred bytes."""

_SQLITE_BUSY_TIMEOUT_S = 1.0
"""How long a write waits for another connection's lock. Short on purpose: the writer
retries at the next flush anyway, and a blocked writer also blocks :meth:`Ledger.flush`."""

_SQLITE_PREFIX = "sqlite:///"
_POSTGRES_PREFIXES = ("postgresql://", "postgres://")
_ACCEPTED = (
    "sqlite:///relative/path.db, sqlite:////absolute/path.db, "
    "or postgresql://user@host:port/dbname"
)


class LedgerError(RuntimeError):
    """The ledger URL is malformed, or its database cannot be opened, created or written."""


@dataclass(frozen=True)
class UsageRecord:
    """What one request used and how long it took; one row of the ``requests`` table."""

    request_id: str
    tenant: str
    model: str
    lane: str
    prompt_tokens: int
    completion_tokens: int
    cost: float
    queue_ms: float | None
    ttft_ms: float | None
    e2e_ms: float
    finish_reason: str
    started_at: float
    ended_at: float
    # Whether the request reached the engine and is charged: the same rule as the
    # gateway's token metrics. A refused request, or one cancelled while queued, keeps
    # its counted prompt size in ``prompt_tokens`` but is not served.
    served: bool = True


@dataclass(frozen=True)
class BudgetState:
    """A tenant's bucket level for one budget (e.g. ``"20000/10s"``) at unix time ``at``."""

    tenant: str
    budget: str
    level: float
    at: float


@dataclass(frozen=True)
class UsageTotal:
    """Totals for one tenant, model or lane. ``requests`` counts every row, rejected ones
    included; ``rejected`` counts the rows whose finish reason starts with ``rejected:``.
    ``prompt_tokens`` are those of served requests only (what the gateway's
    ``tokenpace_gateway_prompt_tokens`` metric counts); ``unserved_prompt_tokens`` those
    counted for requests that never ran (refused, cancelled while queued, engine error)."""

    key: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost: float
    rejected: int
    unserved_prompt_tokens: int = 0


_RECORD_COLUMNS = (
    "request_id",
    "tenant",
    "model",
    "lane",
    "prompt_tokens",
    "completion_tokens",
    "cost",
    "queue_ms",
    "ttft_ms",
    "e2e_ms",
    "finish_reason",
    "started_at",
    "ended_at",
    "served",
)
_GROUP_COLUMNS = ("tenant", "model", "lane")


def _schema(text: str, integer: str, real: str) -> list[str]:
    """DDL for both databases; only the column type names differ."""
    return [
        f"""CREATE TABLE IF NOT EXISTS requests (
            request_id {text} NOT NULL,
            tenant {text} NOT NULL,
            model {text} NOT NULL,
            lane {text} NOT NULL,
            prompt_tokens {integer} NOT NULL,
            completion_tokens {integer} NOT NULL,
            cost {real} NOT NULL,
            queue_ms {real},
            ttft_ms {real},
            e2e_ms {real} NOT NULL,
            finish_reason {text} NOT NULL,
            started_at {real} NOT NULL,
            ended_at {real} NOT NULL,
            served {integer} NOT NULL DEFAULT 1
        )""",
        "CREATE INDEX IF NOT EXISTS requests_ended_at ON requests (ended_at)",
        "CREATE INDEX IF NOT EXISTS requests_tenant ON requests (tenant)",
        f"""CREATE TABLE IF NOT EXISTS budgets (
            tenant {text} NOT NULL,
            budget {text} NOT NULL,
            level {real} NOT NULL,
            at {real} NOT NULL,
            PRIMARY KEY (tenant, budget)
        )""",
    ]


_UNIQUE_ID_INDEX = "CREATE UNIQUE INDEX IF NOT EXISTS requests_request_id ON requests (request_id)"
# Rows of ledgers written before ``served`` existed: a refusal, or a row that was charged
# nothing at all, was not served (the best the old columns can tell).
_BACKFILL_SERVED = (
    "UPDATE requests SET served = 0 WHERE substr(finish_reason, 1, 9) = 'rejected:' "
    "OR (cost = 0 AND completion_tokens = 0)"
)


def _migrations(has_served: bool, dedupe: str, add_served: str) -> list[str]:
    """Statements that bring a ledger of an older version up to this schema.

    ``requests.request_id`` became unique, so that a batch written again after its commit
    was lost in transit (the connection dropped before the acknowledgement) adds nothing;
    older ledgers may already hold such duplicates, which are removed first.
    """
    out = [] if has_served else [add_served, _BACKFILL_SERVED]
    return out + [dedupe, _UNIQUE_ID_INDEX]


def _redact(url: str) -> str:
    """The URL with any password replaced, so that it can go into messages and logs."""
    return re.sub(r"^([a-z]+://[^:/@]*):[^@/]*@", r"\1:***@", url)


def parse_ledger_url(url: str) -> tuple[str, str]:
    """Split a ledger URL into ``("sqlite", path)`` or ``("postgres", url)``.

    Raises :class:`LedgerError` naming the URL and the accepted forms, so that a config
    typo is reported at start-up rather than as a missing ledger later.
    """
    if url.startswith(_SQLITE_PREFIX):
        path = url[len(_SQLITE_PREFIX):]
        if path and "?" not in path:
            return "sqlite", path
    elif url.startswith(_POSTGRES_PREFIXES):
        return "postgres", url
    raise LedgerError(f"unsupported ledger URL {_redact(url)!r}: expected {_ACCEPTED}")


def resolve_ledger_url(url: str, base_dir: Path) -> str:
    """Make a relative SQLite ledger path relative to ``base_dir`` (the config file's
    directory), so that the gateway and this command find the same file whatever their
    working directory. Other URLs are returned unchanged."""
    if not url.startswith(_SQLITE_PREFIX):
        return url
    path = url[len(_SQLITE_PREFIX):]
    if not path or path == ":memory:":
        return url
    resolved = Path(path).expanduser()
    if not resolved.is_absolute():
        resolved = (base_dir / resolved).absolute()
    return _SQLITE_PREFIX + str(resolved)


class _Backend(Protocol):
    """One database connection. Callers serialise all use under the ledger's DB lock."""

    def write(self, rows: list[tuple[Any, ...]], budgets: list[tuple[Any, ...]]) -> None: ...

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]: ...

    def close(self) -> None: ...


def _insert_sql(placeholder: str) -> str:
    """Idempotent on the request id: writing a row again is a no-op."""
    marks = ", ".join([placeholder] * len(_RECORD_COLUMNS))
    return (f"INSERT INTO requests ({', '.join(_RECORD_COLUMNS)}) VALUES ({marks}) "
            "ON CONFLICT (request_id) DO NOTHING")


def _upsert_sql(placeholder: str) -> str:
    p = placeholder
    return (
        f"INSERT INTO budgets (tenant, budget, level, at) VALUES ({p}, {p}, {p}, {p}) "
        "ON CONFLICT (tenant, budget) DO UPDATE SET level = excluded.level, at = excluded.at"
    )


class _SqliteBackend:
    """SQLite in WAL mode, so that ``tokenpace usage`` can read while the gateway writes."""

    placeholder = "?"

    def __init__(self, path: str, *, create: bool) -> None:
        if not create and path != ":memory:" and not os.path.isfile(path):
            raise LedgerError(f"SQLite ledger {path} does not exist")
        self._path = path
        try:
            # Autocommit mode: transactions are begun and ended explicitly in write().
            # One connection is shared by the writer thread and blocking readers, always
            # under the ledger's DB lock, hence check_same_thread=False.
            self._conn = sqlite3.connect(
                path,
                timeout=_SQLITE_BUSY_TIMEOUT_S,
                isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open SQLite ledger {path}: {exc}") from exc
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            # With WAL, NORMAL loses at most the last transactions on power loss, never
            # on a process crash, and saves an fsync per batch.
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("BEGIN IMMEDIATE")
            for statement in _schema("TEXT", "INTEGER", "REAL"):
                self._conn.execute(statement)
            columns = {row[1] for row in self._conn.execute("PRAGMA table_info(requests)")}
            for statement in _migrations(
                "served" in columns,
                dedupe="DELETE FROM requests WHERE rowid NOT IN "
                       "(SELECT MIN(rowid) FROM requests GROUP BY request_id)",
                add_served="ALTER TABLE requests ADD COLUMN served INTEGER NOT NULL DEFAULT 1",
            ):
                self._conn.execute(statement)
            self._conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._conn.close()
            raise LedgerError(f"cannot create tables in SQLite ledger {path}: {exc}") from exc

    def write(self, rows: list[tuple[Any, ...]], budgets: list[tuple[Any, ...]]) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            if rows:
                conn.executemany(_insert_sql("?"), rows)
            if budgets:
                conn.executemany(_upsert_sql("?"), budgets)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, params).fetchall()

    def close(self) -> None:
        self._conn.close()


class _PostgresBackend:
    """Postgres through psycopg 3; reconnects on the next use after the connection breaks."""

    placeholder = "%s"

    def __init__(self, url: str) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise LedgerError(
                f"ledger URL {_redact(url)!r} needs psycopg 3: pip install 'psycopg[binary]>=3.1'"
            ) from exc
        self._psycopg = psycopg
        self._url = url
        self._conn: Any = None
        try:
            conn = self._connection()
            with conn.transaction():
                # Two gateways starting at once must not migrate the same table together.
                conn.execute("SELECT pg_advisory_xact_lock(7270130512)")
                for statement in _schema("TEXT", "BIGINT", "DOUBLE PRECISION"):
                    conn.execute(statement)
                has_served = conn.execute(
                    "SELECT 1 FROM information_schema.columns WHERE table_schema = "
                    "current_schema() AND table_name = 'requests' AND column_name = 'served'"
                ).fetchone() is not None
                for statement in _migrations(
                    has_served,
                    dedupe="DELETE FROM requests a USING requests b "
                           "WHERE a.request_id = b.request_id AND a.ctid > b.ctid",
                    add_served="ALTER TABLE requests ADD COLUMN served BIGINT NOT NULL DEFAULT 1",
                ):
                    conn.execute(statement)
        except psycopg.Error as exc:
            self.close()
            raise LedgerError(f"cannot open Postgres ledger {_redact(url)}: {exc}") from exc

    def _connection(self) -> Any:
        conn = self._conn
        if conn is None or conn.closed or getattr(conn, "broken", False):
            if conn is not None:
                conn.close()
            self._conn = None
            extra = {} if "connect_timeout" in self._url else {"connect_timeout": 10}
            # Autocommit, so that reads do not leave the session idle in a transaction;
            # writes open one explicitly.
            self._conn = self._psycopg.connect(self._url, autocommit=True, **extra)
        return self._conn

    def write(self, rows: list[tuple[Any, ...]], budgets: list[tuple[Any, ...]]) -> None:
        conn = self._connection()
        with conn.transaction(), conn.cursor() as cur:
            if rows:
                cur.executemany(_insert_sql("%s"), rows)
            if budgets:
                cur.executemany(_upsert_sql("%s"), budgets)

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._connection().cursor() as cur:
            cur.execute(sql, params or None)
            return cur.fetchall()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _check_settings(flush_interval_s: float, max_batch: int, max_queue: int) -> None:
    if not flush_interval_s > 0:
        raise ValueError(f"flush_interval_s must be positive, got {flush_interval_s}")
    if max_batch < 1 or max_queue < 1:
        raise ValueError(f"max_batch and max_queue must be >= 1, got {max_batch}, {max_queue}")


def open_ledger(
    url: str,
    *,
    flush_interval_s: float = 0.5,
    max_batch: int = 500,
    max_queue: int = DEFAULT_MAX_QUEUE,
    create: bool = True,
) -> Ledger:
    """Open (and, unless ``create`` is false, create) the ledger at ``url``.

    ``sqlite:///path`` is relative to the working directory, ``sqlite:////path`` absolute;
    ``postgresql://`` or ``postgres://`` URLs go to Postgres. Tables and indexes are created
    if missing. ``create=False`` refuses a missing SQLite file, for read-only tools that
    must not leave an empty database behind a typo.
    """
    kind, target = parse_ledger_url(url)
    _check_settings(flush_interval_s, max_batch, max_queue)  # before opening anything
    backend: _SqliteBackend | _PostgresBackend
    if kind == "sqlite":
        backend = _SqliteBackend(target, create=create)
    else:
        backend = _PostgresBackend(target)
    return Ledger(
        backend,
        placeholder=backend.placeholder,
        flush_interval_s=flush_interval_s,
        max_batch=max_batch,
        max_queue=max_queue,
    )


class Ledger:
    """The queue in front of the database and the thread that drains it.

    Two locks: ``_queue_lock`` guards the in-memory queue and is only ever held for a few
    list operations, so :meth:`record` cannot stall the event loop; ``_db_lock`` serialises
    every use of the one database connection (writer thread, :meth:`flush`, reads).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        placeholder: str,
        flush_interval_s: float,
        max_batch: int,
        max_queue: int,
    ) -> None:
        _check_settings(flush_interval_s, max_batch, max_queue)
        self._backend = backend
        self._ph = placeholder
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
        row = (
            rec.request_id,
            rec.tenant,
            rec.model,
            rec.lane,
            int(rec.prompt_tokens),
            int(rec.completion_tokens),
            float(rec.cost),
            None if rec.queue_ms is None else float(rec.queue_ms),
            None if rec.ttft_ms is None else float(rec.ttft_ms),
            float(rec.e2e_ms),
            rec.finish_reason,
            float(rec.started_at),
            float(rec.ended_at),
            int(bool(rec.served)),
        )
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

    def _query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._db_lock:
            if self._disconnected:
                raise LedgerError("usage ledger is closed")
            try:
                return self._backend.query(sql, params)
            except Exception as exc:
                raise LedgerError(f"usage ledger read failed: {exc}") from exc

    def load_budgets(self) -> list[BudgetState]:
        """The budget levels saved by the last run, read once at start-up."""
        rows = self._query("SELECT tenant, budget, level, at FROM budgets ORDER BY tenant, budget")
        return [BudgetState(str(t), str(b), float(lv), float(at)) for t, b, lv, at in rows]

    def rows(self, since: float | None = None) -> list[UsageRecord]:
        """Rows that ended at or after ``since`` (unix seconds), oldest first."""
        where, params = self._since(since)
        rows = self._query(
            f"SELECT {', '.join(_RECORD_COLUMNS)} FROM requests{where} "
            "ORDER BY ended_at, started_at, request_id",
            params,
        )
        return [
            UsageRecord(
                request_id=r[0],
                tenant=r[1],
                model=r[2],
                lane=r[3],
                prompt_tokens=int(r[4]),
                completion_tokens=int(r[5]),
                cost=float(r[6]),
                queue_ms=None if r[7] is None else float(r[7]),
                ttft_ms=None if r[8] is None else float(r[8]),
                e2e_ms=float(r[9]),
                finish_reason=r[10],
                started_at=float(r[11]),
                ended_at=float(r[12]),
                served=bool(r[13]),
            )
            for r in rows
        ]

    def usage(self, since: float | None = None, by: str = "tenant") -> list[UsageTotal]:
        """Totals per tenant, model or lane for rows that ended at or after ``since``,
        ordered by key."""
        if by not in _GROUP_COLUMNS:
            raise ValueError(f"by must be one of {', '.join(_GROUP_COLUMNS)}, got {by!r}")
        where, params = self._since(since)
        # substr rather than LIKE 'rejected:%': a literal % would need escaping for psycopg.
        rows = self._query(
            f"SELECT {by}, COUNT(*), SUM(CASE WHEN served = 1 THEN prompt_tokens ELSE 0 END), "
            "SUM(completion_tokens), SUM(cost), "
            "SUM(CASE WHEN substr(finish_reason, 1, 9) = 'rejected:' THEN 1 ELSE 0 END), "
            "SUM(CASE WHEN served = 1 THEN 0 ELSE prompt_tokens END) "
            f"FROM requests{where} GROUP BY {by} ORDER BY {by}",
            params,
        )
        # Postgres returns SUM over BIGINT as numeric (Decimal): normalise the types.
        return [
            UsageTotal(str(k), int(n), int(p or 0), int(c or 0), float(cost or 0.0), int(rej or 0),
                       int(unserved or 0))
            for k, n, p, c, cost, rej, unserved in rows
        ]

    def _since(self, since: float | None) -> tuple[str, tuple[Any, ...]]:
        if since is None:
            return "", ()
        return f" WHERE ended_at >= {self._ph}", (float(since),)
