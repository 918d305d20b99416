"""The SQLite ledger: the standard library's sqlite3, one connection in WAL mode."""

from __future__ import annotations

import os
import sqlite3
from typing import Any

from ._records import LedgerError
from ._schema import Dialect, insert_sql, migrations, schema, upsert_sql

DIALECT = Dialect(
    text="TEXT",
    integer="INTEGER",
    real="REAL",
    dedupe="DELETE FROM requests WHERE rowid NOT IN "
           "(SELECT MIN(rowid) FROM requests GROUP BY request_id)",
)
"""SQLite's type names; duplicates are told apart by ``rowid``."""

_BUSY_TIMEOUT_S = 1.0
"""How long a write waits for another connection's lock. Short on purpose: the writer
retries at the next flush anyway, and a blocked writer also blocks :meth:`Ledger.flush`."""


class SqliteBackend:
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
                timeout=_BUSY_TIMEOUT_S,
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
            for statement in schema(DIALECT):
                self._conn.execute(statement)
            columns = {row[1] for row in self._conn.execute("PRAGMA table_info(requests)")}
            unique = any(row[1] == "requests_request_id"
                         for row in self._conn.execute("PRAGMA index_list(requests)"))
            for statement in migrations(columns, DIALECT, unique_ids=unique):
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
                conn.executemany(insert_sql(self.placeholder), rows)
            if budgets:
                conn.executemany(upsert_sql(self.placeholder), budgets)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, params).fetchall()

    def ping(self) -> None:
        self._conn.execute("SELECT 1").fetchall()

    def close(self) -> None:
        self._conn.close()
