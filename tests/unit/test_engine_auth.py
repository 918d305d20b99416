"""The engine's API-key middleware for trusted-gateway mode, on a small Starlette app."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tokenpace.engine import EngineAuth
from tokenpace.engine._auth import configured_keys


async def _ok(request):  # noqa: ANN001, ANN202
    return PlainTextResponse("done")


def _client(api_key: list[str] | None, monkeypatch: pytest.MonkeyPatch, env_key: str | None = None
            ) -> TestClient:
    if env_key is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", env_key)
    app = Starlette(routes=[Route(p, _ok, methods=["GET", "POST"])
                            for p in ("/health", "/tokenize", "/metrics", "/v1/completions",
                                      "/healthz")])
    app.add_middleware(EngineAuth)
    app.state.args = SimpleNamespace(api_key=api_key)  # as vLLM's init_app_state sets it
    return TestClient(app)


@pytest.mark.parametrize("path", ["/tokenize", "/metrics", "/v1/completions", "/healthz",
                                  "/no-such-route"])
def test_every_route_but_health_needs_a_key(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client(["k1", "k2"], monkeypatch)
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic k1"},
                    {"authorization": "k1"}):
        resp = client.post(path, headers=headers)
        assert resp.status_code == 401, (path, headers)
        assert resp.json()["error"]["code"] == 401
    for key in ("k1", "k2"):
        assert client.post(path, headers={"authorization": f"Bearer {key}"}).status_code in (200, 404)
    assert client.get("/health").text == "done"


def test_keys_follow_vllm_cli_first_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client(None, monkeypatch, env_key="from-env")
    assert client.get("/metrics", headers={"authorization": "Bearer from-env"}).status_code == 200
    client = _client(["from-cli"], monkeypatch, env_key="from-env")
    assert client.get("/metrics", headers={"authorization": "Bearer from-env"}).status_code == 401
    assert client.get("/metrics", headers={"authorization": "Bearer from-cli"}).status_code == 200
    assert configured_keys(SimpleNamespace(api_key=None), {"VLLM_API_KEY": ""}) == []


def test_without_any_key_it_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client(None, monkeypatch)
    assert client.get("/metrics", headers={"authorization": "Bearer "}).status_code == 401
    assert client.get("/metrics").status_code == 401
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_guard_reports_the_running_engines_scheduling_policy(policy: str) -> None:
    from tokenpace.engine import SCHEDULING_POLICY_HEADER, RequestGuard

    app = Starlette(routes=[Route("/health", _ok), Route("/metrics", _ok)])
    app.add_middleware(RequestGuard)
    app.state.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(policy=policy))
    client = TestClient(app)
    assert client.get("/health").headers[SCHEDULING_POLICY_HEADER] == policy
    assert SCHEDULING_POLICY_HEADER not in client.get("/metrics").headers
    app.state.vllm_config = None  # a server without vLLM's state: no header, no error
    assert SCHEDULING_POLICY_HEADER not in TestClient(app).get("/health").headers


def test_the_guard_reports_the_running_engines_max_num_seqs() -> None:
    """``--max-num-seqs`` on ``/health``: the gateway's capacity (and reserved slots) for
    this engine before it is ever full; read back as the gateway reads it."""
    from tokenpace.engine import MAX_NUM_SEQS_HEADER, RequestGuard
    from tokenpace.gateway.fleet import reported_capacity

    app = Starlette(routes=[Route("/health", _ok), Route("/metrics", _ok)])
    app.add_middleware(RequestGuard)
    app.state.vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(policy="fcfs", max_num_seqs=48))
    client = TestClient(app)
    headers = client.get("/health").headers
    assert headers[MAX_NUM_SEQS_HEADER] == "48" and reported_capacity(headers) == 48
    assert MAX_NUM_SEQS_HEADER not in client.get("/metrics").headers
    for bad in ("0", "-3", "abc", "\u0661\u0662", "1e3", "99999999999", ""):
        assert reported_capacity({MAX_NUM_SEQS_HEADER: bad}) is None, bad
    assert reported_capacity({}) is None


def test_engine_headers_alone_add_the_same_headers_and_touch_nothing_else() -> None:
    """``tokenpace serve`` without pacing or lanes (vLLM's scheduler) still reports them."""
    from tokenpace.engine import MAX_NUM_SEQS_HEADER, SCHEDULING_POLICY_HEADER, EngineHeaders

    app = Starlette(routes=[Route("/health", _ok), Route("/metrics", _ok)])
    app.add_middleware(EngineHeaders)
    app.state.vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(policy="priority", max_num_seqs=16))
    client = TestClient(app)
    health = client.get("/health")
    assert health.status_code == 200
    assert (health.headers[SCHEDULING_POLICY_HEADER], health.headers[MAX_NUM_SEQS_HEADER]) == (
        "priority", "16")
    assert MAX_NUM_SEQS_HEADER not in client.get("/metrics").headers
