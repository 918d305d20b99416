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

One module a concern, so that each database's code and the writer's threading can be read
alone: ``_records`` (the values and the error), ``_url`` (ledger URLs), ``_schema`` (tables,
migrations and the row layout both databases share), ``_sqlite`` and ``_postgres`` (one
connection each), ``_writer`` (:class:`Ledger`: the queue, its thread and the connection's
lock), ``_queries`` (the reads: saved budgets, rows, ``tokenpace usage`` totals), ``_open``
(URL to ledger), ``_cli`` (``tokenpace usage``). Other modules import only the names below.
"""

from ._cli import main as usage_main, parse_since
from ._open import open_ledger
from ._records import BudgetState, LedgerError, UsageRecord, UsageTotal
from ._url import parse_ledger_url, resolve_ledger_url
from ._writer import DEFAULT_MAX_QUEUE, Ledger

__all__ = [
    "DEFAULT_MAX_QUEUE",
    "BudgetState",
    "Ledger",
    "LedgerError",
    "UsageRecord",
    "UsageTotal",
    "open_ledger",
    "parse_since",
    "parse_ledger_url",
    "resolve_ledger_url",
    "usage_main",
]
