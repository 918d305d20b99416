"""Cached prompt tokens over real HTTP: a ``tokenpace gateway`` process in front
of the fake engine reporting ``prompt_tokens_details.cached_tokens`` as vLLM does with
``--enable-prompt-tokens-details``; the tenant's budget, its ledger rows and the metrics are
charged at ``cost.cached_prompt`` for the cached part, in full where the engine says
nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_A, base_config

BUDGET = 10_000


def post(url: str, body: dict[str, Any], path: str) -> httpx.Response:
    return httpx.post(url + path, content=json.dumps(body), timeout=30,
                      headers={"authorization": f"Bearer {KEY_A}"})


def test_budget_ledger_and_metrics_charge_cached_prompt_tokens_at_their_price(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    config = base_config(engine.url, tmp_path / "u.db",
                         budgets=[{"tokens": BUDGET, "per": "1d"}])
    config["cost"] = {"prompt": 1.0, "cached_prompt": 0.25, "completion": 2.0}
    config["tenants"][1]["applications"] = [{"id": "bot", "api_keys": ["sk-bot"]}]
    gw = make_gateway(config)
    engine.engine.cached_tokens = 64
    # 100 prompt tokens, 64 of them cached, 8 generated: 36 x 1 + 64 x 0.25 + 8 x 2 = 68.
    plain = post(gw.url, {"model": "fake", "prompt": "x" * 99, "max_tokens": 8},
                 "/v1/completions")
    assert plain.status_code == 200
    assert plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    # The same over a stream (chat: 3 + 95 + 2 = 100 prompt tokens in the fake's count);
    # the final usage chunk, with the details, reaches the client that asked for usage.
    streamed = post(gw.url, {"model": "fake", "max_tokens": 8, "stream": True,
                             "messages": [{"role": "user", "content": "y" * 95}],
                             "stream_options": {"include_usage": True}}, "/v1/chat/completions")
    assert streamed.status_code == 200
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    # An engine that does not report cached tokens: the prompt is charged in full, 116.
    engine.engine.cached_tokens = None
    full = post(gw.url, {"model": "fake", "prompt": "x" * 99, "max_tokens": 8},
                "/v1/completions")
    assert full.status_code == 200

    rows = gw.rows(3)
    assert [(r.prompt_tokens, r.cached_prompt_tokens, r.completion_tokens, r.cost)
            for r in rows] == [(100, 64, 8, 68.0), (100, 64, 8, 68.0), (100, 0, 8, 116.0)]
    level = gw.metric("tokenpace_gateway_budget_remaining_tokens", tenant="team-a")
    # Each reservation was 100 + 2 x 64 = 228; each settled to its cost (10000 a day refill
    # ~0.1 per second while the test runs).
    assert level == pytest.approx(BUDGET - (68 + 68 + 116), abs=2)
    assert gw.metric("tokenpace_gateway_cached_prompt_tokens_total", tenant="team-a") == 128
    assert gw.metric("tokenpace_gateway_prompt_tokens_total", tenant="team-a") == 300
    assert gw.metric("tokenpace_gateway_service_cost_total", tenant="team-a") == 252
    # The per-model and per-application series count the cached part too.
    assert gw.metric("tokenpace_gateway_model_tokens_total", model="fake",
                     kind="cached_prompt") == 128
    engine.engine.cached_tokens = 40
    app = httpx.post(gw.url + "/v1/completions", timeout=30,
                     json={"model": "fake", "prompt": "x" * 99, "max_tokens": 8},
                     headers={"authorization": "Bearer sk-bot"})
    assert app.status_code == 200
    assert gw.metric("tokenpace_gateway_application_tokens_total", tenant="team-b",
                     application="bot", kind="cached_prompt") == 40
    assert gw.metric("tokenpace_gateway_application_tokens_total", tenant="team-b",
                     application="bot", kind="prompt") == 100
    assert gw.metric("tokenpace_gateway_model_tokens_total", model="fake",
                     kind="cached_prompt") == 168
