"""The throwaway PostgreSQL server of the ledger tests: ``tokenpace.bench._postgres_server``
(shared with ``tokenpace bench metering``), with "this machine cannot run one" turned into
a skip with the reason, or, in CI (``CI=true``, where ``make test`` installs Debian's
server), a failure.
"""

from __future__ import annotations

import os

import pytest

from tokenpace._process import free_port
from tokenpace.bench._postgres_server import PostgresServer as _Server
from tokenpace.bench._postgres_server import PostgresUnavailable, missing, psycopg

__all__ = ["PostgresServer", "free_port", "psycopg", "require_postgres", "unavailable"]


def unavailable(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI needs a real Postgres for the ledger tests: {why}")
    pytest.skip(why)


def require_postgres() -> None:
    """Skip (fail in CI) unless a throwaway Postgres can run here; starts nothing."""
    why = missing()
    if why is not None:
        unavailable(why)


class PostgresServer(_Server):
    """One throwaway cluster (see ``tokenpace.bench._postgres_server.PostgresServer``)."""

    def __init__(self) -> None:
        try:
            super().__init__()
        except PostgresUnavailable as exc:
            unavailable(str(exc))
