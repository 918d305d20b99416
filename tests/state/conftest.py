"""Stored state against real servers started by the tests: the state store in a
``redis-server`` per test; the ledger and the batch store in a throwaway PostgreSQL
server per module (``tests._postgres``: skipped without the binaries or psycopg, failed
in CI), with a fresh database per test."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._postgres import PostgresServer, psycopg
from tests._redis import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[str]:
    """Start a Postgres server for this module; yields the admin URL."""
    server = PostgresServer()
    try:
        yield server.start().url
    finally:
        server.remove()


_db_numbers = itertools.count()


@pytest.fixture
def pg_url(postgres_server: str) -> Iterator[str]:
    """A fresh database per test, so every test starts from an empty ledger."""
    name = f"ledger_{os.getpid()}_{next(_db_numbers)}"
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    yield postgres_server.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty batch store database of each kind (Postgres: ``pg_url``)."""
    if request.param == "sqlite":
        return "sqlite:///" + str(tmp_path / "usage.batches.db")
    return str(request.getfixturevalue("pg_url"))
