"""``/metrics`` and ``/health``: behind keys where they reveal tenants and hosts, one render
per ``metrics_cache`` whatever the number of scrapers, and garbage collection paused only
while the page renders, not while a client reads it."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import httpx

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import ADMIN_KEY, KEY_A, base_config
from tokenpace.gateway.config import parse_config
from tokenpace.gateway.server import Gateway
from tokenpace.gateway.server._scrape import PageCache

METRICS_KEY = "sk-prometheus"


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _chat(url: str, key: str = KEY_A) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=_bearer(key), timeout=30,
                      json={"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 4})


def test_metrics_and_health_details_need_a_key(engine: EngineServer, make_gateway: Any,
                                               tmp_path: Path) -> None:
    cfg = base_config(engine.url, tmp_path / "usage.db")
    cfg["metrics_api_keys"] = [METRICS_KEY]
    gw = make_gateway(cfg)
    assert _chat(gw.url).status_code == 200
    anonymous = httpx.get(f"{gw.url}/metrics")
    assert anonymous.status_code == 401 and "team-a" not in anonymous.text
    assert anonymous.headers["www-authenticate"] == "Bearer"
    tenant = httpx.get(f"{gw.url}/metrics", headers=_bearer(KEY_A))
    assert tenant.status_code == 403 and "team-a" not in tenant.text
    for key in (METRICS_KEY, ADMIN_KEY):
        page = httpx.get(f"{gw.url}/metrics", headers=_bearer(key))
        assert page.status_code == 200 and 'tenant="team-a"' in page.text
    # /health: the status for anyone; engines and state only for a key.
    for headers in ({}, _bearer(KEY_A)):
        bare = httpx.get(f"{gw.url}/health", headers=headers)
        assert bare.status_code == 200 and bare.json() == {"status": "ok"}
        assert engine.url not in bare.text
    detailed = httpx.get(f"{gw.url}/health", headers=_bearer(METRICS_KEY)).json()
    assert detailed["engines"][0]["url"] == engine.url and detailed["state"]["healthy"]
    assert "metrics_api_keys is not set" not in gw.log()


def test_an_open_metrics_page_is_logged_and_cached(engine: EngineServer, make_gateway: Any,
                                                   tmp_path: Path) -> None:
    """Without ``metrics_api_keys`` the default scrape works (and the start-up log says the
    page is open); within ``metrics_cache`` every scrape gets the same page, even after a
    request that changed a counter; a page older than that is rendered again."""
    cfg = base_config(engine.url, tmp_path / "usage.db")
    cfg["metrics_cache"] = "30s"
    gw = make_gateway(cfg)
    assert "metrics_api_keys is not set: /metrics is open" in gw.log()
    first = httpx.get(f"{gw.url}/metrics")
    assert first.status_code == 200
    assert _chat(gw.url).status_code == 200
    again = httpx.get(f"{gw.url}/metrics")
    assert again.content == first.content and 'tenant="team-a"' not in again.text
    cfg["metrics_cache"] = "0"
    gw.write(cfg)
    assert httpx.post(f"{gw.url}/admin/reload", headers=_bearer(ADMIN_KEY)).status_code == 200
    assert 'tenant="team-a"' in httpx.get(f"{gw.url}/metrics").text


def test_concurrent_scrapes_share_one_render() -> None:
    """Scrapes that arrive while a page renders wait for it; one that leaves does not stop
    it; ``max_age_s`` 0 still shares the render under way."""
    renders: list[int] = []

    async def render() -> list[bytes]:
        renders.append(1)
        await asyncio.sleep(0.05)
        return [b"page %d" % len(renders)]

    async def scenario() -> None:
        cache = PageCache(render)
        leaving = asyncio.ensure_future(cache.page(0.0))
        await asyncio.sleep(0)
        leaving.cancel()
        pages = await asyncio.gather(*(cache.page(0.0) for _ in range(20)))
        assert pages == [[b"page 1"]] * 20 and cache.renders == 1
        assert await cache.page(60.0) == [b"page 1"]  # fresh enough: no render
        assert await cache.page(0.0) == [b"page 2"] and cache.renders == 2

    asyncio.run(scenario())


def test_a_slow_reader_does_not_keep_garbage_collection_paused(engine: EngineServer,
                                                               tmp_path: Path) -> None:
    """The page goes out chunk by chunk with the collector enabled between them: a client
    that reads slowly holds the page's memory, not the process's collection."""
    config = parse_config(base_config(engine.url, tmp_path / "usage.db"), tmp_path)
    enabled_while_sending: list[bool] = []

    async def scenario() -> None:
        gateway = Gateway(config)
        async with gateway._lifespan(None):  # type: ignore[arg-type]
            scope = {"type": "http", "method": "GET", "path": "/metrics", "headers": [],
                     "query_string": b"", "root_path": "", "scheme": "http",
                     "server": ("gw", 80), "client": ("127.0.0.1", 1), "http_version": "1.1"}

            async def receive() -> dict[str, Any]:
                await asyncio.sleep(3600)  # the client sends nothing more
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.body" and message.get("body"):
                    enabled_while_sending.append(gc.isenabled())
                    await asyncio.sleep(0.01)  # a slow reader

            await gateway.app(scope, receive, send)

    assert gc.isenabled()
    asyncio.run(scenario())
    assert enabled_while_sending and all(enabled_while_sending)
