"""Pacing behind the proxy users already run: a real nginx maps API keys to
tenants and sets ``x-tenant-id``; behind it a real ``tokenpace serve --user-header
x-tenant-id`` paces each tenant at its own rate, and a client that names another tenant
in the header and in ``vllm_xargs`` is still paced as itself.

nginx runs deploy/nginx/tokenpace-engine.conf, the file the docs give users, with this
test's ports. Rates are measured at the source (the engine's event log: which user each
token was charged to, and when), as in test_paced_server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._engine_pool import ModuleEngines
from tests._nginx import DEPLOY_NGINX, Nginx, nginx_binary
from tests._servers import Server, free_port, tokenpace_serve_argv
from tests.e2e._engine_log import all_dispatches, engine_requests, paced_rate, \
    wait_for_engine_requests
from tests.e2e._timing import expect

pytestmark = [pytest.mark.vllm, pytest.mark.nginx]

KEYS = {"team-a": "sk-team-a-key", "team-b": "sk-team-b-key"}  # as in the shipped file
RATES = {"team-a": 20, "team-b": 40}


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    nginx_binary()  # without nginx: the module's skip (or CI failure) before the engine starts
    port = free_port()
    return [Server(tokenpace_serve_argv(
        tiny_model, port, "--default-user-output-tokens-per-second", "20",
        "--user-output-tokens-per-second", json.dumps({"team-b": RATES["team-b"]}),
        "--user-header", "x-tenant-id", "--output-rate-event-log", str(home / "events.jsonl")),
        port, home / "vllm.log")]


@pytest.fixture(scope="module")
def deployment(module_engines: ModuleEngines) -> Iterator[tuple[Server, Nginx]]:
    [engine], home = module_engines.servers, module_engines.home
    proxy_port = free_port()
    shipped = (DEPLOY_NGINX / "tokenpace-engine.conf").read_text()
    assert "127.0.0.1:8001;" in shipped and "listen 127.0.0.1:8080;" in shipped
    block = shipped.replace("127.0.0.1:8001;", f"127.0.0.1:{engine.port};").replace(
        "listen 127.0.0.1:8080;", f"listen 127.0.0.1:{proxy_port};")
    proxy = Nginx(home / "nginx", block, proxy_port)
    try:
        proxy.start()
        yield engine, proxy
    finally:
        proxy.stop()


def _events(engine: Server) -> Path:
    return engine.log_path.parent / "events.jsonl"


def _generate(url: str, key: str | None, *, chat: bool, max_tokens: int,
              claims: str | None = None, headers: dict[str, str] | None = None) -> int:
    """One generation through ``url``; ``claims``: the tenant the client pretends to be
    (in the identity header and in ``vllm_xargs``). Returns the tokens received."""
    sent = dict(headers or {})
    if key is not None:
        sent["authorization"] = f"Bearer {key}"
    body: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True}
    if claims is not None:
        sent["x-tenant-id"] = claims
        body["vllm_xargs"] = {"output_rate_user": claims}
    if not chat:
        resp = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "Hello"},
                          headers=sent, timeout=120)
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["completion_tokens"])
    body.update(messages=[{"role": "user", "content": "Hello"}], stream=True,
                stream_options={"include_usage": True})
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=sent,
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


def test_each_tenant_is_paced_as_itself_whatever_it_claims(
        deployment: tuple[Server, Nginx]) -> None:
    """team-a sends a streamed chat and a completion, both claiming to be team-b (header
    and body); team-b sends one completion. At the engine every token of team-a's is
    charged to team-a, paced at its 20 tok/s, and team-b keeps its own 40 tok/s.

    Bounds as in test_paced_server: GCRA makes the upper side exact (1% for rounding);
    10% below is 0.15 s (team-a, 60 tokens at 20 tok/s) or 0.3 s (team-b, 120 at 40) of
    lag the limiter would have to cause while the engine runs. Were the claim honoured,
    team-a's tokens would be charged to team-b (the first assertion) and team-b would
    share its 40 tok/s with them.
    """
    engine, proxy = deployment
    since = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        a_chat = pool.submit(_generate, proxy.base_url, KEYS["team-a"], chat=True,
                             max_tokens=30, claims="team-b")
        a_text = pool.submit(_generate, proxy.base_url, KEYS["team-a"], chat=False,
                             max_tokens=30, claims="team-b")
        b_text = pool.submit(_generate, proxy.base_url, KEYS["team-b"], chat=False,
                             max_tokens=120)
        received = {"team-a": a_chat.result() + a_text.result(), "team-b": b_text.result()}
    assert received == {"team-a": 60, "team-b": 120}
    events = _events(engine)
    found = wait_for_engine_requests(events, set(RATES), since, 180)
    charged = {user: sum(len(r.times) for r in found if r.user == user) for user in RATES}
    assert charged == received, (charged, events)
    others = {r.user for r in engine_requests(events, None, since)} - set(RATES)
    assert not others, others  # nobody else was charged (no "team-b" from team-a's claim)
    everyone = all_dispatches(events, since)
    for user, limit in RATES.items():
        times = [t for r in found if r.user == user for t in r.times]
        rate = paced_rate(times, limit, everyone)
        for bound, upper in ((0.9 * limit, False), (1.01 * limit, True)):
            expect("proxy_identity", f"{user} paced rate ({limit} tok/s)", rate.paced_rate,
                   bound, upper=upper, logs=[engine.log_path, events], **rate.as_series())


def test_the_proxy_refuses_unknown_keys(deployment: tuple[Server, Nginx]) -> None:
    _, proxy = deployment
    for headers in ({}, {"authorization": "Bearer sk-wrong"}):
        resp = httpx.post(f"{proxy.base_url}/v1/completions", headers=headers, timeout=30,
                          json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 401 and resp.json()["error"]["code"] == 401


def test_without_the_header_a_request_is_anonymous(deployment: tuple[Server, Nginx]) -> None:
    """A request that reaches the engine without the proxy (which the deployment must
    prevent) cannot choose its identity: its body's user is replaced by anonymous."""
    engine, _ = deployment
    since = time.monotonic()
    assert _generate(engine.base_url, None, chat=False, max_tokens=3,
                     headers={}, claims=None) == 3
    resp = httpx.post(f"{engine.base_url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True,
        "vllm_xargs": {"output_rate_user": "team-b"}})
    assert resp.status_code == 200
    found = wait_for_engine_requests(_events(engine), {"__anonymous__"}, since, 6)
    assert sum(len(r.times) for r in found) == 6
    assert not [r for r in engine_requests(_events(engine), {"team-b"}, since)]


def test_a_repeated_identity_header_is_refused(deployment: tuple[Server, Nginx]) -> None:
    engine, _ = deployment
    resp = httpx.post(f"{engine.base_url}/v1/completions", timeout=60,
                      headers=[("x-tenant-id", "team-a"), ("x-tenant-id", "team-b")],
                      json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "x-tenant-id" and "more than once" in error["message"]
