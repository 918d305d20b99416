"""The Postgres ledger, through psycopg 3.

psycopg is imported when a ``postgresql://`` ledger is opened and not before, so that it
stays an optional dependency: a SQLite deployment never needs it installed.

Every call on the server is bounded in time, so that the writer thread (and everything
waiting on the ledger's lock behind it) cannot hang on a server that stopped answering:

- connecting: ``connect_timeout`` (:data:`_CONNECT_TIMEOUT_S`);
- on the server, for the ledger's sessions: ``statement_timeout``, ``lock_timeout`` and
  ``idle_in_transaction_session_timeout``, sent as connection options (reads and the
  migrations at open raise the first two for their own transaction only);
- on an idle connection: TCP keepalives find a peer gone without a FIN;
- on the client, whatever the server does: a watchdog shuts the connection's socket down
  when a call runs :data:`_CALL_MARGIN_S` past its server-side bound. That is the one
  bound that holds when the server is stopped or hung: its kernel still acknowledges
  every packet, so no TCP timeout fires, and it enforces none of its own timeouts.
  (psycopg's ``cancel`` needs the server to act on a cancel request, which a stopped
  server does not.) The call raises psycopg's ``OperationalError``, as for a lost
  connection, and the next call connects again.

Settings the ledger URL gives itself (``?connect_timeout=``, ``?keepalives_idle=``, ``-c
statement_timeout=`` in ``options`` or ``PGOPTIONS``) win over these defaults.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ._records import LedgerError
from ._schema import Dialect, insert_sql, migrations, schema, upsert_sql
from ._url import redact

_log = logging.getLogger("tokenpace.gateway.ledger")

_T = TypeVar("_T")

DIALECT = Dialect(
    text="TEXT",
    integer="BIGINT",
    real="DOUBLE PRECISION",
    dedupe="DELETE FROM requests a USING requests b "
           "WHERE a.request_id = b.request_id AND a.ctid > b.ctid",
)
"""Postgres' type names; duplicates are told apart by ``ctid``."""

_MIGRATION_LOCK = 7270130512
"""Advisory lock key held while the tables are created or migrated."""

_CONNECT_TIMEOUT_S = 10
"""Bound on making a connection (TCP, TLS, start-up, authentication): a few round trips
on a live server; a server that accepts TCP but never answers the start-up (stopped) is
given up on after this."""

_STATEMENT_TIMEOUT_S = 10.0
"""The server's bound on one statement of a write (``statement_timeout``). A write is one
batch of at most ``max_batch`` rows, milliseconds on a live server; past this the server
is in trouble, and giving up costs nothing (the rows wait for the next flush), whereas
waiting holds the ledger's lock that ``flush`` and the reads also take."""

_LOCK_TIMEOUT_S = 5.0
"""The server's bound on waiting for a lock (``lock_timeout``). A write conflicts only
with another session's migration (a brief ``ALTER TABLE``) or with a write of the same
request id; a lock held longer is a stuck session, and the rows can wait for the next
flush instead."""

_READ_TIMEOUT_S = 300.0
"""``statement_timeout`` and ``lock_timeout`` for the reads and for opening (creating and
migrating the tables), set for their own transaction. ``tokenpace usage`` scans every row
in its window (seconds per million rows), and opening removes duplicate request ids with a
scan of the table and may wait for another replica's migration; both are rare, and none
of them holds up the gateway's writes for long."""

_IDLE_IN_TRANSACTION_TIMEOUT_S = 60.0
"""The server ends a ledger session left idle inside a transaction this long
(``idle_in_transaction_session_timeout``). The ledger never pauses inside one, so that is
a gateway stopped or hung mid-write, whose locks would otherwise hold up the other
replicas' migrations."""

_CALL_MARGIN_S = 5.0
"""How long past its server-side bound a call may run before the client gives up on the
server and shuts the socket down. On a live server the server's own timeout error arrives
first (it needs one round trip, plus a rollback); only a server that does not answer at
all reaches this."""

_KEEPALIVES = {"keepalives": "1", "keepalives_idle": "30", "keepalives_interval": "10",
               "keepalives_count": "3"}
"""libpq's TCP keepalive settings: a peer gone without a FIN (host down, NAT state
dropped) is found about 60 s into an idle connection (30 s idle, then three probes 10 s
apart) instead of the kernel's default of over two hours."""


def _sets(options: str, name: str) -> bool:
    """Whether connection ``options`` set the server setting ``name`` (``-c name=...`` or
    ``--name=...``, where a setting may be spelled with dashes)."""
    spelled = name.replace("_", "[-_]")
    return re.search(rf"(?<![A-Za-z0-9]){spelled}(?![A-Za-z0-9_-])", options) is not None


def _session_options(given: str, limits: dict[str, float]) -> str:
    """``options`` for a connection: ``-c name=ms`` for each of ``limits`` that ``given``
    (the URL's or ``PGOPTIONS``' options) does not set, then ``given`` itself, whose
    settings would win anyway (the server applies the last of a name)."""
    ours = [f"-c {name}={round(seconds * 1000)}" for name, seconds in limits.items()
            if not _sets(given, name)]
    return " ".join([*ours, given]).strip()


class _Watchdog:
    """One thread that shuts a connection's socket down when the call armed on it outlives
    its deadline, so that the call raises instead of waiting for a server that will never
    answer. Cost per call: :meth:`arm` and :meth:`disarm` take a lock and notify once
    each; the thread sleeps until the deadline or the next arming, and exists only once
    something was armed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: tuple[float, int] | None = None  # (deadline, socket fd)
        self._fired = False
        self._thread: threading.Thread | None = None  # the one running; None once closed

    def arm(self, fd: int, seconds: float) -> None:
        """Watch the socket ``fd`` for ``seconds`` from now; the caller keeps the socket
        open until it called :meth:`disarm`."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="tokenpace-ledger-watchdog")
                self._thread.start()
            self._armed = (time.monotonic() + seconds, fd)
            self._fired = False
            self._cond.notify_all()

    def disarm(self) -> bool:
        """Stop watching; whether the deadline passed and the socket was shut down."""
        with self._cond:
            self._armed = None
            fired, self._fired = self._fired, False
            return fired

    def close(self) -> None:
        """End the thread (a later :meth:`arm` starts another)."""
        with self._cond:
            self._thread = None
            self._armed = None
            self._cond.notify_all()

    def _run(self) -> None:
        me = threading.current_thread()
        with self._cond:
            while self._thread is me:
                if self._armed is None:
                    self._cond.wait()
                    continue
                deadline, fd = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                # Under the lock, so the caller cannot close the socket (and the number be
                # reused) before it is shut down: it disarms under the same lock first.
                self._armed = None
                self._fired = True
                try:
                    with socket.socket(fileno=os.dup(fd)) as sock:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by the peer: the call fails by itself


class PostgresBackend:
    """Postgres through psycopg 3; reconnects on the next use after the connection breaks
    or a call outlived its bound.

    A write is bounded by ``statement_timeout_s`` on the server and by ``statement_timeout_s
    + margin_s`` on the client; a read and the open by ``read_timeout_s`` (+ ``margin_s``);
    a lock wait in a write by ``lock_timeout_s``. The defaults are the module's constants;
    the keywords are for tests and tools. A call that outlives its client bound raises
    psycopg's ``OperationalError`` and leaves no connection behind.
    """

    placeholder = "%s"

    def __init__(self, url: str, *, statement_timeout_s: float = _STATEMENT_TIMEOUT_S,
                 lock_timeout_s: float = _LOCK_TIMEOUT_S,
                 read_timeout_s: float = _READ_TIMEOUT_S,
                 margin_s: float = _CALL_MARGIN_S, wait: bool = False) -> None:
        try:
            import psycopg
            from psycopg.conninfo import conninfo_to_dict
        except ImportError as exc:
            raise LedgerError(
                f"ledger URL {redact(url)!r} needs psycopg 3: pip install 'psycopg[binary]>=3.1'"
            ) from exc
        self._psycopg = psycopg
        self._url = url
        self._conn: Any = None
        self._watchdog = _Watchdog()
        self._write_bound = statement_timeout_s + margin_s
        self._read_bound = read_timeout_s + margin_s
        try:
            params = conninfo_to_dict(url)
        except psycopg.Error as exc:
            raise LedgerError(f"cannot open Postgres ledger {redact(url)}: {exc}") from exc
        given = str(params.get("options") or os.environ.get("PGOPTIONS", ""))
        self._extra: dict[str, Any] = {
            "options": _session_options(given, {
                "statement_timeout": statement_timeout_s,
                "lock_timeout": lock_timeout_s,
                "idle_in_transaction_session_timeout": _IDLE_IN_TRANSACTION_TIMEOUT_S,
            }),
            **{k: v for k, v in _KEEPALIVES.items() if k not in params},
        }
        if "connect_timeout" not in params and "PGCONNECT_TIMEOUT" not in os.environ:
            self._extra["connect_timeout"] = _CONNECT_TIMEOUT_S
        # What reads and the open raise for their own transaction; nothing the URL sets.
        self._long = [f"SET LOCAL {name} = {round(read_timeout_s * 1000)}"
                      for name in ("statement_timeout", "lock_timeout")
                      if not _sets(given, name)]
        self._created = False
        try:
            self._bounded(self._read_bound, self._create)
        except psycopg.OperationalError as exc:
            if not wait:
                self.close()
                raise LedgerError(f"cannot open Postgres ledger {redact(url)}: {exc}") from exc
            # A gateway starts during an outage: rows wait in its journal, the tables are
            # made on the first call that reaches the server.
            _log.error("Postgres ledger %s does not answer (%s); rows wait in the journal "
                       "until it does", redact(url), exc)
        except psycopg.Error as exc:
            self.close()
            raise LedgerError(f"cannot open Postgres ledger {redact(url)}: {exc}") from exc

    def _ready(self) -> None:
        """Create or migrate the tables first if the server did not answer at the open."""
        if not self._created:
            self._bounded(self._read_bound, self._create)

    def _create(self, conn: Any) -> None:
        with conn.transaction():
            for statement in self._long:
                conn.execute(statement)
            # Two gateways starting at once must not migrate the same table together.
            conn.execute(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
            for statement in schema(DIALECT):
                conn.execute(statement)
            # One query for every column a migration may add, as SQLite's table_info.
            columns = {name for (name,) in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = "
                "current_schema() AND table_name = 'requests'"
            ).fetchall()}
            unique = bool(conn.execute(
                "SELECT 1 FROM pg_indexes WHERE schemaname = current_schema() AND "
                "tablename = 'requests' AND indexname = 'requests_request_id'").fetchall())
            for statement in migrations(columns, DIALECT, unique_ids=unique):
                conn.execute(statement)
        self._created = True

    def _connection(self) -> Any:
        conn = self._conn
        if conn is None or conn.closed or getattr(conn, "broken", False):
            self._drop()
            # Autocommit, so that reads do not leave the session idle in a transaction;
            # writes open one explicitly.
            self._conn = self._psycopg.connect(self._url, autocommit=True, **self._extra)
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    def _bounded(self, seconds: float, call: Callable[[Any], _T]) -> _T:
        """``call(connection)`` under the watchdog. Past ``seconds`` its socket is shut
        down and the call raises psycopg's ``OperationalError`` (what a lost connection
        raises, so callers tell it from a refused row alike) saying so; the connection is
        dropped, also when the watchdog fired just as the call returned (whose result
        stands). One call at a time: callers serialise under the ledger's lock."""
        conn = self._connection()
        self._watchdog.arm(conn.fileno(), seconds)
        try:
            result = call(conn)
        except BaseException as exc:
            fired = self._watchdog.disarm()
            if fired:
                self._drop()
            if fired and isinstance(exc, Exception):
                raise self._psycopg.OperationalError(
                    f"no answer from Postgres within {seconds:g} s; connection dropped "
                    f"({exc})") from exc
            raise
        if self._watchdog.disarm():
            self._drop()
        return result

    def write(self, rows: list[tuple[Any, ...]], budgets: list[tuple[Any, ...]]) -> None:
        self._ready()

        def run(conn: Any) -> None:
            with conn.transaction(), conn.cursor() as cur:
                if rows:
                    cur.executemany(insert_sql(self.placeholder), rows)
                if budgets:
                    cur.executemany(upsert_sql(self.placeholder), budgets)

        self._bounded(self._write_bound, run)

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        self._ready()

        def run(conn: Any) -> list[tuple[Any, ...]]:
            with conn.transaction(), conn.cursor() as cur:
                for statement in self._long:
                    cur.execute(statement)
                cur.execute(sql, params or None)
                return cur.fetchall()

        return self._bounded(self._read_bound, run)

    def ping(self) -> None:
        """One trivial query within the write bound: whether the server answers now."""
        self._bounded(self._write_bound, lambda conn: conn.execute("SELECT 1").fetchall())

    def close(self) -> None:
        self._watchdog.close()
        self._drop()
