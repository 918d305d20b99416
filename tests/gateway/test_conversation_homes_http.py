"""One tenant's conversations do not evict another's conversation homes: a real gateway
process in front of two fake engines, with small bounds (2 homes per tenant, 4 in all).
The victim's conversation is moved off the engine a new conversation would go to (that
engine drained for one turn), then another tenant opens ten conversations; the victim's
next turn still goes where its home is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import ADMIN_KEY, GatewayProcess


@pytest.fixture
def engines() -> Iterator[list[EngineServer]]:
    servers = [EngineServer().start() for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


def turn(gw: GatewayProcess, key: str, messages: list[dict[str, str]]) -> None:
    resp = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {key}"},
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


def test_a_tenants_conversations_do_not_evict_anothers_home(
        tmp_path: Path, make_gateway: Any, engines: list[EngineServer]) -> None:
    gw = make_gateway({
        "engines": [{"url": e.url, "models": ["fake"], "max_inflight": 8} for e in engines],
        "ledger": f"sqlite:///{tmp_path / 'usage.db'}",
        "tenants": [{"id": "victim", "api_keys": ["sk-v"]}, {"id": "flood", "api_keys": ["sk-f"]}],
        "max_conversation_homes": 4, "max_conversation_homes_per_tenant": 2,
    })
    victim = [{"role": "system", "content": "be brief"},
              {"role": "user", "content": "plan a trip to Lisbon"}]
    before = counts(engines)
    turn(gw, "sk-v", victim)
    first = engine_of(engines, before)  # where a new conversation of it goes (idle engines)
    drain(gw, engines[first], True)
    before = counts(engines)
    turn(gw, "sk-v", victim)
    home = engine_of(engines, before)
    assert home != first
    drain(gw, engines[first], False)
    for i in range(10):  # ten conversations of another tenant: more than the whole table
        turn(gw, "sk-f", [{"role": "user", "content": f"flood conversation {i}"}])
    for _ in range(2):  # the victim's turns stay at its home (forgotten: back to ``first``)
        before = counts(engines)
        turn(gw, "sk-v", victim)
        assert engine_of(engines, before) == home
