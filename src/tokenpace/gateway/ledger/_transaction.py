"""What the stores that share the ledger's database (batches, the admin registry) need of
it: psycopg imported with a clear error, and one write transaction on either database."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ._records import LedgerError


def import_psycopg(store: str) -> Any:
    """The ``psycopg`` module (3.x), or a ``LedgerError`` naming ``store`` (e.g. "the batch
    store in Postgres") and how to install it: an optional dependency."""
    try:
        import psycopg
    except ImportError as exc:
        raise LedgerError(f"{store} needs psycopg 3: "
                          "pip install 'psycopg[binary]>=3.1'") from exc
    return psycopg


@contextmanager
def write_transaction(conn: Any, sqlite: bool) -> Iterator[None]:
    """Run the block in one transaction on ``conn``: committed when it ends, rolled back
    when it raises. SQLite takes its write lock at once (``BEGIN IMMEDIATE``), so writers
    on one file (replicas) serialize at the start instead of failing at the commit; a
    psycopg connection uses its own ``transaction()``. The caller holds whatever lock
    guards ``conn`` in its process."""
    if sqlite:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    else:
        with conn.transaction():
            yield
