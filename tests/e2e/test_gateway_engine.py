"""The gateway in front of a real ``tokenpace serve --trusted-gateway`` on the tiny model.

Checks what only a real engine can show: prompt tokens counted exactly as vLLM counts them
(chat template included), the tenant's rate from the gateway configuration pacing the
engine, usage in the ledger equal to vLLM's, and a client that leaves mid-stream aborting
the engine's request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests._servers import Server, free_port, start_all, tokenpace_serve_argv
from tests.gateway.conftest import GatewayProcess

pytestmark = pytest.mark.vllm

KEY_SLOW, KEY_FAST = "sk-slow", "sk-fast"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    home = tmp_path_factory.mktemp("engine")
    srv = Server(tokenpace_serve_argv(tiny_model, port, "--trusted-gateway",
                                      "--allow-unauthenticated-trusted-gateway",
                                      "--scheduling-policy", "priority"), port, home / "vllm.log")
    start_all([srv])
    try:
        yield srv
    finally:
        srv.stop()


def engine_prompt_tokens(engine: Server) -> tuple[int, int]:
    """vLLM's own prompt counts of CHAT and of the plain prompt "Hello world"."""
    chat = httpx.post(f"{engine.base_url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": CHAT, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    plain = httpx.post(f"{engine.base_url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "Hello world", "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    return chat, plain


@pytest.fixture(scope="module")
def gateway(engine: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    chat_tokens, _ = engine_prompt_tokens(engine)
    home = tmp_path_factory.mktemp("gateway")
    config: dict[str, Any] = {
        "engines": [{"url": engine.base_url, "max_inflight": 16, "scheduling_policy": "priority"}],
        "cost": {"prompt": 1.0, "completion": 2.0},
        "lanes": [{"name": "interactive", "priority": 0}, {"name": "batch", "priority": 10}],
        "ledger": f"sqlite:///{home / 'usage.db'}",
        "tenants": [
            {"id": "slow", "api_keys": [KEY_SLOW], "lane": "batch", "output_tokens_per_second": 20},
            # Exactly the engine's count of CHAT: one token more must be refused.
            {"id": "fast", "api_keys": [KEY_FAST], "lane": "interactive",
             "max_input_tokens": chat_tokens, "max_output_tokens": 200},
        ],
    }
    gw = GatewayProcess(home, config).start()
    try:
        yield gw
    finally:
        gw.stop()


def api(gw: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=120)


def test_prompt_tokens_are_counted_as_the_engine_counts_them(gateway: GatewayProcess,
                                                            engine: Server) -> None:
    chat_tokens, _ = engine_prompt_tokens(engine)
    fast = api(gateway, KEY_FAST)
    ok = fast.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    assert ok.usage.prompt_tokens == chat_tokens
    longer = [CHAT[0], {"role": "user", "content": CHAT[1]["content"] + " again"}]
    with pytest.raises(openai.BadRequestError) as info:
        fast.chat.completions.create(model="tiny", messages=longer, max_tokens=4)
    assert f"at most {chat_tokens} (max_input_tokens)" in info.value.message


def test_tenant_rate_from_the_gateway_paces_the_engine(gateway: GatewayProcess) -> None:
    tokens = 60
    times: list[float] = []
    usage = None
    chunks = api(gateway, KEY_SLOW).completions.create(
        model="tiny", prompt="Hello", max_tokens=tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in chunks:
        if chunk.choices:
            times.append(time.monotonic())
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == tokens
    # GCRA: 1 + 0.1 x 20 tokens at once, then 20 per second.
    rate = (tokens - 1 - 2) / (times[-1] - times[0])
    assert rate == pytest.approx(20, rel=0.1)
    # The unpaced tenant is not held to that rate.
    t0 = time.monotonic()
    api(gateway, KEY_FAST).completions.create(model="tiny", prompt="Hello", max_tokens=60,
                                              extra_body={"ignore_eos": True})
    assert time.monotonic() - t0 < 60 / 20 / 2


def test_ledger_usage_equals_engine_usage(gateway: GatewayProcess) -> None:
    t0 = time.time()
    fast = api(gateway, KEY_FAST)
    reported = []
    r = fast.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12)
    reported.append((r.usage.prompt_tokens, r.usage.completion_tokens))
    chunks = list(fast.chat.completions.create(model="tiny", messages=CHAT, max_tokens=15,
                                               stream=True, stream_options={"include_usage": True}))
    reported.append((chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens))
    rows = gateway.rows_since(t0, 2)
    assert sorted((x.prompt_tokens, x.completion_tokens) for x in rows) == sorted(reported)
    assert all(x.finish_reason in ("stop", "length") for x in rows)


def test_client_leaving_mid_stream_aborts_the_engine_request(gateway: GatewayProcess,
                                                             engine: Server) -> None:
    t0 = time.time()
    received = 0
    with httpx.stream("POST", f"{gateway.url}/v1/completions",
                      headers={"authorization": f"Bearer {KEY_SLOW}"}, timeout=60,
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 1000,
                            "ignore_eos": True, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                received += 1
                if received == 10:
                    break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{engine.base_url}/metrics").text
        running = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")]
        if running and all(float(line.rsplit(" ", 1)[1]) == 0 for line in running):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the engine still runs the abandoned request")
    [row] = gateway.rows_since(t0, 1)
    assert row.finish_reason == "cancelled"
    assert 10 <= row.completion_tokens <= 13  # what the engine had streamed when we left
