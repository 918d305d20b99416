"""What admission asks the engine before dispatch: a prompt count only when a decision
depends on it, and never for a request its cheap checks already refuse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_A, KEY_B, base_config


def post(url: str, body: dict[str, Any], key: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=json.dumps(body),
                      headers={"authorization": f"Bearer {key}"}, timeout=30)


def test_a_prompt_too_large_for_its_cap_or_budget_is_refused_without_a_count(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    cfg = base_config(engine.url, tmp_path / "u.db", max_input_tokens=1000)
    cfg["tenants"][1]["budgets"] = [{"tokens": 5000, "per": "1m"}]
    gw = make_gateway(cfg)
    huge = "x" * (1000 * 64 + 1)  # more bytes than 1000 tokens can hold
    resp = post(gw.url, {"model": "fake", "prompt": huge, "max_tokens": 4}, KEY_A)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "max_input_tokens_exceeded"
    # team-b: cost 1 x prompt + 2 x completion; 1 MB makes at least 16,384 tokens > 5,000
    resp = post(gw.url, {"model": "fake", "prompt": "y" * 2 ** 20, "max_tokens": 4}, KEY_B)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "budget_too_small"
    # the output part alone is over the budget
    resp = post(gw.url, {"model": "fake", "prompt": "hi", "max_tokens": 3000}, KEY_B)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "budget_too_small"
    assert engine.engine.tokenized == 0
    assert engine.engine.requests == []
    # a prompt that the cheap refusals pass but whose byte bound (1502) is over the cap is
    # counted exactly (after the one probe of the engine's overhead), and refused by its count
    resp = post(gw.url, {"model": "fake", "prompt": "z" * 1500, "max_tokens": 4}, KEY_A)
    assert resp.status_code == 400 and engine.engine.tokenized == 2
    assert engine.engine.tokenize_bodies[-1]["prompt"] == "z" * 1500
    assert "1501 tokens" in resp.json()["error"]["message"]


def test_no_count_when_no_decision_depends_on_it(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    """team-b has no prompt cap and no budget: the engine's usage brings the count."""
    gw = make_gateway(base_config(engine.url, tmp_path / "u.db"))
    resp = post(gw.url, {"model": "fake", "prompt": "hello", "max_tokens": 3}, KEY_B)
    assert resp.status_code == 200
    with httpx.stream("POST", gw.url + "/v1/completions", headers={"authorization": f"Bearer {KEY_B}"},
                      json={"model": "fake", "prompt": "hello!", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        r.read()
    assert engine.engine.tokenized == 0
    rows = sorted(gw.rows(2), key=lambda r: r.prompt_tokens)
    assert [(r.prompt_tokens, r.completion_tokens) for r in rows] == [(6, 3), (7, 3)]
    assert [r.cost for r in rows] == [6 + 2 * 3, 7 + 2 * 3]
    # without max_tokens the gateway needs the prompt's size to fill it in
    resp = post(gw.url, {"model": "fake", "prompt": "hello"}, KEY_B)
    assert resp.status_code == 200 and engine.engine.tokenized == 1


def test_max_requests_answers_an_openai_429_and_counts_the_refusal(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    cfg = base_config(engine.url, tmp_path / "u.db")
    cfg["tenants"][1]["max_requests"] = [{"requests": 2, "per": "1h"}]
    gw = make_gateway(cfg)
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
    assert [post(gw.url, body, KEY_B).status_code for _ in range(2)] == [200, 200]
    refused = post(gw.url, body, KEY_B)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded"), error
    assert "request rate limit 2 per 1h" in error["message"]
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(refused.headers["retry-after"]) in range(1790, 1801)  # 1800 s per request
    assert post(gw.url, body, KEY_A).status_code == 200  # another tenant is not limited
    assert gw.wait_metric("tokenpace_gateway_rejections_total", 1.0, tenant="team-b",
                          reason="requests") == 1.0
    assert len(engine.engine.requests) == 3


def test_observed_max_concurrency_holds_nothing_back_and_counts(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    """max_concurrency 1 in observe mode: three requests at once all reach the engine;
    the two dispatched past the limit are counted (the enforced limit would have queued
    them)."""
    import threading

    cfg = base_config(engine.url, tmp_path / "u.db")
    cfg["tenants"][1]["max_concurrency"] = {"limit": 1, "mode": "observe"}
    gw = make_gateway(cfg)
    engine.engine.gate = threading.Event()  # every request stays in flight until set
    answers: list[int] = []
    threads = [threading.Thread(target=lambda: answers.append(post(
        gw.url, {"model": "fake", "prompt": "hi", "max_tokens": 2}, KEY_B).status_code))
        for _ in range(3)]
    for t in threads:
        t.start()
    try:
        assert gw.wait_metric("tokenpace_gateway_inflight_requests", 3.0, timeout_s=30,
                              tenant="team-b") == 3.0, "all three run at once"
        assert gw.wait_metric("tokenpace_gateway_would_reject_total", 2.0, tenant="team-b",
                              reason="max_concurrency") == 2.0
    finally:
        engine.engine.gate.set()
        for t in threads:
            t.join()
    assert answers == [200, 200, 200]
    assert gw.metric("tokenpace_gateway_rejections_total", tenant="team-b") is None
