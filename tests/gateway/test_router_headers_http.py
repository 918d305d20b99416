"""``engines[].headers`` over real HTTP: a gateway in front of two fake engines, one
standing in for a router (llm-d's inference gateway) with headers configured, one without.

The routed engine's completions carry the fairness id (the tenant) and the objective (the
lane) rendered per request, streamed or not; the other engine's carry none; a client's own
``x-gateway-inference-*`` headers never reach either (the gateway forwards no client
header); background calls (health, models) carry none; the body and the gateway's other
headers are the same on both engines; a reload that changes the headers takes effect for
the next request. No llm-d runs here: the fake engine records what it received.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.gateway._engine import EngineServer, FakeEngine, Seen
from tests.gateway.conftest import ADMIN_KEY, KEY_A, KEY_B, base_config

FAIRNESS = "x-gateway-inference-fairness-id"
OBJECTIVE = "x-gateway-inference-objective"
APP_KEY = "sk-team-b-nightly"
ROUTER_HEADERS = {
    FAIRNESS: "{tenant}",
    OBJECTIVE: "{lane}",
    "x-tokenpace-application": "{application}",
    "x-tokenpace-end-user": "{end_user}",
    "x-tokenpace-model": "{model}",
}
PLACED = set(ROUTER_HEADERS)


def config(routed: str, plain: str, ledger: Path,
           headers: dict[str, str] | None = None) -> dict[str, Any]:
    document = base_config(routed, ledger)
    document["engines"] = [
        {"url": routed, "max_inflight": 8, "models": ["routed"],
         "headers": headers or ROUTER_HEADERS},
        {"url": plain, "max_inflight": 8, "models": ["plain"]},
    ]
    document["tenants"][1]["applications"] = [{"id": "nightly", "api_keys": [APP_KEY]}]
    return document


def complete(gw_url: str, key: str, model: str, stream: bool,
             headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    resp = httpx.post(f"{gw_url}/v1/chat/completions",
                      headers={"authorization": f"Bearer {key}", **(headers or {})},
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 4, "stream": stream, **body}, timeout=30)
    assert resp.status_code == 200, resp.text
    if stream:
        assert resp.text.rstrip().endswith("data: [DONE]")
    return resp


def routed_headers(seen: Seen) -> dict[str, str]:
    return {k: v for k, v in seen.headers.items() if k in PLACED}


# The client tries to steer the router: its own fairness id and objective, and a header of
# its own. None of it may reach an engine.
SPOOF = {FAIRNESS: "team-b", OBJECTIVE: "critical", "x-client-only": "1"}


def test_router_headers_reach_the_routed_engine_only(make_gateway: Any,
                                                     tmp_path: Path) -> None:
    routed = EngineServer(FakeEngine(models=("routed",))).start()
    plain = EngineServer(FakeEngine(models=("plain",))).start()
    try:
        gw = make_gateway(config(routed.url, plain.url, tmp_path / "u.db"))
        for stream in (False, True):
            complete(gw.url, KEY_A, "routed", stream, SPOOF, user="bob\r\nx-evil: 1")
            complete(gw.url, APP_KEY, "routed", stream, SPOOF)
            complete(gw.url, KEY_A, "plain", stream, SPOOF, user="bob\r\nx-evil: 1")
        got = routed.engine.requests
        assert [routed_headers(s) for s in got] == [
            {FAIRNESS: "team-a", OBJECTIVE: "interactive", "x-tokenpace-model": "routed",
             # The hostile end user arrives percent-encoded: no line break, no new header.
             "x-tokenpace-end-user": "bob%0D%0Ax-evil: 1"},
            # An application's key: its id; no end user named: that header is left out.
            {FAIRNESS: "team-b", OBJECTIVE: "batch", "x-tokenpace-model": "routed",
             "x-tokenpace-application": "nightly"},
        ] * 2
        for seen in got + plain.engine.requests:
            assert "x-evil" not in seen.headers and "x-client-only" not in seen.headers
        # The engine without ``headers`` gets none of them, whatever the client sent.
        assert len(plain.engine.requests) == 2
        assert all(routed_headers(s) == {} for s in plain.engine.requests)
        # Everything else is what an engine without headers receives: the same other
        # headers, the same body (the gateway's pacing vllm_xargs included) but the model.
        for mine, other in ((got[0], plain.engine.requests[0]),
                            (got[2], plain.engine.requests[1])):
            assert set(mine.headers) - PLACED == set(other.headers)
            assert mine.headers["content-type"] == other.headers["content-type"]
            assert {**mine.body, "model": "plain"} == other.body
            assert mine.body["vllm_xargs"] and mine.body["vllm_xargs"] == other.body["vllm_xargs"]
        # Background calls (health, /v1/models) carry no per-request headers.
        assert routed.engine.other_calls
        assert all(not PLACED & set(headers) for _, headers in routed.engine.other_calls)
    finally:
        routed.stop()
        plain.stop()


def test_a_reload_that_changes_the_headers_applies_to_the_next_request(
        make_gateway: Any, tmp_path: Path) -> None:
    routed = EngineServer(FakeEngine(models=("routed",))).start()
    plain = EngineServer(FakeEngine(models=("plain",))).start()
    try:
        gw = make_gateway(config(routed.url, plain.url, tmp_path / "u.db",
                                 headers={FAIRNESS: "{tenant}", OBJECTIVE: "{lane}"}))
        complete(gw.url, KEY_B, "routed", True)
        # The newer llm-d spelling, and an objective per tenant and lane.
        gw.write(config(routed.url, plain.url, tmp_path / "u.db",
                        headers={"x-llm-d-inference-fairness-id": "{tenant}",
                                 "x-llm-d-inference-objective": "{tenant}-{lane}"}))
        resp = httpx.post(f"{gw.url}/admin/reload",
                          headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert resp.status_code == 200, resp.text
        complete(gw.url, KEY_B, "routed", False)
        first, second = routed.engine.requests
        assert first.headers[FAIRNESS] == "team-b" and first.headers[OBJECTIVE] == "batch"
        assert FAIRNESS not in second.headers and OBJECTIVE not in second.headers
        assert second.headers["x-llm-d-inference-fairness-id"] == "team-b"
        assert second.headers["x-llm-d-inference-objective"] == "team-b-batch"
    finally:
        routed.stop()
        plain.stop()
