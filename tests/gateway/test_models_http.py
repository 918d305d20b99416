"""Several models behind one gateway, over real HTTP: routing by model name,
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
    spread over the pool (held at the engines' gates until both have some). Each request
    its own conversation: turns of one conversation stay together within
    ``conversation_affinity``."""
    gw, engines = fleet
    gates = [threading.Event(), threading.Event()]
    for e, gate in zip(engines[:2], gates):
        e.engine.gate = gate
    threads = [threading.Thread(target=complete, args=(gw, KEY_ALL, "chat"),
                                kwargs={"prompt": [1, 2, i]}) for i in range(8)]
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


def test_an_engine_whose_names_cannot_be_read_is_reported_once(make_gateway: Any,
                                                               tmp_path: Any) -> None:
    """The gateway asks again with every health check (every 2 s); the warning that says
    to set ``engines[].models`` is logged once per answer, not every time."""
    broken = EngineServer(FakeEngine(models_status=404)).start()
    good = EngineServer(FakeEngine(models=("chat",))).start()
    try:
        gw = make_gateway({"engines": [{"url": broken.url}, {"url": good.url}],
                           "ledger": f"sqlite:///{tmp_path / 'u.db'}",
                           "tenants": [{"id": "all", "api_keys": [KEY_ALL]}]})
        deadline = 100
        while deadline and sum(p == "/v1/models" for p, _ in broken.engine.other_calls) < 3:
            threading.Event().wait(0.1)
            deadline -= 1
        assert sum(p == "/v1/models" for p, _ in broken.engine.other_calls) >= 3
        assert complete(gw, KEY_ALL, "chat").status_code == 200
        assert gw.log().count("cannot read its model names") == 1, gw.log()
    finally:
        broken.stop()
        good.stop()


def test_tokenize_reaches_the_models_pool_and_is_never_charged(fleet: Any) -> None:
    """``POST /tokenize`` for tenants: routed by model (an alias becomes its served name),
    404 for a model the tenant may not use, 401 without a key, the tenant's only model
    when it names none; no ledger row, nothing reserved."""
    gw, engines = fleet

    def tokenize(key: str | None, body: Any) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{gw.url}/tokenize", headers=headers, timeout=30,
                          content=body if isinstance(body, bytes) else None,
                          json=None if isinstance(body, bytes) else body)

    resp = tokenize(KEY_CHAT, {"model": "gpt-4o", "prompt": "hello there"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["count"] == engines[0].engine.prompt_tokens({"prompt": "hello there"})
    seen = [b for e in engines for b in e.engine.tokenize_bodies]
    assert seen[-1] == {"model": "chat", "prompt": "hello there"}
    assert tokenize(KEY_CHAT, {"prompt": "hi"}).status_code == 200  # its only model
    missing = tokenize(KEY_ALL, {"prompt": "hi"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    refused = tokenize(KEY_CHAT, {"model": "code", "prompt": "hi"})
    assert refused.status_code == 404
    assert refused.json()["error"]["code"] == "model_not_found"
    assert tokenize(None, {"model": "chat", "prompt": "hi"}).status_code == 401
    bad = tokenize(KEY_ALL, b'{"model": "chat", "prompt": NaN}')
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_number"
    assert engines[2].engine.tokenized == 0  # the code engine was never asked
    assert gw.rows(0, timeout_s=0.5) == []


def test_a_route_the_gateway_does_not_serve_names_those_it_does(fleet: Any) -> None:
    gw, _ = fleet
    resp = httpx.post(f"{gw.url}/v1/moderations", headers={"authorization": f"Bearer {KEY_ALL}"},
                      json={"model": "chat", "input": "hi"}, timeout=30)
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["code"] == "not_found"
    for route in ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
                  "POST /v1/embeddings", "POST /v1/rerank", "POST /tokenize", "POST /detokenize"):
        assert route in error["message"], error["message"]
