"""The state store against a real ``redis-server`` started per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._redis import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()
