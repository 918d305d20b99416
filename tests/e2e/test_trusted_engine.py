"""A real ``tokenpace serve --trusted-gateway`` with an API key, alone and behind the gateway.

What only a real vLLM server can show: every route that does work refuses a caller without
the engine's key (vLLM's own ``--api-key`` would leave ``/tokenize``, ``/metrics`` and the
rest open), the gateway gets through with the key from its configuration, two tenants
sending the same prompt do not share cached prefix blocks unless configured to (vLLM's
``prompt_tokens_details.cached_tokens``), and a gateway whose lanes need
``--scheduling-policy priority`` sees that this engine runs ``fcfs``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._servers import Server, free_port, start_all, tokenpace_serve_argv
from tests.gateway.conftest import GatewayProcess

pytestmark = pytest.mark.vllm

ENGINE_KEY = "sk-engine-" + uuid.uuid4().hex
KEYS = {"a": "sk-a", "b": "sk-b", "c": "sk-c", "d": "sk-d"}

# Routes of vLLM 0.32's OpenAI server that do work or reveal something, and made-up ones
# (the middleware refuses by default, not by list).
ROUTES = [
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                 "vllm_xargs": {"output_rate_user": "team-a",
                                                "output_rate_tokens_per_second": 1000}}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/tokenize", {"model": "tiny", "prompt": "hi"}),
    ("POST", "/detokenize", {"model": "tiny", "tokens": [1, 2]}),
    ("POST", "/pooling", {"model": "tiny", "input": "hi"}),
    ("POST", "/classify", {"model": "tiny", "input": "hi"}),
    ("POST", "/score", {"model": "tiny", "text_1": "a", "text_2": "b"}),
    ("POST", "/rerank", {"model": "tiny", "query": "a", "documents": ["b"]}),
    ("POST", "/v1/embeddings", {"model": "tiny", "input": "hi"}),
    ("POST", "/invocations", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("GET", "/metrics", None),
    ("GET", "/v1/models", None),
    ("GET", "/version", None),
    ("GET", "/load", None),
    ("GET", "/ping", None),
    ("GET", "/server_info", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/tokenpace/v1/rates", {"rates": {"team-a": {"rate": 1000, "version": 1}}}),
    ("GET", "/no-such-route", None),
]


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    home = tmp_path_factory.mktemp("trusted")
    srv = Server(tokenpace_serve_argv(tiny_model, port, "--trusted-gateway",
                                      "--enable-prompt-tokens-details"),
                 port, home / "vllm.log", env={"VLLM_API_KEY": ENGINE_KEY})
    start_all([srv])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("method, path, body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_direct_calls_without_the_engine_key_get_401(engine: Server, method: str, path: str,
                                                     body: Any) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"},
                    {"authorization": f"Basic {ENGINE_KEY}"}):
        resp = httpx.request(method, engine.base_url + path, json=body, headers=headers,
                             timeout=60)
        assert resp.status_code == 401, (path, headers, resp.status_code, resp.text[:200])


def test_the_key_opens_the_engine_and_health_stays_open(engine: Server) -> None:
    auth = {"authorization": f"Bearer {ENGINE_KEY}"}
    assert httpx.get(f"{engine.base_url}/health", timeout=10).status_code == 200
    for method, path, body in ROUTES[:3] + [("GET", "/metrics", None)]:
        resp = httpx.request(method, engine.base_url + path, json=body, headers=auth, timeout=60)
        assert resp.status_code == 200, (path, resp.text[:300])


def test_rate_control_sets_a_users_rate_between_requests(engine: Server) -> None:
    """``POST /tokenpace/v1/rates``: a rate set by control call paces the user's next
    request (which sends none), a bad body is a 400 naming the field, and an older
    version does not undo a newer one."""
    auth = {"authorization": f"Bearer {ENGINE_KEY}"}
    url = engine.base_url + "/tokenpace/v1/rates"
    for body, param in (({"rates": {}}, "rates"),
                        ({"rates": {"ctl": {"rate": 0, "version": 1}}}, "rates.ctl"),
                        ({"rates": {"ctl": {"rate": 5, "version": 1.5}}}, "rates.ctl")):
        resp = httpx.post(url, json=body, headers=auth, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    resp = httpx.post(url, json={"rates": {"ctl": {"rate": 20, "version": 5}}}, headers=auth,
                      timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"rates": {"ctl": {"rate": 20.0, "version": 5}}}
    stale = httpx.post(url, json={"rates": {"ctl": {"rate": 1000, "version": 4}}},
                       headers=auth, timeout=30)
    assert stale.json() == {"rates": {"ctl": {"rate": 20.0, "version": 5}}}, stale.text
    # A request without a rate of its own runs at the controlled 20 tok/s: 40 tokens
    # need at least (40 - 2 burst) / 20 = 1.9 s; a machine under load is only slower,
    # while at the refused 1000 tok/s the tiny model answers in well under a second.
    started = time.monotonic()
    resp = httpx.post(engine.base_url + "/v1/completions", headers=auth, timeout=120, json={
        "model": "tiny", "prompt": "hi", "max_tokens": 40, "ignore_eos": True,
        "vllm_xargs": {"output_rate_user": "ctl"}})
    took = time.monotonic() - started
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 40
    assert took >= 1.8, took


@pytest.fixture(scope="module")
def gateway(engine: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    home = tmp_path_factory.mktemp("trusted-gateway")
    config: dict[str, Any] = {
        # The engine runs fcfs: this gateway must notice that its lanes lose priority there.
        "engines": [{"url": engine.base_url, "api_key_env": "TOKENPACE_TEST_ENGINE_KEY",
                     "scheduling_policy": "priority"}],
        "ledger": f"sqlite:///{home / 'usage.db'}",
        "tenants": [{"id": f"team-{t}", "api_keys": [key], "share_prefix_cache": t in "cd"}
                    for t, key in KEYS.items()],
    }
    mp = pytest.MonkeyPatch()
    mp.setenv("TOKENPACE_TEST_ENGINE_KEY", ENGINE_KEY)  # the gateway process inherits it
    gw = GatewayProcess(home, config)
    try:
        gw.start()
        yield gw
    finally:
        gw.stop()
        mp.undo()


def _cached_tokens(gw: GatewayProcess, tenant: str, prompt: str) -> int:
    resp = httpx.post(f"{gw.url}/v1/completions", timeout=120,
                      headers={"authorization": f"Bearer {KEYS[tenant]}"},
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _prompt() -> str:
    # About 300 tokens, fresh per test so that no earlier request cached it.
    return f"{uuid.uuid4().hex} " + " ".join(f"word{i}" for i in range(120))


def test_tenants_do_not_share_cached_prompt_blocks(gateway: GatewayProcess) -> None:
    prompt = _prompt()
    assert _cached_tokens(gateway, "a", prompt) == 0
    assert _cached_tokens(gateway, "a", prompt) > 0, "the engine caches a tenant's own prefix"
    assert _cached_tokens(gateway, "b", prompt) == 0, "another tenant must not hit a's blocks"


def test_tenants_that_opt_out_share_the_cache(gateway: GatewayProcess) -> None:
    prompt = _prompt()
    assert _cached_tokens(gateway, "c", prompt) == 0
    assert _cached_tokens(gateway, "d", prompt) > 0
    assert _cached_tokens(gateway, "a", prompt) == 0, "a salted tenant still does not"


def test_the_gateway_sees_the_engine_runs_fcfs_under_priority_lanes(gateway: GatewayProcess) -> None:
    deadline = time.monotonic() + 10
    while True:
        health = httpx.get(f"{gateway.url}/health", timeout=10).json()["engines"][0]
        if health["scheduling_policy"]["engine"] != "unknown" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert health["scheduling_policy"] == {"configured": "priority", "engine": "fcfs"}
    assert "lanes lose their priority" in health["warning"]
    assert "lanes lose their priority" in gateway.log()


def test_tenants_count_and_decode_through_the_gateway(gateway: GatewayProcess) -> None:
    """``/tokenize`` and ``/detokenize`` of the real engine, for a tenant's key (the engine
    refuses anyone without its own key, which only the gateway holds)."""
    auth = {"authorization": f"Bearer {KEYS['a']}"}
    resp = httpx.post(f"{gateway.url}/tokenize", headers=auth, timeout=30,
                      json={"model": "tiny", "prompt": "hello world"})
    assert resp.status_code == 200, resp.text
    counted = resp.json()
    assert counted["count"] == len(counted["tokens"]) > 0
    back = httpx.post(f"{gateway.url}/detokenize", headers=auth, timeout=30,
                      json={"model": "tiny", "tokens": counted["tokens"]})
    assert back.status_code == 200, back.text
    assert "hello world" in back.json()["prompt"]
    assert httpx.post(f"{gateway.url}/tokenize", timeout=30,
                      json={"model": "tiny", "prompt": "hi"}).status_code == 401
