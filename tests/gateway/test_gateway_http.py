"""The gateway over real HTTP: identity, admission, budgets, streaming, ledger, metrics.

A real ``tokenpace gateway`` process in front of a fake engine served in-process (real
HTTP both ways); the official ``openai`` client sees the errors.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import ADMIN_KEY, KEY_A, KEY_B, GatewayProcess, base_config


def client(gw: GatewayProcess, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


def post(gw: GatewayProcess, body: Any, key: str | None = KEY_A, path: str = "/v1/completions",
         **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(gw.url + path, content=content, headers=headers, timeout=30, **kw)


# -- identity ---------------------------------------------------------------------------


def test_missing_and_unknown_keys_are_authentication_errors(gateway: GatewayProcess) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(gateway, "sk-nobody").completions.create(model="fake", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "invalid_api_key"
    resp = post(gateway, {"model": "fake", "prompt": "hi"}, key=None)
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_api_key"
    assert gateway.metric("tokenpace_gateway_rejections_total", reason="unauthenticated") == 2


def test_identity_priority_and_rate_are_overwritten(gateway: GatewayProcess, engine: EngineServer) -> None:
    c = client(gateway)
    c.completions.create(
        model="fake", prompt="hi", max_tokens=3,
        extra_body={"vllm_xargs": {"output_rate_user": "team-b", "output_rate_tokens_per_second": 1e9,
                                   "output_rate_version": 2**63 - 1, "other": "kept"},
                    "priority": -100})
    body = engine.engine.requests[-1].body
    # A client's own rate version, however high, never reaches the engine, where it would
    # freeze the tenant's rate. This engine has no api_key: rates are not split, so no
    # version is sent at all (see the next test for the gateway's own).
    assert body["vllm_xargs"] == {"output_rate_user": "team-a",
                                  "output_rate_tokens_per_second": 100, "other": "kept"}
    # The engine runs FCFS (the default): vLLM would refuse any other priority.
    assert body["priority"] == 0
    client(gateway, KEY_B).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"vllm_xargs": {"output_rate_user": "team-a", "output_rate_tokens_per_second": 5,
                                   "output_rate_version": 7}})
    body = engine.engine.requests[-1].body
    # team-b has no rate of its own: a client-supplied one must not survive either.
    assert body["vllm_xargs"] == {"output_rate_user": "team-b"}


def test_a_rate_split_over_keyed_engines_carries_the_gateways_version(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    """With every engine's key configured the tenant's rate is split over engines
    (``_rate_split``) and each request carries the gateway's version of its share; a
    client's own version is replaced."""
    config = base_config(engine.url, tmp_path / "u.db")
    config["engines"][0]["api_key"] = "sk-engine-test"
    gw = make_gateway(config)
    client(gw).completions.create(
        model="fake", prompt="hi", max_tokens=3,
        extra_body={"vllm_xargs": {"output_rate_version": 2**63 - 1}})
    seen = engine.engine.requests[-1]
    xargs = seen.body["vllm_xargs"]
    version = xargs.pop("output_rate_version")
    assert isinstance(version, int) and version < 2**63 - 1
    assert xargs == {"output_rate_user": "team-a", "output_rate_tokens_per_second": 100}
    assert seen.headers["authorization"] == "Bearer sk-engine-test"


def test_lane_priority_reaches_a_priority_engine(engine: EngineServer, make_gateway: Any,
                                                 tmp_path: Path) -> None:
    config = base_config(engine.url, tmp_path / "u.db")
    config["engines"][0]["scheduling_policy"] = "priority"
    gw = make_gateway(config)
    client(gw, KEY_B).completions.create(model="fake", prompt="hi", max_tokens=2,
                                         extra_body={"priority": -5})
    assert engine.engine.requests[-1].body["priority"] == 10
    client(gw, KEY_A).completions.create(model="fake", prompt="hi", max_tokens=2,
                                         extra_body={"priority": 99})
    assert engine.engine.requests[-1].body["priority"] == 0


# -- request caps ------------------------------------------------------------------------


def test_request_caps_are_bad_requests_naming_the_limit(engine: EngineServer, make_gateway: Any,
                                                        tmp_path: Path) -> None:
    gw = make_gateway(base_config(engine.url, tmp_path / "u.db", max_input_tokens=20))
    c = client(gw)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="fake", prompt="x" * 40, max_tokens=4)
    assert "max_input_tokens" in info.value.message and info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="fake", prompt="hi", max_tokens=65)
    assert "max_output_tokens" in info.value.message and info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                  max_completion_tokens=100)
    assert info.value.body["param"] == "max_completion_tokens"
    # A missing max_tokens becomes the tenant's maximum.
    c.completions.create(model="fake", prompt="hi")
    assert engine.engine.requests[-1].body["max_tokens"] == 64
    assert len(engine.engine.requests) == 1
    rows = gw.rows(4)
    assert sorted(r.finish_reason for r in rows) == [
        "length", "rejected:max_input_tokens", "rejected:max_output_tokens",
        "rejected:max_output_tokens"]


def test_malformed_and_oversized_bodies(engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    config = base_config(engine.url, tmp_path / "u.db")
    config["max_body_bytes"] = 4096
    gw = make_gateway(config)
    resp = post(gw, b'{"model": "fake", "prompt": ')
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"
    resp = post(gw, b"[1, 2]")
    assert resp.status_code == 400
    resp = post(gw, {"model": "fake", "prompt": "x" * 5000})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"

    def chunks() -> Any:  # no content-length: the limit must hold while reading
        for _ in range(10):
            yield b"x" * 1000

    resp = httpx.post(gw.url + "/v1/completions", content=chunks(),
                      headers={"authorization": f"Bearer {KEY_A}"})
    assert resp.status_code == 413
    for prompt in (["a", [1, 2]], [], {"text": "a"}, [["a"]]):  # a batch takes one shape
        resp = post(gw, {"model": "fake", "prompt": prompt})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", prompt
    resp = post(gw, {"model": "fake", "prompt": "hi", "max_tokens": "ten"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    assert engine.engine.requests == []
    # Nothing leaked: the gateway still serves.
    assert post(gw, {"model": "fake", "prompt": "hi", "max_tokens": 2}).status_code == 200


# -- budgets ------------------------------------------------------------------------------


def test_budget_refusal_has_exact_rate_limit_headers(engine: EngineServer, make_gateway: Any,
                                                     tmp_path: Path) -> None:
    # 1000 cost units per 100 s refill at 10 per second.
    gw = make_gateway(base_config(engine.url, tmp_path / "u.db",
                                  budgets=[{"tokens": 1000, "per": "100s"}]))
    prompt = "x" * 99  # 100 prompt tokens in the fake engine's count
    # Reserve 100 + 2 x 64 = 228, settle to 100 + 2 x 8 = 116 (the fake engine streams max_tokens).
    post(gw, {"model": "fake", "prompt": prompt, "max_tokens": 8})
    level = gw.metric("tokenpace_gateway_budget_remaining_tokens", tenant="team-a")
    assert level is not None and 884 <= level <= 886
    for _ in range(3):
        assert post(gw, {"model": "fake", "prompt": prompt, "max_tokens": 64}).status_code == 200
    # 3 x 228 = 684 more: about 200 left, a 228 reservation does not fit.
    with pytest.raises(openai.RateLimitError) as info:
        client(gw).completions.create(model="fake", prompt=prompt, max_tokens=64)
    err = info.value
    assert err.body["code"] == "rate_limit_exceeded"
    headers = err.response.headers
    remaining = int(headers["x-ratelimit-remaining-tokens"])
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert 195 <= remaining <= 220  # refills 10 per second while the test runs
    wait_ms = int(headers["retry-after-ms"])
    assert abs(wait_ms - (228 - remaining) * 100) <= 150  # 10 units per second
    assert int(headers["retry-after"]) == -(-wait_ms // 1000)
    assert headers["x-ratelimit-reset-tokens"].endswith("s")
    rows = gw.rows(5)
    assert rows[-1].finish_reason == "rejected:budget" and rows[-1].cost == 0
    # A request larger than the whole budget can never fit: a bad request, not "retry later".
    resp = post(gw, {"model": "fake", "prompt": "x" * 999, "max_tokens": 64})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "budget_too_small"


def test_ledger_matches_engine_usage_over_a_mixed_run(gateway: GatewayProcess, engine: EngineServer) -> None:
    c = client(gateway)
    cb = client(gateway, KEY_B)
    usages = []
    r = c.completions.create(model="fake", prompt="hello", max_tokens=5)
    usages.append((r.usage.prompt_tokens, r.usage.completion_tokens))
    r = cb.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hey"}],
                                   max_tokens=7, n=2)
    usages.append((r.usage.prompt_tokens, r.usage.completion_tokens))
    stream = c.completions.create(model="fake", prompt="streamed", max_tokens=9, stream=True,
                                  stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    usages.append((usage.prompt_tokens, usage.completion_tokens))
    stream = cb.chat.completions.create(model="fake", messages=[{"role": "user", "content": "s"}],
                                        max_tokens=6, stream=True)
    chunks = list(stream)
    assert all(ch.usage is None for ch in chunks)  # the client did not ask for usage
    seen = engine.engine.requests[-1]
    usages.append((engine.engine.prompt_tokens(seen.body), seen.streamed))
    rows = gateway.rows(4)
    assert len(rows) == 4
    assert sorted((r.prompt_tokens, r.completion_tokens) for r in rows) == sorted(usages)
    assert sum(r.completion_tokens for r in rows) == sum(s.streamed for s in engine.engine.requests)
    for r in rows:
        assert r.cost == pytest.approx(1.0 * r.prompt_tokens + 2.0 * r.completion_tokens)
        assert r.finish_reason == "length"
        assert r.queue_ms is not None and r.e2e_ms >= r.queue_ms
    streamed = [r for r in rows if r.ttft_ms is not None]
    assert len(streamed) == 2
    assert {r.tenant for r in rows} == {"team-a", "team-b"}
    assert {r.lane for r in rows} == {"interactive", "batch"}
    assert gateway.metric("tokenpace_gateway_completion_tokens_total", tenant="team-a") == 5 + 9
    assert gateway.metric("tokenpace_gateway_inflight_requests", tenant="team-a") == 0


def test_usage_chunks_follow_the_clients_stream_options(gateway: GatewayProcess) -> None:
    def events(options: dict[str, Any] | None) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"model": "fake", "prompt": "hi", "max_tokens": 3, "stream": True}
        if options is not None:
            body["stream_options"] = options
        resp = post(gateway, body)
        assert resp.status_code == 200
        data = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        return [json.loads(d) for d in data[:-1]]

    plain = events(None)
    assert len(plain) == 3 and all("usage" not in e for e in plain)
    final = events({"include_usage": True})
    assert len(final) == 4 and all("usage" not in e for e in final[:3])
    assert final[3]["choices"] == [] and final[3]["usage"]["completion_tokens"] == 3
    every = events({"include_usage": True, "continuous_usage_stats": True})
    assert [e["usage"]["completion_tokens"] for e in every] == [1, 2, 3, 3]


# -- concurrency and queue -----------------------------------------------------------------


def test_concurrency_and_queue_depth(engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    gw = make_gateway(base_config(engine.url, tmp_path / "u.db", max_concurrency=1, max_queued=1))
    results: list[int] = []

    def slow() -> None:
        results.append(post(gw, {"model": "fake", "prompt": "SLOW", "max_tokens": 20}).status_code)

    # The engine holds the first request until the queue checks are done, so a loaded
    # machine cannot end it before the second one queues.
    engine.engine.gate = threading.Event()
    threads = [threading.Thread(target=slow) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    assert gw.wait_metric("tokenpace_gateway_queued_requests", 1, timeout_s=60, tenant="team-a") == 1
    with pytest.raises(openai.RateLimitError) as info:
        client(gw).completions.create(model="fake", prompt="hi", max_tokens=2)
    engine.engine.gate.set()
    assert "max_queued" in info.value.message
    assert info.value.body["code"] == "queue_full"
    assert int(info.value.response.headers["retry-after"]) >= 1
    # Another tenant is not held up by team-a's limits.
    assert post(gw, {"model": "fake", "prompt": "hi", "max_tokens": 2}, key=KEY_B).status_code == 200
    for t in threads:
        t.join()
    assert results == [200, 200]
    rows = gw.rows(4)
    queued = sorted(r.queue_ms for r in rows if r.tenant == "team-a" and r.finish_reason == "length")
    assert queued[1] > 500  # waited for the first slow request (20 x 50 ms)


def test_queue_timeout(engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    gw = make_gateway(base_config(engine.url, tmp_path / "u.db", max_concurrency=1,
                                  queue_timeout="300ms"))
    engine.engine.gate = threading.Event()  # the first request holds the only slot
    t = threading.Thread(target=post, args=(gw, {"model": "fake", "prompt": "SLOW", "max_tokens": 20}))
    t.start()
    assert gw.wait_metric("tokenpace_gateway_inflight_requests", 1, timeout_s=60, tenant="team-a") == 1
    resp = post(gw, {"model": "fake", "prompt": "hi", "max_tokens": 2})
    engine.engine.gate.set()
    t.join()
    assert resp.status_code == 429 and resp.json()["error"]["code"] == "queue_timeout"
    assert int(resp.headers["retry-after"]) >= 1
    assert gw.wait_metric("tokenpace_gateway_queued_requests", 0, tenant="team-a") == 0
    rows = gw.rows(2)
    assert {r.finish_reason for r in rows} == {"length", "rejected:queue_timeout"}


# -- disconnects and failures ----------------------------------------------------------


def test_client_disconnect_mid_stream_frees_the_slot_and_charges_what_was_generated(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    gw = make_gateway(base_config(engine.url, tmp_path / "u.db", max_concurrency=1))
    received = 0
    with httpx.stream("POST", gw.url + "/v1/completions", headers={"authorization": f"Bearer {KEY_A}"},
                      json={"model": "fake", "prompt": "SLOW", "max_tokens": 60, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                received += 1
                if received == 5:
                    break
    seen = engine.engine.requests[-1]
    deadline = time.monotonic() + 5
    while not seen.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert seen.aborted and not seen.finished  # the engine's request was aborted
    rows = gw.rows(1)
    assert rows[0].finish_reason == "cancelled"
    assert 5 <= rows[0].completion_tokens <= seen.streamed <= rows[0].completion_tokens + 2
    assert rows[0].cost == pytest.approx(rows[0].prompt_tokens + 2.0 * rows[0].completion_tokens)
    assert gw.wait_metric("tokenpace_gateway_inflight_requests", 0, tenant="team-a") == 0
    # The slot is free: with max_concurrency 1 the next request runs at once.
    r = client(gw).completions.create(model="fake", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_engine_failure_mid_stream(gateway: GatewayProcess, engine: EngineServer) -> None:
    stream = client(gateway).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "FAIL_AFTER:4"}], max_tokens=20,
        stream=True)
    got = 0
    with pytest.raises(openai.APIError) as info:
        for _chunk in stream:
            got += 1
    assert got == 4
    assert "engine" in str(info.value.message)
    rows = gateway.rows(1)
    assert rows[0].finish_reason == "upstream_error" and rows[0].completion_tokens == 4
    assert gateway.wait_metric("tokenpace_gateway_inflight_requests", 0, tenant="team-a") == 0
    assert client(gateway).completions.create(model="fake", prompt="hi", max_tokens=2).usage


def test_engine_down_is_503_and_row(engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    config = base_config(engine.url, tmp_path / "u.db")
    gw = make_gateway(config)
    engine.engine.healthy = False
    deadline = time.monotonic() + 10
    while httpx.get(gw.url + "/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    resp = post(gw, {"model": "fake", "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_unavailable"
    assert gw.rows(1)[0].finish_reason == "rejected:engine_unavailable"


# -- reload and restart --------------------------------------------------------------------


def test_reload_by_admin_and_sighup_keeps_in_flight_requests(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    config = base_config(engine.url, tmp_path / "u.db")
    gw = make_gateway(config)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(
        post(gw, {"model": "fake", "prompt": "SLOW", "max_tokens": 30, "stream": True})))
    t.start()
    time.sleep(0.3)
    config["tenants"][0]["max_output_tokens"] = 8
    config["tenants"].append({"id": "team-c", "api_keys": ["sk-team-c"]})
    gw.write(config)
    assert httpx.post(gw.url + "/admin/reload", headers={"authorization": f"Bearer {KEY_A}"}).status_code == 403
    assert httpx.post(gw.url + "/admin/reload").status_code == 401
    resp = httpx.post(gw.url + "/admin/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert resp.status_code == 200 and "team-c" in resp.json()["tenants"]
    assert post(gw, {"model": "fake", "prompt": "hi", "max_tokens": 9}).status_code == 400
    assert post(gw, {"model": "fake", "prompt": "hi", "max_tokens": 2}, key="sk-team-c").status_code == 200
    # A broken file is refused as a whole; the running configuration stays.
    broken = json.loads(json.dumps(config))
    broken["tenants"][1]["colour"] = "red"
    gw.write(broken)
    resp = httpx.post(gw.url + "/admin/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert resp.status_code == 400 and "colour" in resp.json()["error"]["message"]
    assert post(gw, {"model": "fake", "prompt": "hi", "max_tokens": 2}, key="sk-team-c").status_code == 200
    # SIGHUP reloads too: team-c is gone afterwards.
    config["tenants"].pop()
    gw.write(config)
    assert gw.server is not None
    os.kill(gw.server.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 5
    while post(gw, {"model": "fake", "prompt": "hi", "max_tokens": 2}, key="sk-team-c").status_code != 401:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t.join()
    assert out[0].status_code == 200 and out[0].text.rstrip().endswith("data: [DONE]")
    assert out[0].text.count('"text"') == 30  # the in-flight stream was not cut


def test_budgets_survive_a_restart(engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    config = base_config(engine.url, tmp_path / "u.db", budgets=[{"tokens": 1000, "per": "1d"}])
    gw = make_gateway(config)
    for _ in range(3):
        post(gw, {"model": "fake", "prompt": "x" * 99, "max_tokens": 50})
    before = gw.metric("tokenpace_gateway_budget_remaining_tokens", tenant="team-a")
    assert before is not None and before == pytest.approx(1000 - 3 * 200, abs=1)
    gw.stop()
    gw.start()
    # A tenant's series appear with its first request: a call that spends nothing.
    assert httpx.get(gw.url + "/v1/models", headers={"authorization": f"Bearer {KEY_A}"},
                     timeout=30).status_code == 200
    after = gw.metric("tokenpace_gateway_budget_remaining_tokens", tenant="team-a")
    assert after == pytest.approx(before, abs=1)  # 1000 per day refills ~0.01 per second
    # About 400 left: one reservation of 100 + 2 x 64 fits, the next does not.
    assert post(gw, {"model": "fake", "prompt": "x" * 99, "max_tokens": 64}).status_code == 200
    assert post(gw, {"model": "fake", "prompt": "x" * 99, "max_tokens": 64}).status_code == 429


def test_models_health_metrics_and_unknown_paths(gateway: GatewayProcess) -> None:
    client(gateway).completions.create(model="fake", prompt="hi", max_tokens=2, stream=True)
    models = client(gateway).models.list()
    assert [m.id for m in models.data] == ["fake"]
    health = gateway.health()
    assert health["engines"][0]["healthy"] is True
    text = httpx.get(gateway.url + "/metrics").text
    for name in ("tokenpace_gateway_requests_total", "tokenpace_gateway_queue_seconds_bucket",
                 "tokenpace_gateway_inflight_requests", "tokenpace_gateway_queued_requests"):
        assert name in text or name.replace("_total", "") in text
    resp = httpx.get(gateway.url + "/v1/nothing")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


def test_request_timeout_streamed_and_not(engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    config = base_config(engine.url, tmp_path / "u.db")
    config["request_timeout"] = "400ms"
    gw = make_gateway(config)
    resp = post(gw, {"model": "fake", "prompt": "SLOW", "max_tokens": 30, "stream": True})
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert resp.status_code == 200
    # At most 8 tokens at 50 ms each fit in 400 ms (fewer on a loaded machine), then the
    # error event: the stream was cut at the deadline, not run to its 30 tokens.
    assert len(events) - 1 <= 9
    assert json.loads(events[-1])["error"]["code"] == "timeout"
    resp = post(gw, {"model": "fake", "prompt": "SLOW", "max_tokens": 30})
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout"
    rows = gw.rows(2)
    assert [r.finish_reason for r in rows] == ["timeout", "timeout"]
    streamed, whole = rows
    assert streamed.completion_tokens == len(events) - 1
    assert whole.completion_tokens == 30  # unknown count: the reservation is charged
    assert gw.wait_metric("tokenpace_gateway_inflight_requests", 0, tenant="team-a") == 0


def test_missing_max_tokens_fits_the_context(gateway: GatewayProcess, engine: EngineServer) -> None:
    engine.engine.max_model_len = 10  # /tokenize reports a tiny context
    resp = post(gateway, {"model": "fake", "prompt": "hello"})
    # No max_tokens: the tenant's maximum capped by the context left after the prompt.
    assert resp.status_code == 200
    assert engine.engine.requests[-1].body["max_tokens"] == 10 - 6


def test_engine_refusal_passes_through_and_costs_nothing(gateway: GatewayProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(gateway).completions.create(model="fake", prompt="hi", max_tokens=4,
                                           extra_body={"fake_error": 400})
    assert info.value.body["message"] == "the fake engine refuses"
    [row] = gateway.rows(1)
    assert row.finish_reason == "upstream_error" and row.cost == 0


# -- connections ------------------------------------------------------------------------


def test_idle_client_connections_outlive_the_clients_own_keep_alive(gateway: GatewayProcess) -> None:
    """httpx and the openai SDK reuse an idle connection for up to 5 s without asking; a
    server that closed it at that moment would fail the request. The gateway keeps idle
    connections far longer, so a connection idle for 6 s still carries the next request."""
    with httpx.Client(headers={"authorization": f"Bearer {KEY_A}"},
                      limits=httpx.Limits(keepalive_expiry=60)) as c:
        body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
        first = c.post(gateway.url + "/v1/completions", json=body)
        assert first.status_code == 200
        events: list[str] = []
        time.sleep(6)
        second = c.post(gateway.url + "/v1/completions", json=body,
                        extensions={"trace": lambda name, info: events.append(name)})
        assert second.status_code == 200
        assert "connection.connect_tcp.started" not in events  # the same connection was reused
