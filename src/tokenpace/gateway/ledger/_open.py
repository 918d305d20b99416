"""From a ledger URL (and a journal directory) to a running :class:`Ledger`."""

from __future__ import annotations

from ._journal import Journal, JournalError
from ._postgres import PostgresBackend
from ._records import LedgerError
from ._sqlite import SqliteBackend
from ._url import parse_ledger_url
from ._writer import DEFAULT_CLOSE_TIMEOUT_S, DEFAULT_JOURNAL_BYTES, Ledger, check_settings


def open_ledger(
    url: str,
    *,
    journal: str | None = None,
    journal_bytes: int = DEFAULT_JOURNAL_BYTES,
    on_full: str = "refuse",
    flush_interval_s: float = 0.5,
    max_batch: int = 500,
    close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
    create: bool = True,
    wait: bool = False,
) -> Ledger:
    """Open (and, unless ``create`` is false, create) the ledger at ``url``.

    ``sqlite:///path`` is relative to the working directory, ``sqlite:////path`` absolute;
    ``postgresql://`` or ``postgres://`` URLs go to Postgres. Tables and indexes are created
    if missing. ``create=False`` refuses a missing SQLite file, for read-only tools that
    must not leave an empty database behind a typo.

    ``journal``: the directory rows wait in before the database has them (``_journal``),
    bounded by ``journal_bytes``; rows an earlier process left there are written first.
    None: a private temporary directory, removed at close (tools and tests: nothing then
    survives the process). ``on_full``: see :data:`ON_FULL`. ``wait``: a Postgres server
    that does not answer now is not an error (the gateway starts during an outage; rows
    wait in the journal and the tables are made when it answers).
    """
    kind, target = parse_ledger_url(url)
    check_settings(flush_interval_s, max_batch, journal_bytes, on_full)  # before opening
    backend: SqliteBackend | PostgresBackend
    if kind == "sqlite":
        backend = SqliteBackend(target, create=create)
    else:
        backend = PostgresBackend(target, wait=wait)
    try:
        journaled = None if journal is None else Journal(journal, max_bytes=journal_bytes)
    except JournalError as exc:
        backend.close()
        raise LedgerError(str(exc)) from exc
    return Ledger(backend, flush_interval_s=flush_interval_s, max_batch=max_batch,
                  journal=journaled, on_full=on_full, close_timeout_s=close_timeout_s)


def default_journal(url: str) -> str | None:
    """The journal directory beside a SQLite ledger (``<file>.journal``); None for
    Postgres, whose journal must be named (a local disk of the gateway's host)."""
    kind, target = parse_ledger_url(url)
    if kind == "sqlite" and target != ":memory:":
        return target + ".journal"
    return None
