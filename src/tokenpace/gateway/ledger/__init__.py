"""Usage ledger: one row per request, and the budget buckets' levels, in SQLite or Postgres.

The gateway calls :meth:`Ledger.open` before it sends a request to an engine and
:meth:`Ledger.record` when the request ends, on its event loop, so neither may wait on the
database: both append to a journal on local disk (``_journal``), which survives a SIGKILL,
and one background thread writes the journal's rows in batches, one transaction per batch.
While the database is unavailable the rows wait in the journal, up to its bound in bytes,
across restarts; a row the database refuses for its values goes to a dead-letter file and
every other row is written. An open without its row, found at start-up, is a request that
was in flight when the process died (:meth:`Ledger.orphans`).

Budget levels are journaled too and written in the same transaction as the rows, so that
after a restart the buckets carry on from the last snapshot instead of starting full (which
would hand every tenant a fresh burst on each restart).

SQLite (the default) is the standard library's; psycopg 3 is imported only when a
``postgresql://`` URL is opened, so it is an optional dependency.

One module a concern, so that each database's code and the writer's threading can be read
alone: ``_records`` (the values and the error), ``_url`` (ledger URLs), ``_schema`` (tables,
migrations, the row layout both databases share and the cleaning that makes any record a
row both accept), ``_sqlite`` and ``_postgres`` (one connection each; Postgres's time
limits), ``_journal`` (the segments on disk), ``_writer`` (:class:`Ledger`: the journal's
reader thread, the dead-letter file and the connection's lock), ``_queries`` (the reads:
saved budgets, rows, ``tokenpace usage`` totals), ``_open`` (URL to ledger), ``_cli``
(``tokenpace usage``), ``_transaction`` (one write transaction on either database, for the
other stores in the same database). Other modules import only the names below.
"""

from ._cli import format_table, main as usage_main, parse_since
from ._open import default_journal, open_ledger
from ._records import BudgetState, LedgerError, UsageRecord, UsageTotal
from ._schema import RECORD_COLUMNS, record_from_row
from ._transaction import connect_postgres, import_psycopg, usable, write_transaction
from ._url import parse_ledger_url, redact, resolve_ledger_url
from ._writer import DEFAULT_JOURNAL_BYTES, INTERRUPTED, ON_FULL, Ledger

__all__ = [
    "DEFAULT_JOURNAL_BYTES",
    "INTERRUPTED",
    "RECORD_COLUMNS",
    "ON_FULL",
    "BudgetState",
    "connect_postgres",
    "Ledger",
    "LedgerError",
    "UsageRecord",
    "UsageTotal",
    "default_journal",
    "format_table",
    "import_psycopg",
    "open_ledger",
    "redact",
    "parse_since",
    "record_from_row",
    "parse_ledger_url",
    "resolve_ledger_url",
    "usable",
    "usage_main",
    "write_transaction",
]
