"""The Postgres ledger, through psycopg 3.

psycopg is imported when a ``postgresql://`` ledger is opened and not before, so that it
stays an optional dependency: a SQLite deployment never needs it installed.
"""

from __future__ import annotations

from typing import Any

from ._records import LedgerError
from ._schema import insert_sql, migrations, schema, upsert_sql
from ._url import redact

_MIGRATION_LOCK = 7270130512
"""Advisory lock key held while the tables are created or migrated."""


class PostgresBackend:
    """Postgres through psycopg 3; reconnects on the next use after the connection breaks."""

    placeholder = "%s"

    def __init__(self, url: str) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise LedgerError(
                f"ledger URL {redact(url)!r} needs psycopg 3: pip install 'psycopg[binary]>=3.1'"
            ) from exc
        self._psycopg = psycopg
        self._url = url
        self._conn: Any = None
        try:
            conn = self._connection()
            with conn.transaction():
                # Two gateways starting at once must not migrate the same table together.
                conn.execute(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
                for statement in schema("TEXT", "BIGINT", "DOUBLE PRECISION"):
                    conn.execute(statement)
                # One query for every column a migration may add, as SQLite's table_info.
                columns = {name for (name,) in conn.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_schema = "
                    "current_schema() AND table_name = 'requests'"
                ).fetchall()}
                for statement in migrations(
                    "served" in columns,
                    dedupe="DELETE FROM requests a USING requests b "
                           "WHERE a.request_id = b.request_id AND a.ctid > b.ctid",
                    add_served="ALTER TABLE requests ADD COLUMN served BIGINT NOT NULL DEFAULT 1",
                    has_route="route" in columns,
                    has_application="application" in columns,
                    has_cached="cached_prompt_tokens" in columns,
                    has_batch="batch_id" in columns,
                    integer="BIGINT",
                ):
                    conn.execute(statement)
        except psycopg.Error as exc:
            self.close()
            raise LedgerError(f"cannot open Postgres ledger {redact(url)}: {exc}") from exc

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
                cur.executemany(insert_sql(self.placeholder), rows)
            if budgets:
                cur.executemany(upsert_sql(self.placeholder), budgets)

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._connection().cursor() as cur:
            cur.execute(sql, params or None)
            return cur.fetchall()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
