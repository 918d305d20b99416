"""A real ``tokenpace serve --trusted-gateway`` with an API key, alone and behind the gateway.

What only a real vLLM server can show: every route that does work refuses a caller without
the engine's key (vLLM's own ``--api-key`` would leave ``/tokenize``, ``/metrics`` and the
rest open), the gateway gets through with the key from its configuration, two tenants
sending the same prompt do not share cached prefix blocks unless configured to (vLLM's
``prompt_tokens_details.cached_tokens``), a prompt sent again is charged its cached tokens at
``cost.cached_prompt`` (budget and ledger; completions, Responses and Anthropic Messages,
streamed and not), and a gateway whose lanes need ``--scheduling-policy priority`` sees
that this engine runs ``fcfs``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._engine_pool import ModuleEngines
from tests._servers import Server, free_port, tokenpace_serve_argv
from tests.gateway.conftest import GatewayProcess

pytestmark = [pytest.mark.vllm, pytest.mark.no_timing]

ENGINE_KEY = "sk-engine-" + uuid.uuid4().hex
KEYS = {"a": "sk-a", "b": "sk-b", "c": "sk-c", "d": "sk-d", "e": "sk-e"}
# Cached prompt tokens cost a tenth of a computed one; team-e has a budget that
# barely refills (100 000 a year: 0.003 per second) to read its charges from.
COST = {"prompt": 1.0, "cached_prompt": 0.1, "completion": 1.0}
BUDGET = {"tokens": 100_000, "per": "365d"}

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


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    port = free_port()
    return [Server(tokenpace_serve_argv(tiny_model, port, "--trusted-gateway",
                                        "--enable-prompt-tokens-details"),
                   port, home / "vllm.log", env={"VLLM_API_KEY": ENGINE_KEY})]


@pytest.fixture(scope="module")
def engine(module_engines: ModuleEngines) -> Server:
    [srv] = module_engines.servers
    return srv


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
        "cost": COST,
        "tenants": [{"id": f"team-{t}", "api_keys": [key], "share_prefix_cache": t in "cd",
                     **({"budgets": [BUDGET]} if t == "e" else {})}
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
        health = gateway.health()["engines"][0]
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


def _charged(gw: GatewayProcess, path: str, body: dict[str, Any]) -> tuple[Any, float]:
    """Send ``body`` for team-e; its ledger row, and what its budget was charged (the
    budget's level before less after, read once the row, written after the settlement,
    is there)."""
    before = gw.metric("tokenpace_gateway_budget_remaining_tokens", tenant="team-e")
    resp = httpx.post(f"{gw.url}{path}", json=body, timeout=120,
                      headers={"authorization": f"Bearer {KEYS['e']}"})
    assert resp.status_code == 200, resp.text
    rid = resp.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while not (rows := [r for r in gw.rows(0, timeout_s=0) if r.request_id == rid]):
        assert time.monotonic() < deadline, "no ledger row"
        time.sleep(0.1)
    after = gw.metric("tokenpace_gateway_budget_remaining_tokens", tenant="team-e")
    assert after is not None
    return rows[0], (BUDGET["tokens"] if before is None else before) - after


@pytest.mark.parametrize("path, stream", [("/v1/completions", False),
                                          ("/v1/completions", True),
                                          ("/v1/messages", True),
                                          ("/v1/messages", False),
                                          ("/v1/responses", True),
                                          ("/v1/responses", False)])
def test_a_prompt_sent_again_is_charged_its_cached_tokens_at_the_cached_price(
        gateway: GatewayProcess, path: str, stream: bool) -> None:
    """The engine runs with --enable-prompt-tokens-details: the second time a tenant sends
    the same long prompt, the engine reports most of it cached, and the gateway charges
    those tokens at cost.cached_prompt in its budget and ledger row (the reservation took
    the whole prompt at cost.prompt first). Messages: vLLM reports ``input_tokens`` less
    the cached tokens; the gateway still records the whole prompt."""
    prompt = _prompt()
    if path == "/v1/messages":
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 2, "stream": stream,
                                "messages": [{"role": "user", "content": prompt}]}
    elif path == "/v1/responses":
        body = {"model": "tiny", "input": prompt, "max_output_tokens": 2, "stream": stream}
    else:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
    first, first_charge = _charged(gateway, path, body)
    second, second_charge = _charged(gateway, path, body)
    assert first.cached_prompt_tokens == 0 and first.prompt_tokens > 250
    assert second.prompt_tokens == first.prompt_tokens  # the whole prompt, cached or not
    assert 0 < second.cached_prompt_tokens <= second.prompt_tokens
    full = COST["prompt"] * second.prompt_tokens + COST["completion"] * second.completion_tokens
    cached = second.cached_prompt_tokens
    assert second.cost == pytest.approx(full - (COST["prompt"] - COST["cached_prompt"]) * cached)
    assert first.cost == pytest.approx(
        COST["prompt"] * first.prompt_tokens + COST["completion"] * first.completion_tokens)
    # The budget was charged the ledger's cost (refill over the test: well under 0.5).
    assert first_charge == pytest.approx(first.cost, abs=0.5)
    assert second_charge == pytest.approx(second.cost, abs=0.5)
    assert second_charge < full - 100
