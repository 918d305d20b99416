"""The pooling routes through the gateway in front of a real vLLM serving the tiny model as
an embedding model (``--runner pooling --convert embed``: vLLM 0.32 on the CPU pools the
project's own ``LlamaForCausalLM``, no other architecture needed).

What only a real engine shows: the openai SDK's ``embeddings.create`` through the gateway
gets vLLM's vectors, the ledger's row holds vLLM's own prompt count at the model's cost;
a tenant with a cap and a budget is counted by the engine's ``/tokenize`` before dispatch
and refused over its cap; rerank and score (on an embedding model vLLM scores by cosine)
are charged as the engine reports; a Batch API file of embedding lines runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests._engine_pool import ModuleEngines
from tests._servers import Server, free_port, vllm_server_argv
from tests.gateway.conftest import GatewayProcess

pytestmark = [pytest.mark.vllm, pytest.mark.no_timing]  # no time bound is asserted here

KEY, KEY_CAPPED = "sk-embed", "sk-embed-capped"
CAP = 12


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    port = free_port()
    return [Server(vllm_server_argv(tiny_model, port, "--runner", "pooling",
                                    "--convert", "embed"), port, home / "vllm.log")]


@pytest.fixture(scope="module")
def engine(module_engines: ModuleEngines) -> Server:
    [srv] = module_engines.servers
    return srv


@pytest.fixture(scope="module")
def gateway(engine: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    home = tmp_path_factory.mktemp("pooling-gateway")
    config: dict[str, Any] = {
        "engines": [{"url": engine.base_url, "max_inflight": 8}],
        "models": [{"name": "tiny", "cost": {"prompt": 0.25, "completion": 1.0}}],
        "ledger": f"sqlite:///{home / 'usage.db'}",
        "tenants": [{"id": "embedder", "api_keys": [KEY]},
                    {"id": "capped", "api_keys": [KEY_CAPPED], "max_input_tokens": CAP,
                     "budgets": [{"tokens": 1000, "per": "1d"}]}],
    }
    gw = GatewayProcess(home, config).start()
    try:
        yield gw
    finally:
        gw.stop()


def direct(engine: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{engine.base_url}{path}", json={"model": "tiny", **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_sdk_embeds_through_the_gateway_charged_as_vllm_counts(
        engine: Server, gateway: GatewayProcess) -> None:
    texts = ["the river runs to the sea", "a lamp in the window"]
    own = direct(engine, "/v1/embeddings", {"input": texts})
    api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    raw = api.embeddings.with_raw_response.create(model="tiny", input=texts)
    out = raw.parse()
    assert [d.index for d in out.data] == [0, 1]
    assert len(out.data[0].embedding) == len(own["data"][0]["embedding"]) == 128
    # The same vectors as vLLM's own answer (the tenant's cache salt changes no number).
    assert out.data[1].embedding == pytest.approx(own["data"][1]["embedding"], abs=1e-5)
    assert out.usage.prompt_tokens == own["usage"]["prompt_tokens"]
    row = gateway.row(raw.headers["x-request-id"])
    assert (row.tenant, row.route, row.model) == ("embedder", "/v1/embeddings", "tiny")
    assert (row.prompt_tokens, row.completion_tokens) == (own["usage"]["prompt_tokens"], 0)
    assert row.cost == pytest.approx(0.25 * own["usage"]["prompt_tokens"])
    assert row.finish_reason == "stop" and row.served


def test_a_capped_tenant_is_counted_by_the_engine_before_dispatch(
        engine: Server, gateway: GatewayProcess) -> None:
    api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_CAPPED, max_retries=0,
                        timeout=60)
    short = "a lamp"
    counted = direct(engine, "/v1/embeddings", {"input": short})["usage"]["prompt_tokens"]
    assert counted <= CAP
    assert api.embeddings.create(model="tiny", input=short).usage.prompt_tokens == counted
    with pytest.raises(openai.BadRequestError) as over:
        api.embeddings.create(model="tiny", input=[short, "the river runs to the sea again"])
    assert over.value.code == "max_input_tokens_exceeded" and over.value.param == "input"
    # The short one was admitted on its byte bound, which held against vLLM's count.
    assert not gateway.metric("tokenpace_gateway_prompt_bound_violations_total")


@pytest.mark.parametrize("path,body", [
    ("/v1/rerank", {"query": "where is the lamp", "documents": ["a lamp", "the sea", "stone"]}),
    ("/v1/score", {"queries": "where is the lamp", "documents": ["a lamp", "the sea"]}),
    ("/pooling", {"input": ["a lamp", "the sea"]}),
])
def test_rerank_score_and_pooling_are_charged_the_engines_usage(
        engine: Server, gateway: GatewayProcess, path: str, body: dict[str, Any]) -> None:
    own = direct(engine, path, body)
    resp = httpx.post(f"{gateway.url}{path}", json={"model": "tiny", **body}, timeout=60,
                      headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == own["usage"]["prompt_tokens"]
    row = gateway.row(resp.headers["x-request-id"])
    assert row.prompt_tokens == own["usage"]["prompt_tokens"] and row.completion_tokens == 0
    assert row.route == {"/v1/rerank": "/rerank", "/v1/score": "/score"}.get(path, path)


def test_a_batch_of_embedding_lines(engine: Server, gateway: GatewayProcess) -> None:
    api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "tiny", "input": f"line number {i}"}} for i in range(3)]
    upload = api.files.create(file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()),
                              purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                               completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.1)
        batch = api.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    output = [json.loads(x) for x in api.files.content(batch.output_file_id).text.splitlines()]
    counts = {x["custom_id"]: x["response"]["body"]["usage"]["prompt_tokens"] for x in output}
    assert counts == {f"e{i}": direct(engine, "/v1/embeddings", lines[i]["body"])["usage"][
        "prompt_tokens"] for i in range(3)}
    assert batch.usage.input_tokens == sum(counts.values())


def test_a_route_the_embedding_model_does_not_serve_is_a_400(
        engine: Server, gateway: GatewayProcess) -> None:
    """vLLM serves /classify only for a classification model (FastAPI's 404 here): the
    gateway answers in OpenAI's format, naming the model."""
    assert httpx.post(f"{engine.base_url}/classify", json={"model": "tiny", "input": "a"},
                      timeout=60).status_code == 404
    resp = httpx.post(f"{gateway.url}/classify", json={"model": "tiny", "input": "a"},
                      headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["code"], resp.json()["error"]["param"]) == (
        "unsupported_route", "model")
