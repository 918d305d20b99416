"""A conversation's engine is the same at every gateway replica (``locality:
conversation`` with ``state`` in Redis): real gateway processes, a real ``redis-server``,
two fake engines. One replica moves a conversation (its engine is drained there: the drain
is per replica), and the other replica, which never saw the move and still has both
engines in dispatch, sends the conversation's next turn to where it was moved."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._redis import RedisServer, require_redis_client
from tests.gateway._engine import EngineServer
from tests.gateway.conftest import ADMIN_KEY, GatewayProcess

require_redis_client()

KEY = "sk-t"



@pytest.fixture
def engines() -> Iterator[list[EngineServer]]:
    servers = [EngineServer().start() for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


def turn(gw: GatewayProcess, messages: list[dict[str, str]]) -> None:
    resp = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "fake", "messages": messages, "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    messages += [{"role": "assistant", "content": resp.json()["choices"][0]["message"]
                  ["content"]}, {"role": "user", "content": f"and then {len(messages)}?"}]


def engine_of(engines: list[EngineServer], before: list[int]) -> int:
    """The engine that received the one request sent since ``before`` (its counts)."""
    moved = [i for i, e in enumerate(engines) if len(e.engine.requests) > before[i]]
    assert len(moved) == 1, moved
    return moved[0]


def counts(engines: list[EngineServer]) -> list[int]:
    return [len(e.engine.requests) for e in engines]


def drain(gw: GatewayProcess, engine: EngineServer, on: bool) -> None:
    resp = httpx.post(f"{gw.url}/admin/engines/drain", json={"engine": engine.url, "drain": on},
                      headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert resp.status_code == 200 and resp.json()["draining"] is on, resp.text


def wait_home(redis_server: RedisServer, url: str) -> None:
    """Until the store holds a conversation home on ``url``: a home goes to Redis with the
    store's next flush (every 50 ms), well within one turn of a real model; the fake
    engine answers faster, so the test waits as a client's next turn would."""
    import redis

    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    deadline = time.monotonic() + 10
    try:
        while url not in [client.get(k) for k in client.scan_iter("tokenpace:h:*")]:
            assert time.monotonic() < deadline, "no home written"
            time.sleep(0.02)
    finally:
        client.close()


def test_a_conversation_moved_at_one_replica_is_found_there_by_the_other(
        tmp_path: Path, redis_server: RedisServer, engines: list[EngineServer]) -> None:
    gws: list[GatewayProcess] = []
    for i in range(2):
        home = tmp_path / f"replica-{i}"
        home.mkdir()
        config: dict[str, Any] = {
            "engines": [{"url": e.url, "models": ["fake"], "max_inflight": 8}
                        for e in engines],
            "ledger": f"sqlite:///{home / 'usage.db'}",
            "admin_api_keys": [ADMIN_KEY],
            "tenants": [{"id": "t", "api_keys": [KEY]}],
            "state": {"url": redis_server.url, "timeout": "1s"},
        }
        gws.append(GatewayProcess(home, config).start())
    a, b = gws
    try:
        conversation = [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "plan a trip to Lisbon"}]
        before = counts(engines)
        turn(a, conversation)
        first = engine_of(engines, before)
        # Replica b finds it there too (new to b: read from the store).
        before = counts(engines)
        turn(b, conversation)
        assert engine_of(engines, before) == first
        # Moved at a: its engine drained there (and only there).
        drain(a, engines[first], True)
        before = counts(engines)
        turn(a, conversation)
        moved = engine_of(engines, before)
        assert moved != first
        drain(a, engines[first], False)
        wait_home(redis_server, engines[moved].url)
        # Both engines in dispatch and idle at both replicas: without the shared home b
        # would send the turn to `first` (where b last sent it, and where its key ranks
        # first); it follows the move, as a does.
        for gw in (b, a, b):
            before = counts(engines)
            turn(gw, conversation)
            assert engine_of(engines, before) == moved
    finally:
        for gw in gws:
            gw.stop()
