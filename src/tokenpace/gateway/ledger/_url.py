"""Ledger URLs: which database, and where.

Parsed when the config loads, so that a typo is reported at start-up rather than as a
missing ledger later; passwords are redacted before a URL reaches a message or a log.
"""

from __future__ import annotations

from pathlib import Path

from ..._redact import redact as redact_text

from ._records import LedgerError

_SQLITE_PREFIX = "sqlite:///"
_POSTGRES_PREFIXES = ("postgresql://", "postgres://")
_ACCEPTED = (
    "sqlite:///relative/path.db, sqlite:////absolute/path.db, "
    "or postgresql://user@host:port/dbname"
)


def redact(url: str) -> str:
    """The URL with any password replaced, so that it can go into messages and logs."""
    return redact_text(url)


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
    raise LedgerError(f"unsupported ledger URL {redact(url)!r}: expected {_ACCEPTED}")


def resolve_ledger_url(url: str, base_dir: Path) -> str:
    """Make a relative SQLite ledger path relative to ``base_dir`` (the config file's
    directory), so that the gateway and ``tokenpace usage`` find the same file whatever
    their working directory. Other URLs are returned unchanged."""
    if not url.startswith(_SQLITE_PREFIX):
        return url
    path = url[len(_SQLITE_PREFIX):]
    if not path or path == ":memory:":
        return url
    resolved = Path(path).expanduser()
    if not resolved.is_absolute():
        resolved = (base_dir / resolved).absolute()
    return _SQLITE_PREFIX + str(resolved)
