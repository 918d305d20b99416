"""Engines that die and come back, over real HTTP: a gateway process in front of
two small engines, one of which is stopped (its port closed, as after a SIGKILL) and later
started again on the same port.

What a client must see: no request that never reached the dead engine fails (each goes to
the live one, one ledger row each, charged once); the dead engine is out of dispatch at
the first refused connection, not after the periodic checks; a pool whose last engine is
gone answers 503 ``engine_unavailable`` with ``retry-after``; a restarted engine takes
traffic again within one health interval of answering.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway._engine import EngineServer, FakeEngine
from tests.gateway.conftest import GatewayProcess
from tokenpace.gateway.fleet import HEALTH_INTERVAL_S

KEY = "sk-fleet"


def config(urls: list[str], ledger: Path) -> dict[str, Any]:
    return {
        "engines": [{"url": u, "max_inflight": 4, "models": ["chat"]} for u in urls],
        "ledger": f"sqlite:///{ledger}",
        "tenants": [{"id": "fleet", "api_keys": [KEY]}],
    }


def send(gw: GatewayProcess, i: int, stream: bool) -> httpx.Response:
    body = {"model": "chat", "prompt": f"request {i}", "max_tokens": 3, "stream": stream}
    with httpx.Client(timeout=30) as http:
        resp = http.post(f"{gw.url}/v1/completions", json=body,
                         headers={"authorization": f"Bearer {KEY}"})
        resp.read()
        return resp


def burst(gw: GatewayProcess, first: int, n: int, streams: int = 8) -> list[httpx.Response]:
    """``n`` requests from ``streams`` clients at once, streamed and not alternately."""
    answers: list[httpx.Response | None] = [None] * n
    todo = iter(range(n))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            answers[i] = send(gw, first + i, stream=i % 2 == 0)

    threads = [threading.Thread(target=client) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a is not None for a in answers)
    return answers  # type: ignore[return-value]


def engine_health(gw: GatewayProcess) -> dict[str, bool]:
    return {e["url"]: e["healthy"] for e in gw.health()["engines"]}


@pytest.fixture
def pair(make_gateway: Any, tmp_path: Path) -> Any:
    engines = [EngineServer(FakeEngine(models=("chat",), token_delay_s=0.02)).start()
               for _ in range(2)]
    gw = make_gateway(config([e.url for e in engines], tmp_path / "u.db"))
    yield gw, engines
    for e in engines:
        e.stop()


def test_requests_that_never_reached_a_dead_engine_all_succeed_on_the_live_one(
        pair: Any) -> None:
    gw, (dead, live) = pair
    assert all(a.status_code == 200 for a in burst(gw, 0, 8))
    assert dead.engine.requests and live.engine.requests  # the pool used both
    before = (len(dead.engine.requests), len(live.engine.requests))
    dead.stop()  # its port refuses connections from here; the gateway does not know yet
    answers = burst(gw, 100, 40)
    assert [a.status_code for a in answers] == [200] * 40, [a.text for a in answers
                                                             if a.status_code != 200]
    assert len(dead.engine.requests) == before[0]
    assert len(live.engine.requests) == before[1] + 40
    # Out at the first refusal: two periodic checks (2 s apart) could not have done it yet.
    assert engine_health(gw)[dead.url] is False
    assert "refused a connection" in gw.log()
    rows = gw.rows(48)
    assert len(rows) == 48 and {r.finish_reason for r in rows} == {"length"}
    assert sum(r.completion_tokens for r in rows) == 48 * 3
    assert gw.wait_metric("tokenpace_gateway_inflight_requests", 0, tenant="fleet") == 0


def test_a_restarted_engine_takes_traffic_within_one_health_interval(pair: Any) -> None:
    gw, (dead, live) = pair
    dead.stop()
    assert all(a.status_code == 200 for a in burst(gw, 0, 8))
    assert engine_health(gw)[dead.url] is False
    back = EngineServer(FakeEngine(models=("chat",), token_delay_s=0.02), port=dead.port).start()
    try:
        answering = time.monotonic()  # its /health answers from here
        while not engine_health(gw)[dead.url]:
            # Probes back off to one health interval, never longer; 2 s of margin for a
            # loaded machine (the probe and this poll are each a few ms of HTTP).
            assert time.monotonic() - answering < HEALTH_INTERVAL_S + 2.0
            time.sleep(0.02)
        assert all(a.status_code == 200 for a in burst(gw, 100, 16))
        assert back.engine.requests  # dispatched to again, not held by an old reading
    finally:
        back.stop()


def test_a_pool_without_a_reachable_engine_answers_503_with_retry_after(
        make_gateway: Any, tmp_path: Path) -> None:
    engine = EngineServer(FakeEngine(models=("chat",))).start()
    gw = make_gateway(config([engine.url], tmp_path / "u.db"))
    assert send(gw, 0, stream=False).status_code == 200
    engine.stop()
    for i, stream in ((1, True), (2, False)):
        resp = send(gw, i, stream)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "engine_unavailable"
        assert resp.headers["retry-after"] == "2"
    rows = gw.rows(3)
    assert [r.finish_reason for r in rows[1:]] == ["rejected:engine_unavailable"] * 2
    assert [r.completion_tokens for r in rows[1:]] == [0, 0]


def test_an_engine_answering_503_is_left_for_the_others(pair: Any) -> None:
    """An engine that answers 503 before working on a request (vLLM at its queue limits,
    elastic EP scaling) did not take it: it goes to the other engine, and the engine is out
    of dispatch until a probe of its /health answers (which it does: it comes back, and is
    left again at its next 503)."""
    gw, (draining, live) = pair
    draining.engine.unavailable = True
    answers = burst(gw, 0, 24)
    assert [a.status_code for a in answers] == [200] * 24
    assert draining.engine.unavailable_answers >= 1 and not draining.engine.requests
    assert "answered 503" in gw.log()
    rows = gw.rows(24)
    assert len(rows) == 24 and {r.finish_reason for r in rows} == {"length"}


def test_drain_by_admin_and_by_reload(pair: Any, tmp_path: Path) -> None:
    """A drained engine gets no new request; the one it runs finishes; /health and the
    metrics say so; the file's ``drain`` is applied by a reload, both ways."""
    gw, (drained, other) = pair
    gw.config["admin_api_keys"] = ["sk-admin"]
    gw.write(gw.config)
    gw.stop()
    gw.start()
    admin = {"authorization": "Bearer sk-admin"}
    results: list[httpx.Response] = []
    slow = threading.Thread(target=lambda: results.append(
        httpx.post(f"{gw.url}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "chat", "prompt": "SLOW", "max_tokens": 20}, timeout=30)))
    # The slow request must run on `drained`: drain `other` first, start the request,
    # then swap the two.
    assert httpx.post(f"{gw.url}/admin/engines/drain", headers=admin,
                      json={"engine": other.url, "drain": True}).json()["draining"] is True
    slow.start()
    deadline = time.monotonic() + 10
    while not drained.engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    httpx.post(f"{gw.url}/admin/engines/drain", headers=admin,
               json={"engine": other.url, "drain": False})
    resp = httpx.post(f"{gw.url}/admin/engines/drain", headers=admin,
                      json={"engine": drained.url, "drain": True})
    assert resp.status_code == 200 and resp.json()["inflight"] == 1
    assert gw.metric("tokenpace_gateway_engine_draining", engine=drained.url) == 1.0
    health = {e["url"]: e for e in gw.health()["engines"]}
    assert health[drained.url]["draining"] is True and health[drained.url]["healthy"] is True
    seen = len(drained.engine.requests)
    assert all(a.status_code == 200 for a in burst(gw, 0, 12))
    slow.join()
    assert results[0].status_code == 200 and results[0].json()["usage"]["completion_tokens"] == 20
    assert len(drained.engine.requests) == seen  # nothing new
    # Refusals: no key, a tenant's key, an unknown engine, a bad body.
    assert httpx.post(f"{gw.url}/admin/engines/drain",
                      json={"engine": drained.url}).status_code == 401
    assert httpx.post(f"{gw.url}/admin/engines/drain", headers={"authorization": f"Bearer {KEY}"},
                      json={"engine": drained.url}).status_code == 403
    assert httpx.post(f"{gw.url}/admin/engines/drain", headers=admin,
                      json={"engine": "http://nowhere:1"}).status_code == 404
    assert httpx.post(f"{gw.url}/admin/engines/drain", headers=admin,
                      json={"engine": drained.url, "drain": "yes"}).status_code == 400
    # A reload applies the file: drained there, so it stays drained; then undrained.
    gw.config["engines"][0]["drain"] = True
    gw.write(gw.config)
    assert httpx.post(f"{gw.url}/admin/reload", headers=admin).status_code == 200
    assert gw.metric("tokenpace_gateway_engine_draining", engine=drained.url) == 1.0
    gw.config["engines"][0]["drain"] = False
    gw.write(gw.config)
    assert httpx.post(f"{gw.url}/admin/reload", headers=admin).status_code == 200
    assert gw.metric("tokenpace_gateway_engine_draining", engine=drained.url) == 0.0
    assert all(a.status_code == 200 for a in burst(gw, 100, 16))
    assert len(drained.engine.requests) > seen


@pytest.mark.redis
def test_every_replica_leaves_a_dead_engine_on_its_own(tmp_path: Path) -> None:
    """Two gateway replicas sharing slots and counters in a real ``redis-server``: each
    finds the dead engine by its own refused connection (passive health is per process,
    nothing is told through the store), so neither fails a request that never reached it,
    and a slot of the dead engine held in the store is not what keeps it out."""
    from tests._redis import RedisServer, require_redis_client

    require_redis_client()
    redis = RedisServer(tmp_path / "redis").start()
    engines = [EngineServer(FakeEngine(models=("chat",), token_delay_s=0.02)).start()
               for _ in range(2)]
    replicas: list[GatewayProcess] = []
    try:
        for i in range(2):
            home = tmp_path / f"replica-{i}"
            home.mkdir()
            cfg = config([e.url for e in engines], home / "u.db")
            cfg["state"] = {"url": redis.url, "timeout": "1s"}
            replicas.append(GatewayProcess(home, cfg).start())
        dead, live = engines
        for gw in replicas:
            assert all(a.status_code == 200 for a in burst(gw, 0, 8))
        seen = len(dead.engine.requests)
        assert seen  # both replicas used both engines
        dead.stop()
        for n, gw in enumerate(replicas):
            answers = burst(gw, 100 * (n + 1), 24)
            assert [a.status_code for a in answers] == [200] * 24, [
                a.text for a in answers if a.status_code != 200]
            assert engine_health(gw)[dead.url] is False
            # Its own finding: a refused connection, or its own health probe where that
            # came first (the second replica's burst starts a second or two after the
            # kill, its probe interval is 2 s); nothing is told through the store.
            log = gw.log()
            assert "refused a connection" in log or f"{dead.url} is DOWN" in log, log
            rows = gw.rows(32)
            assert len(rows) == 32 and {r.finish_reason for r in rows} == {"length"}
        assert len(dead.engine.requests) == seen
    finally:
        for gw in replicas:
            gw.stop()
        for e in engines:
            e.stop()
        redis.stop()


def test_an_engine_shutting_down_is_drained_until_it_is_gone_and_back(pair: Any) -> None:
    """vLLM on SIGTERM (measured on 0.32 with --shutdown-timeout): its /health answers 200,
    new completions get 500 "cannot schedule new futures after shutdown", running ones
    finish, then its port closes. The gateway sends the refused requests elsewhere (all
    200), shows the engine draining (not down, no refused connection counted) while its
    request in flight finishes, takes it as down once it is gone, and back once restarted."""
    gw, engines = pair
    results: list[httpx.Response] = []
    slow = threading.Thread(target=lambda: results.append(
        httpx.post(f"{gw.url}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "chat", "prompt": "SLOW", "max_tokens": 40}, timeout=30)))
    slow.start()
    deadline = time.monotonic() + 10
    while not any(e.engine.active for e in engines):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stopping = next(e for e in engines if e.engine.active)  # the one running it
    assert stopping.engine.active == 1
    stopping.engine.shutting_down = True  # SIGTERM
    seen = len(stopping.engine.requests)
    answers = burst(gw, 0, 24)
    assert [a.status_code for a in answers] == [200] * 24, [a.text for a in answers]
    assert len(stopping.engine.requests) == seen and stopping.engine.unavailable_answers >= 1
    health = {e["url"]: e for e in gw.health()["engines"]}
    assert health[stopping.url]["healthy"] is True
    assert health[stopping.url]["draining"] is True and health[stopping.url]["shutting_down"]
    assert gw.metric("tokenpace_gateway_engine_draining", engine=stopping.url) == 1.0
    assert gw.metric("tokenpace_gateway_engine_up", engine=stopping.url) == 1.0
    assert not gw.metric("tokenpace_gateway_engine_refused_connections_total",
                         engine=stopping.url)
    assert "is shutting down" in gw.log()
    # Probes of its /health still answer: it stays out (no request sent to it again).
    refused = stopping.engine.unavailable_answers
    time.sleep(HEALTH_INTERVAL_S + 0.5)
    assert all(a.status_code == 200 for a in burst(gw, 100, 8))
    assert len(stopping.engine.requests) == seen
    assert stopping.engine.unavailable_answers == refused
    slow.join()
    assert results[0].status_code == 200
    assert results[0].json()["usage"]["completion_tokens"] == 40  # finished where it ran
    stopping.stop()  # the process exits: gone
    deadline = time.monotonic() + HEALTH_INTERVAL_S + 2.0  # one probe, 2 s of margin
    while engine_health(gw)[stopping.url]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    health = {e["url"]: e for e in gw.health()["engines"]}
    assert health[stopping.url]["draining"] is False and "shutting_down" not in health[stopping.url]
    back = EngineServer(FakeEngine(models=("chat",), token_delay_s=0.02),
                        port=stopping.port).start()
    try:
        deadline = time.monotonic() + HEALTH_INTERVAL_S + 2.0
        while not engine_health(gw)[stopping.url]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert all(a.status_code == 200 for a in burst(gw, 200, 16))
        assert back.engine.requests
    finally:
        back.stop()
