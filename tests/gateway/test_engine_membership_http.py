"""Engines that join and leave a running gateway, over real HTTP: a reload that
adds and removes engines, and engines named by DNS (``engines[].discovery: dns``) whose
addresses come and go.

A removed engine's request in flight finishes with all its tokens; nothing new goes there;
an added engine takes requests as soon as the change is applied. The DNS case runs the
gateway in process with the resolver injected (two fake engines on one port at 127.0.0.1
and 127.0.0.2, the way a headless Service's pods share a port), and once as a process with
the system resolver and ``localhost``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from tests._servers import free_port
from tests.gateway._engine import EngineServer, FakeEngine
from tests.gateway.conftest import ADMIN_HEADERS
from tests.gateway.test_engine_failures_http import KEY, burst, engine_health
from tokenpace.gateway.config import parse_config
from tokenpace.gateway.fleet import Discovery
from tokenpace.gateway.server import Gateway


ADMIN = {"authorization": "Bearer sk-admin"}


def engine(url: str) -> dict[str, Any]:
    return {"url": url, "max_inflight": 4, "models": ["chat"]}


def document(engines: list[dict[str, Any]], ledger: Path, **top: Any) -> dict[str, Any]:
    return {"engines": engines, "ledger": f"sqlite:///{ledger}",
            "admin_api_keys": ["sk-admin"], "tenants": [{"id": "fleet", "api_keys": [KEY]}],
            **top}


def slow_request(gw_url: str, results: list[httpx.Response]) -> threading.Thread:
    """A 20-token completion at 50 ms a token (about 1 s at the engine)."""
    thread = threading.Thread(target=lambda: results.append(httpx.post(
        f"{gw_url}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
        json={"model": "chat", "prompt": "SLOW", "max_tokens": 20}, timeout=30)))
    thread.start()
    return thread


def test_a_reload_adds_and_removes_engines(make_gateway: Any, tmp_path: Path) -> None:
    first, second = (EngineServer(FakeEngine(models=("chat",))).start() for _ in range(2))
    try:
        gw = make_gateway(document([engine(first.url)], tmp_path / "u.db"))
        assert all(a.status_code == 200 for a in burst(gw, 0, 8))
        results: list[httpx.Response] = []
        slow = slow_request(gw.url, results)
        deadline = time.monotonic() + 10
        while not first.engine.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.engine.active == 1
        # Swap the engines: `first` leaves with a request in flight, `second` joins.
        gw.write(document([engine(second.url)], tmp_path / "u.db"))
        resp = httpx.post(f"{gw.url}/admin/reload", headers=ADMIN)
        assert resp.status_code == 200, resp.text
        assert list(engine_health(gw)) == [second.url]
        seen = len(first.engine.requests)
        assert all(a.status_code == 200 for a in burst(gw, 100, 12))
        assert len(first.engine.requests) == seen and len(second.engine.requests) == 12
        slow.join()
        assert results[0].status_code == 200
        assert results[0].json()["usage"]["completion_tokens"] == 20  # finished where it ran
        assert gw.metric("tokenpace_gateway_engine_up", engine=first.url) is None
        assert "left the configuration" in gw.log() and "joined" in gw.log()
        # Both again: each takes requests.
        gw.write(document([engine(first.url), engine(second.url)], tmp_path / "u.db"))
        assert httpx.post(f"{gw.url}/admin/reload", headers=ADMIN).status_code == 200
        assert sorted(engine_health(gw)) == sorted([first.url, second.url])
        assert all(a.status_code == 200 for a in burst(gw, 200, 16))
        assert len(first.engine.requests) > seen
        rows = gw.rows(8 + 1 + 12 + 16)
        assert {r.finish_reason for r in rows} == {"length"}
    finally:
        first.stop()
        second.stop()


def test_a_reload_that_drops_an_engines_key_while_rates_are_split_is_refused(
        make_gateway: Any, tmp_path: Path) -> None:
    """Paced tenants' rates are split over engines by a control call that needs each
    engine's key: an engine added without one would break it, so the reload is refused."""
    engines = [EngineServer(FakeEngine(models=("chat",))).start() for _ in range(2)]
    try:
        keyed = [{**engine(e.url), "api_key": "sk-engine"} for e in engines]
        gw = make_gateway(document(keyed[:1], tmp_path / "u.db"))
        gw.write(document([keyed[0], engine(engines[1].url)], tmp_path / "u.db"))
        resp = httpx.post(f"{gw.url}/admin/reload", headers=ADMIN)
        assert resp.status_code == 400 and "engines[1].api_key" in resp.json()["error"]["message"]
        assert list(engine_health(gw)) == [engines[0].url]
        gw.write(document(keyed, tmp_path / "u.db"))
        assert httpx.post(f"{gw.url}/admin/reload", headers=ADMIN).status_code == 200
        assert len(engine_health(gw)) == 2
    finally:
        for e in engines:
            e.stop()


class Resolver:
    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    async def __call__(self, host: str, port: int) -> list[str]:
        assert host == "vllm.fleet.svc"
        return list(self.addresses)


def test_engines_named_by_dns_join_and_leave_as_the_answers_change(tmp_path: Path) -> None:
    port = free_port()
    one, two = (EngineServer(FakeEngine(models=("chat",)), port=port, host=host).start()
                for host in ("127.0.0.1", "127.0.0.2"))
    resolver = Resolver(["127.0.0.1"])
    config = parse_config(document(
        [{"url": f"http://vllm.fleet.svc:{port}", "discovery": "dns", "max_inflight": 4,
          "models": ["chat"]}], tmp_path / "u.db", discovery_interval=0.05))
    headers = {"authorization": f"Bearer {KEY}"}

    async def body() -> None:
        gateway = Gateway(config)
        gateway._discovery = Discovery(resolver)
        async with gateway._lifespan(None):  # type: ignore[arg-type]
            transport = httpx.ASGITransport(app=gateway)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                         timeout=30) as client:
                async def health() -> dict[str, dict[str, Any]]:
                    answer = await client.get("/health", headers=ADMIN_HEADERS)
                    return {e["url"]: e for e in answer.json()["engines"]}

                async def until(urls: set[str]) -> None:
                    deadline = time.monotonic() + 10
                    while set(await health()) != urls:
                        assert time.monotonic() < deadline, await health()
                        await asyncio.sleep(0.02)

                async def complete(prompt: str = "hi", n: int = 1,
                                   tokens: int = 3) -> list[httpx.Response]:
                    return list(await asyncio.gather(*(client.post(
                        "/v1/completions", headers=headers,
                        json={"model": "chat", "prompt": f"{prompt} {i}", "max_tokens": tokens})
                        for i in range(n))))

                assert set(await health()) == {one.url}  # resolved before the first request
                assert (await health())[one.url]["discovered_from"] == \
                    f"http://vllm.fleet.svc:{port}"
                assert all(r.status_code == 200 for r in await complete(n=4))
                resolver.addresses = ["127.0.0.1", "127.0.0.2"]  # scaled up
                await until({one.url, two.url})
                assert all(r.status_code == 200 for r in await complete(n=16))
                assert two.engine.requests
                slow = asyncio.ensure_future(complete("SLOW", tokens=40))  # 2 s
                deadline = time.monotonic() + 10
                while not (one.engine.active or two.engine.active):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                running = one if one.engine.active else two
                staying = two if running is one else one
                resolver.addresses = [staying.url.split("//")[1].split(":")[0]]  # scaled down
                await until({staying.url})
                assert running.engine.active == 1  # left with a request in flight
                seen = len(running.engine.requests)
                assert all(r.status_code == 200 for r in await complete(n=8))
                assert len(running.engine.requests) == seen
                (answer,) = await slow
                assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 40

    try:
        asyncio.run(body())
    finally:
        one.stop()
        two.stop()


def test_an_engine_named_by_dns_through_the_system_resolver(make_gateway: Any,
                                                           tmp_path: Path) -> None:
    """``localhost``: 127.0.0.1 on every host (and ::1 where it is listed too, which the
    fake engine does not listen on: refused, taken out, its requests sent to 127.0.0.1)."""
    fake = EngineServer(FakeEngine(models=("chat",))).start()
    try:
        gw = make_gateway(document([{"url": f"http://localhost:{fake.port}",
                                     "discovery": "dns", "max_inflight": 4,
                                     "models": ["chat"]}], tmp_path / "u.db"))
        assert fake.url in engine_health(gw)
        answers = burst(gw, 0, 12)
        assert [a.status_code for a in answers] == [200] * 12
        assert len(fake.engine.requests) == 12
    finally:
        fake.stop()
