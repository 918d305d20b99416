"""The pooling routes (embeddings, rerank, score, pooling, classify) through a real gateway
process in front of the fake engine, over real HTTP: each route identified, admitted,
queued for an engine slot, charged its prompt tokens as the engine's usage reports them
(at the model's own cost), one ledger row naming the route; budgets and caps refuse with
OpenAI's errors before the engine is asked; bad bodies get a 400 naming the field; the
Batch API runs ``/v1/embeddings`` lines."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway._engine import EngineServer, FakeEngine
from tests.gateway.conftest import KEY_A, KEY_B, GatewayProcess, base_config
from tests.gateway.test_batch_http import client, lines_of, wait_status

KEY_C = "sk-team-c"


def call(gw: GatewayProcess, path: str, body: dict[str, Any], key: str = KEY_B,
         **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body, timeout=30,
                      headers={"authorization": f"Bearer {key}"}, **kwargs)


@pytest.fixture
def pooled(tmp_path: Path) -> Any:
    """A gateway in front of one fake engine serving "emb": team-b's prompts cost the
    model's own 0.5 a token; team-c has a budget of 100 (cost units), a prompt cap and one request at a time."""
    server = EngineServer(FakeEngine(models=("emb",))).start()
    config = base_config(server.url, tmp_path / "usage.db")
    config["models"] = [{"name": "emb", "cost": {"prompt": 0.5, "completion": 3}}]
    config["tenants"].append({"id": "team-c", "api_keys": [KEY_C], "max_concurrency": 1,
                              "max_input_tokens": 200,
                              "budgets": [{"tokens": 100, "per": "1h"}]})
    gw = GatewayProcess(tmp_path, config).start()
    yield gw, server.engine
    gw.stop()
    server.stop()


ROUTES = [  # (gateway path, body, the ledger's route, the engine's path)
    ("/v1/embeddings", {"input": "hello world"}, "/v1/embeddings", "/v1/embeddings"),
    ("/v1/embeddings", {"input": ["one", "two", "three"], "dimensions": 4}, "/v1/embeddings",
     "/v1/embeddings"),
    ("/v1/embeddings", {"input": [[1, 2, 3], [4, 5]]}, "/v1/embeddings", "/v1/embeddings"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}]}, "/v1/embeddings",
     "/v1/embeddings"),
    ("/v1/rerank", {"query": "q?", "documents": ["a doc", "another"]}, "/rerank", "/rerank"),
    ("/rerank", {"query": "q?", "documents": "one doc"}, "/rerank", "/rerank"),
    ("/v2/rerank", {"query": "q?", "documents": ["x", "y", "z"], "top_n": 2}, "/rerank",
     "/rerank"),
    ("/v1/score", {"queries": "q", "documents": ["a", "b"]}, "/score", "/score"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d"]}, "/score", "/score"),
    ("/pooling", {"input": "pool me"}, "/pooling", "/pooling"),
    ("/classify", {"input": ["good", "bad"]}, "/classify", "/classify"),
]


@pytest.mark.parametrize("key", [KEY_B, KEY_C], ids=["uncounted", "counted"])
def test_each_route_is_served_charged_its_prompt_and_in_the_ledger(pooled: Any,
                                                                   key: str) -> None:
    """team-b (no caps, no budget: nothing counted before dispatch) and team-c (counted
    with the engine's /tokenize for its cap and budget): the same answers and charges."""
    gw, engine = pooled
    for path, body, _, _ in ROUTES:
        resp = call(gw, path, {"model": "emb", **body}, key=key)
        assert resp.status_code == 200, (path, resp.text)
        assert resp.headers["x-request-id"].startswith("tpg-")
    rows = gw.rows(len(ROUTES))
    assert len(rows) == len(ROUTES)
    sent = engine.requests[-len(ROUTES):]
    for (path, body, route, engine_path), row, seen in zip(ROUTES, rows, sent):
        expected = sum(engine.pooled_tokens(engine_path, {"model": "emb", **body}))
        assert seen.path == engine_path
        assert row.route == route and row.model == "emb", path
        assert (row.prompt_tokens, row.completion_tokens) == (expected, 0), path
        assert row.cost == pytest.approx(0.5 * expected), path
        assert row.finish_reason == "stop" and row.served
        # What the engine was told: the priority (0: it schedules first come, first
        # served), nothing of vLLM's pacing fields, no output limit.
        assert "vllm_xargs" not in seen.body and "max_tokens" not in seen.body
        assert seen.body["priority"] == 0
    if key == KEY_C:
        # Counted before the budget reserved: input strings on their byte bound (the
        # engine's overhead probed once), pairs and chat messages with /tokenize.
        prompts = [b.get("prompt") for b in engine.tokenize_bodies]
        assert "q?\na doc" in prompts and "q\nb" in prompts
        assert not {"hello world", "one", "pool me", "good"} & set(prompts)
        assert any("messages" in b for b in engine.tokenize_bodies)
    else:
        assert engine.tokenized == 0
    assert gw.metric("tokenpace_gateway_prompt_tokens_total", tenant="team-b" if key == KEY_B
                     else "team-c", lane="batch" if key == KEY_B else "interactive") \
        == sum(r.prompt_tokens for r in rows)


def test_the_openai_sdk_embeds_through_the_gateway(pooled: Any) -> None:
    gw, engine = pooled
    api = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY_B, max_retries=0, timeout=30)
    out = api.embeddings.create(model="emb", input=["alpha", "beta"])
    assert [d.index for d in out.data] == [0, 1] and len(out.data[0].embedding) == 8
    assert out.usage.prompt_tokens == sum(engine.pooled_tokens(
        "/v1/embeddings", {"input": ["alpha", "beta"]})) == 11
    # A client's own pacing fields never reach the engine.
    api.embeddings.create(model="emb", input="x",
                          extra_body={"vllm_xargs": {"output_rate_user": "team-a"}})
    assert "vllm_xargs" not in engine.requests[-1].body
    with pytest.raises(openai.NotFoundError) as missing:
        api.embeddings.create(model="nope", input="x")
    assert missing.value.code == "model_not_found"


def test_budget_and_cap_refuse_with_openai_errors_before_the_engine(pooled: Any) -> None:
    """team-c: prompts over its cap are a 400 naming the field; a request its budget cannot
    take is a 429 with retry-after and OpenAI's rate-limit headers, and neither reaches the
    engine; each refusal has its ledger row."""
    gw, engine = pooled
    capped = call(gw, "/v1/embeddings", {"model": "emb", "input": ["x" * 150, "y" * 150]},
                  key=KEY_C)
    assert capped.status_code == 400, capped.text
    err = capped.json()["error"]
    assert (err["code"], err["param"]) == ("max_input_tokens_exceeded", "input")
    ok = call(gw, "/v1/embeddings", {"model": "emb", "input": "z" * 180}, key=KEY_C)
    assert ok.status_code == 200
    sent = len(engine.requests)
    # 90.5 of 100 spent (181 tokens at 0.5); two pairs of 62 tokens are within the cap,
    # not within the budget.
    over = call(gw, "/v1/rerank", {"model": "emb", "query": "q" * 30, "documents": ["d" * 30] * 2},
                key=KEY_C)
    assert over.status_code == 429, over.text
    assert over.json()["error"]["type"] == "rate_limit_error", over.json()
    assert float(over.headers["retry-after"]) > 0
    assert len(engine.requests) == sent
    rows = gw.rows(3)
    reasons = sorted(r.finish_reason for r in rows)
    assert reasons == ["rejected:budget", "rejected:max_input_tokens", "stop"], reasons
    refused = [r for r in rows if r.finish_reason == "rejected:budget"]
    assert refused[0].route == "/rerank" and refused[0].cost == 0


def test_requests_wait_their_turn_in_the_fair_queue(pooled: Any) -> None:
    """team-c may run one request at a time: the second embeddings request waits for the
    first's engine slot (the engine holds them at its gate), then both are served."""
    gw, engine = pooled
    engine.gate = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(call, gw, "/v1/embeddings", {"model": "emb", "input": "a"}, KEY_C)
        deadline = time.monotonic() + 10
        while len(engine.requests) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = pool.submit(call, gw, "/classify", {"model": "emb", "input": "b"}, KEY_C)
        time.sleep(0.3)
        assert len(engine.requests) == 1  # queued in the gateway, not at the engine
        engine.gate.set()
        assert first.result().status_code == 200 and second.result().status_code == 200
    rows = sorted(gw.rows(2), key=lambda r: r.started_at)
    assert rows[1].queue_ms is not None and rows[1].queue_ms > rows[0].queue_ms
    assert [r.route for r in rows] == ["/v1/embeddings", "/classify"]


BAD = [  # (path, body, the error's param, code)
    ("/v1/embeddings", {"model": "emb"}, "input", "invalid_value"),
    ("/v1/embeddings", {"model": "emb", "input": []}, "input", "invalid_value"),
    ("/v1/embeddings", {"model": "emb", "input": [1, "a"]}, "input", "invalid_value"),
    ("/v1/embeddings", {"model": "emb", "input": ["a"] * 9}, "input", "invalid_value"),
    ("/v1/embeddings", {"model": "emb", "input": "a", "encoding_format": "bytes"},
     "encoding_format", "unsupported_parameter"),
    ("/v1/embeddings", {"input": "a"}, "model", "invalid_value"),
    ("/v1/rerank", {"model": "emb", "documents": ["a"]}, "query", "invalid_value"),
    ("/v1/rerank", {"model": "emb", "query": "q", "documents": []}, "documents",
     "invalid_value"),
    ("/v1/score", {"model": "emb", "queries": ["a", "b"], "documents": ["c", "d", "e"]},
     "documents", "invalid_value"),
    ("/v1/score", {"model": "emb", "query": "a"}, "queries", "invalid_value"),
    ("/classify", {"model": "emb", "messages": []}, "messages", "invalid_value"),
]


def test_bad_bodies_get_a_400_naming_the_field_and_never_reach_the_engine(
        tmp_path: Path) -> None:
    server = EngineServer(FakeEngine(models=("emb",))).start()
    config = base_config(server.url, tmp_path / "usage.db")
    config["max_prompts_per_request"] = 8
    gw = GatewayProcess(tmp_path, config).start()
    try:
        for path, body, param, code in BAD:
            resp = call(gw, path, body)
            assert resp.status_code == 400, (path, body, resp.text)
            err = resp.json()["error"]
            assert (err["param"], err["code"]) == (param, code), (path, body, err)
            assert err["type"] == "invalid_request_error"
        nan = httpx.post(
            f"{gw.url}/v1/embeddings", content=b'{"model": "emb", "input": "a", "x": NaN}',
            headers={"authorization": f"Bearer {KEY_B}", "content-type": "application/json"})
        assert nan.status_code == 400 and nan.json()["error"]["code"] == "invalid_number"
        assert call(gw, "/v1/embeddings", {"model": "emb", "input": "a"}, key="sk-no").status_code \
            == 401
        assert server.engine.requests == []
        assert all(r.finish_reason.startswith("rejected:") for r in gw.rows(len(BAD) + 1))
    finally:
        gw.stop()
        server.stop()


def test_an_engine_error_is_passed_on_and_not_charged(pooled: Any) -> None:
    gw, _ = pooled
    resp = call(gw, "/v1/embeddings", {"model": "emb", "input": "a", "fake_error": 400})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "the fake engine refuses"
    [row] = gw.rows(1)
    assert (row.finish_reason, row.cost, row.route) == ("upstream_error", 0, "/v1/embeddings")


def test_a_batch_of_embedding_lines_runs_as_its_tenants_requests(pooled: Any) -> None:
    """OpenAI's Batch API with ``endpoint: /v1/embeddings``: each line's answer in the
    output file with its usage, the batch's usage the sum, a ledger row per line in the
    batch lane; a bad line goes to the error file."""
    gw, engine = pooled
    api = client(gw, KEY_A)
    lines = [{"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "emb", "input": [f"text {i}", "more"]}} for i in range(4)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "emb", "input": []}})
    upload = api.files.create(file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()),
                              purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                               completion_window="24h")
    done = wait_status(api, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 1)
    output = lines_of(api, done.output_file_id)
    assert sorted(x["custom_id"] for x in output) == [f"e-{i}" for i in range(4)]
    per_line = [sum(engine.pooled_tokens("/v1/embeddings", line["body"])) for line in lines[:4]]
    for x in output:
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and len(body["data"]) == 2
        assert body["usage"]["prompt_tokens"] == per_line[int(x["custom_id"][2:])]
    assert done.usage.input_tokens == sum(per_line) and done.usage.output_tokens == 0
    assert [x["custom_id"] for x in lines_of(api, done.error_file_id)] == ["bad"]
    rows = [r for r in gw.rows(5) if r.batch_id == batch.id]
    served = [r for r in rows if r.served]
    assert len(served) == 4 and {r.route for r in rows} == {"/v1/embeddings"}
    assert {r.lane for r in served} == {"batch"}
    assert sorted(r.prompt_tokens for r in served) == sorted(per_line)


def test_a_gateway_killed_mid_request_records_the_embedding_at_restart(pooled: Any) -> None:
    """SIGKILL while an embeddings request waits at the engine: the restarted gateway
    writes its row from the journal (the engine keeps no book of pooling requests, so
    the count admission took stands, marked estimated) and serves on."""
    gw, engine = pooled
    engine.gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(call, gw, "/v1/embeddings",
                              {"model": "emb", "input": ["x" * 20, "y" * 10]}, KEY_C)
        deadline = time.monotonic() + 10
        while not engine.requests:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert gw.server is not None
        os.kill(gw.server.proc.pid, signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):
            pending.result()
    engine.gate.set()
    gw.server = None
    gw.start()
    [row] = gw.rows(1)
    assert (row.route, row.tenant, row.finish_reason) == ("/v1/embeddings", "team-c",
                                                          "interrupted")
    assert row.estimated and row.completion_tokens == 0
    assert row.prompt_tokens >= 21 + 11  # the count it was admitted on (its byte bound)
    assert "unknown route kind" not in gw.log()
    assert call(gw, "/v1/embeddings", {"model": "emb", "input": "a"}, key=KEY_C).status_code == 200


def test_a_route_the_models_engine_does_not_serve_is_a_400_in_openais_format(
        tmp_path: Path) -> None:
    """vLLM serves only its model's task's pooling routes (FastAPI's 404 otherwise): the
    client gets a 400 naming the model and the route, nothing is charged."""
    server = EngineServer(FakeEngine(models=("emb",), pooling_paths=("/v1/embeddings",))).start()
    gw = GatewayProcess(tmp_path, base_config(server.url, tmp_path / "usage.db")).start()
    try:
        assert call(gw, "/v1/embeddings", {"model": "emb", "input": "a"}).status_code == 200
        resp = call(gw, "/classify", {"model": "emb", "input": "a"})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert (err["code"], err["param"], err["type"]) == ("unsupported_route", "model",
                                                            "invalid_request_error")
        assert "/classify" in err["message"] and "'emb'" in err["message"]
        rows = sorted(gw.rows(2), key=lambda r: r.started_at)
        assert [(r.route, r.finish_reason, r.cost > 0) for r in rows] == [
            ("/v1/embeddings", "stop", True), ("/classify", "upstream_error", False)]
    finally:
        gw.stop()
        server.stop()
