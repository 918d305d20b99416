"""What the stores that share the ledger's database (batches, the admin registry) need of
it: psycopg imported with a clear error, a bounded Postgres connection made again when it
broke, and one write transaction on either database."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
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


PG_CONNECT_TIMEOUT_S = 10
"""Bound on connecting to Postgres (a few round trips on a live server)."""

PG_KEEPALIVES = {"keepalives": "1", "keepalives_idle": "30", "keepalives_interval": "10",
                 "keepalives_count": "3"}
"""libpq's TCP keepalives (as the ledger's): a peer gone without a FIN is found about a
minute after it went quiet, instead of the kernel's two hours."""


def connect_postgres(psycopg: Any, where: str, statement_timeout_ms: int) -> Any:
    """A new Postgres connection for a store beside the ledger: autocommit (a read leaves
    no transaction open), bounded in time to connect (``PG_CONNECT_TIMEOUT_S``), TCP
    keepalives, and server-side bounds of ``statement_timeout_ms`` on a statement, a lock
    wait and an idle transaction, so a call under the store's lock does not wait for ever
    on a lock, a stuck statement or a peer gone without a word. What the URL (or
    ``PGOPTIONS`` / ``PGCONNECT_TIMEOUT``) sets itself wins."""
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(where)
    given = str(params.get("options") or os.environ.get("PGOPTIONS", ""))
    ours = " ".join(f"-c {name}={statement_timeout_ms}" for name in (
        "statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout"))
    extra: dict[str, Any] = {k: v for k, v in PG_KEEPALIVES.items() if k not in params}
    if "connect_timeout" not in params and "PGCONNECT_TIMEOUT" not in os.environ:
        extra["connect_timeout"] = PG_CONNECT_TIMEOUT_S
    # The server applies the last setting of a name: the URL's own come after ours.
    return psycopg.connect(where, autocommit=True, options=f"{ours} {given}".strip(),
                           **extra)


def usable(conn: Any, connect: Callable[[], Any]) -> Any:
    """``conn`` if it is open and not broken (the server restarted, the network dropped
    it: the call that found out raised psycopg's ``OperationalError``), else a new one
    from ``connect`` (``conn`` closed first). Call under the lock that guards ``conn``."""
    if conn is not None and not conn.closed and not getattr(conn, "broken", False):
        return conn
    if conn is not None:
        conn.close()
    return connect()


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
