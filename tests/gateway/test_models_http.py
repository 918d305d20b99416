"""Several models behind one gateway (issue 26), over real HTTP: routing by model name,
404 ``model_not_found`` decided without an engine call, per-tenant ``/v1/models``, aliases
rewritten to the served name, per-model cost in the ledger, one pool over two engines."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.gateway._engine import EngineServer, FakeEngine

KEY_ALL, KEY_CHAT = "sk-all", "sk-chat-only"


@pytest.fixture
def fleet(make_gateway: Any, tmp_path: Any) -> Any:
    """Two engines serving "chat" (learned from their /v1/models), one serving "code"
    (configured); a tenant for every model and one allowed only "chat"."""
    engines = [EngineServer(FakeEngine(models=("chat",))).start(),
               EngineServer(FakeEngine(models=("chat",))).start(),
               EngineServer(FakeEngine(models=("code",))).start()]
    config = {
        "engines": [{"url": engines[0].url}, {"url": engines[1].url},
                    {"url": engines[2].url, "models": ["code"]}],
        "models": [{"name": "chat", "aliases": ["gpt-4o"]},
                   {"name": "code", "cost": {"prompt": 3, "completion": 5}}],
        "cost": {"prompt": 1, "completion": 2},
        "ledger": f"sqlite:///{tmp_path / 'u.db'}",
        "tenants": [{"id": "all", "api_keys": [KEY_ALL]},
                    {"id": "chatty", "api_keys": [KEY_CHAT], "models": ["gpt-4o"]}],
    }
    gw = make_gateway(config)
    yield gw, engines
    for e in engines:
        e.stop()


def complete(gw: Any, key: str, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/completions", headers={"authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": [1, 2, 3], "max_tokens": 4, **extra},
                      timeout=30)


def test_unknown_or_forbidden_model_is_404_model_not_found_without_an_engine_call(
        fleet: Any) -> None:
    gw, engines = fleet
    for key, model in ((KEY_ALL, "gpt-5"), (KEY_CHAT, "code")):
        resp = complete(gw, key, model)
        assert resp.status_code == 404, resp.text
        error = resp.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert model in error["message"]
    assert all(not e.engine.requests for e in engines)


def test_models_lists_exactly_the_tenants_models_with_aliases(fleet: Any) -> None:
    gw, _ = fleet

    def models(key: str) -> dict[str, Any]:
        resp = httpx.get(f"{gw.url}/v1/models", headers={"authorization": f"Bearer {key}"})
        assert resp.status_code == 200
        assert resp.json()["object"] == "list"
        return {m["id"]: m for m in resp.json()["data"]}

    every = models(KEY_ALL)
    assert sorted(every) == ["chat", "code", "gpt-4o"]
    assert every["gpt-4o"]["root"] == "chat" and every["gpt-4o"]["parent"] == "chat"
    assert sorted(models(KEY_CHAT)) == ["chat", "gpt-4o"]
    assert httpx.get(f"{gw.url}/v1/models").status_code == 401


def test_requests_go_to_their_models_pool_and_an_alias_reaches_it_as_the_served_name(
        fleet: Any) -> None:
    gw, engines = fleet
    assert complete(gw, KEY_CHAT, "gpt-4o").status_code == 200
    assert complete(gw, KEY_ALL, "code").status_code == 200
    chat_bodies = [s.body for e in engines[:2] for s in e.engine.requests]
    assert [b["model"] for b in chat_bodies] == ["chat"]
    assert [s.body["model"] for s in engines[2].engine.requests] == ["code"]
    rows = {r.model: r for r in gw.rows(2)}
    assert set(rows) == {"chat", "code"}  # the ledger has served names, not aliases
    code = rows["code"]  # its own cost: 3 x prompt + 5 x completion
    assert code.cost == 3 * code.prompt_tokens + 5 * code.completion_tokens
    chat = rows["chat"]  # the top-level cost
    assert chat.cost == chat.prompt_tokens + 2 * chat.completion_tokens


def test_one_tenant_uses_both_engines_of_its_pool(fleet: Any) -> None:
    """Pinning kept a tenant on one engine; an unpaced tenant's concurrent requests now
    spread over the pool (held at the engines' gates until both have some)."""
    gw, engines = fleet
    gates = [threading.Event(), threading.Event()]
    for e, gate in zip(engines[:2], gates):
        e.engine.gate = gate
    threads = [threading.Thread(target=complete, args=(gw, KEY_ALL, "chat")) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        deadline = 200
        while sum(e.engine.active for e in engines[:2]) < 8 and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        counts = [e.engine.active for e in engines[:2]]
        assert sum(counts) == 8 and min(counts) >= 2, counts
    finally:
        for gate in gates:
            gate.set()
        for t in threads:
            t.join()
