"""From a ledger URL to a running :class:`Ledger` on the database it names."""

from __future__ import annotations

from ._postgres import PostgresBackend
from ._sqlite import SqliteBackend
from ._url import parse_ledger_url
from ._writer import DEFAULT_MAX_QUEUE, Ledger, check_settings


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
    check_settings(flush_interval_s, max_batch, max_queue)  # before opening anything
    backend: SqliteBackend | PostgresBackend
    if kind == "sqlite":
        backend = SqliteBackend(target, create=create)
    else:
        backend = PostgresBackend(target)
    return Ledger(backend, flush_interval_s=flush_interval_s, max_batch=max_batch,
                  max_queue=max_queue)
