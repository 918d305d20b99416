"""The gateway sends the engine's API key on every call to it (trusted-gateway mode)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_A, base_config


def test_every_engine_call_carries_the_configured_key(engine: EngineServer, make_gateway: Any,
                                                      tmp_path: Path) -> None:
    config = base_config(engine.url, tmp_path / "usage.db")
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
