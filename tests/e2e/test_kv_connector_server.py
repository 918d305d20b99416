"""A KV connector on a real vLLM server on the CPU, paced: prompts whose KV is loaded from
storage, as on the decode side of disaggregated prefill.

vLLM's ``ExampleConnector`` saves each prompt's KV to a folder and loads it for a later
request with the same prompt. Prefix caching is off, so every later request's prompt KV
comes from that folder (vLLM's external-prefix-cache counter shows it). Rates are read at
the source (the engine's event log).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests._engine_pool import ModuleEngines
from tests._servers import Server, free_port, paced_vllm_server_argv, vllm_counter
from tests.e2e._engine_log import all_dispatches, paced_rate, wait_for_engine_requests
from tests.e2e._timing import expect

pytestmark = pytest.mark.vllm

SLOW_RATE = 20.0
FAST_RATE = 40.0  # the connector's work per step holds this CPU to 50-90 steps/s
PROMPTS = [" ".join(f"w{i}x{j}" for j in range(100)) for i in range(4)]


def ENGINES(tiny_model: Path, logs: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    port = free_port()
    pacing = {
        "default_user_output_tokens_per_second": SLOW_RATE,
        "user_output_tokens_per_second": {"fast": FAST_RATE},
        "event_log": str(logs / "events.jsonl"),
    }
    connector = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"shared_storage_path": str(logs / "kv")}}
    return [Server(paced_vllm_server_argv(tiny_model, port, pacing, "--kv-transfer-config",
                                          json.dumps(connector), "--no-enable-prefix-caching"),
                   port, logs / "vllm.log")]


@pytest.fixture(scope="module")
def server(module_engines: ModuleEngines) -> Server:
    [srv] = module_engines.servers
    return srv


def _complete(server: Server, user: str, prompt: str, max_tokens: int) -> int:
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
              "vllm_xargs": {"output_rate_user": user}},
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["completion_tokens"]


def _external_hits(server: Server) -> float:
    return vllm_counter(server, "vllm:external_prefix_cache_hits_total")


def test_prompts_loaded_from_storage_are_paced(server: Server) -> None:
    """Four streams of a 20 tok/s user and one of a 40 tok/s user, every prompt's KV
    loaded by the connector: each user's paced rate at the event log within 3% below and
    1% above its rate, every token delivered."""
    for prompt in PROMPTS:  # the "prefill side": computes each prompt once and saves it
        assert _complete(server, "warm", prompt, 1) == 1
    hits = _external_hits(server)
    since = time.monotonic()
    with ThreadPoolExecutor(5) as pool:
        slow = [pool.submit(_complete, server, "slow", p, 30) for p in PROMPTS]
        fast = pool.submit(_complete, server, "fast", PROMPTS[0], 80)
        assert [f.result() for f in slow] == [30] * 4 and fast.result() == 80
    loaded = _external_hits(server) - hits
    assert loaded >= 5 * 64, f"only {loaded} prompt tokens came from the connector"
    events = server.log_path.parent / "events.jsonl"
    found = wait_for_engine_requests(events, {"slow", "fast"}, since, 200)
    everyone = all_dispatches(events, since)
    logs = [server.log_path, events]
    for user, limit, tokens in (("slow", SLOW_RATE, 120), ("fast", FAST_RATE, 80)):
        times = [t for r in found if r.user == user for t in r.times]
        assert len(times) == tokens, (user, len(times), events)
        rate = paced_rate(times, limit, everyone)
        for bound, upper in ((0.97 * limit, False), (1.01 * limit, True)):
            expect("kv_connector_server", f"{user} paced rate ({limit} tok/s)",
                   rate.paced_rate, bound, upper=upper, logs=logs, loaded=loaded,
                   **rate.as_series())
