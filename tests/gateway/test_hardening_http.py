"""Over real HTTP: the engine's API key on every call; per-tenant cache salts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

import time

import pytest

from tests.gateway._engine import EngineServer, FakeEngine
from tests.gateway.conftest import KEY_A, KEY_B, base_config


def test_every_engine_call_carries_the_configured_key(engine: EngineServer, make_gateway: Any,
                                                      tmp_path: Path) -> None:
    # A prompt cap makes the gateway count prompts with the engine's /tokenize first.
    config = base_config(engine.url, tmp_path / "usage.db", max_input_tokens=1000)
    config["engines"][0]["api_key"] = "sk-engine-secret"
    gw = make_gateway(config)
    for stream in (False, True):
        resp = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                          headers={"authorization": f"Bearer {KEY_A}"},
                          json={"model": "fake", "max_tokens": 2, "stream": stream,
                                "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200, resp.text
    assert httpx.get(f"{gw.url}/v1/models", headers={"authorization": f"Bearer {KEY_A}"}
                     ).status_code == 200
    seen = engine.engine.requests
    assert len(seen) == 2
    for request in seen:
        assert request.headers.get("authorization") == "Bearer sk-engine-secret"
    # /tokenize, /health, /metrics and /v1/models go through the same client.
    assert engine.engine.other_calls and all(
        h.get("authorization") == "Bearer sk-engine-secret" for _, h in engine.engine.other_calls)
    assert {path for path, _ in engine.engine.other_calls} >= {"/tokenize", "/health", "/v1/models"}


def test_tenants_get_distinct_cache_salts_unless_they_share(engine: EngineServer, make_gateway: Any,
                                                            tmp_path: Path) -> None:
    config = base_config(engine.url, tmp_path / "usage.db")
    gw = make_gateway(config)

    def salt(key: str, **extra: Any) -> Any:
        resp = httpx.post(f"{gw.url}/v1/completions", timeout=30,
                          headers={"authorization": f"Bearer {key}"},
                          json={"model": "fake", "max_tokens": 1, "prompt": "same", **extra})
        assert resp.status_code == 200, resp.text
        return engine.engine.requests[-1].body.get("cache_salt")

    a, b = salt(KEY_A), salt(KEY_B)
    assert a and b and a != b
    assert salt(KEY_A) == a, "stable for a tenant"
    assert salt(KEY_B, cache_salt=a) != a, "a client cannot adopt another tenant's salt"
    gw.stop()
    config["tenants"][1]["share_prefix_cache"] = True
    gw = make_gateway(config)
    assert salt(KEY_B) is None
    assert salt(KEY_A) == a


@pytest.mark.parametrize("reported, warned", [("fcfs", True), (None, True), ("priority", False)])
def test_priority_lanes_in_front_of_an_engine_without_priority_are_reported(
        make_gateway: Any, tmp_path: Path, reported: str | None, warned: bool) -> None:
    engine = EngineServer(FakeEngine(scheduling_policy=reported)).start()
    try:
        config = base_config(engine.url, tmp_path / "usage.db")
        config["engines"][0]["scheduling_policy"] = "priority"
        gw = make_gateway(config)
        deadline = time.monotonic() + 10
        while True:  # the first health check runs as the gateway starts
            health = gw.health()["engines"][0]
            if health["scheduling_policy"]["engine"] == (reported or "unknown") \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert health["scheduling_policy"] == {"configured": "priority",
                                               "engine": reported or "unknown"}
        assert ("warning" in health) == warned, health
        assert ("scheduling_policy: priority" in gw.log()) == warned, gw.log()
    finally:
        engine.stop()


def test_usage_and_metrics_agree_on_served_prompt_tokens(engine: EngineServer, make_gateway: Any,
                                                        tmp_path: Path, capsys: Any) -> None:
    import json

    from tokenpace.gateway.ledger._cli import main as usage_main

    gateway = make_gateway(base_config(engine.url, tmp_path / "usage.db", max_input_tokens=20))

    def complete(prompt: str) -> int:
        return httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                          headers={"authorization": f"Bearer {KEY_A}"},
                          json={"model": "fake", "prompt": prompt, "max_tokens": 2}).status_code

    assert [complete("twelve bytes"), complete("twelve bytes")] == [200, 200]
    # Counted (31 tokens each), then refused by max_input_tokens (20): never served.
    assert [complete("y" * 30) for _ in range(3)] == [400, 400, 400]
    rows = gateway.rows(5)
    assert len(rows) == 5
    assert usage_main(["--config", str(gateway.config_path), "--json"]) == 0
    (team_a,) = json.loads(capsys.readouterr().out)
    metric = gateway.metric("tokenpace_gateway_prompt_tokens_total", tenant="team-a")
    assert team_a["prompt_tokens"] == metric == 2 * 13
    assert team_a["unserved_prompt_tokens"] == 3 * 31
    assert team_a["requests"] == 5 and team_a["rejected"] == 3
