"""Thousands of configured tenants: what must not land on the event loop, and
what must not grow with the configuration. Properties, not timings:

- a reload reads and checks the file in a worker thread: the loop serves meanwhile (the
  load waits for the loop to answer, which would deadlock a reload run on the loop);
- a scrape shows the active tenants only (its slicing on the loop: test_metrics_render.py);
- only tenants with traffic have series, and an idle tenant's series leave;
- the per-second budget snapshot writes only the tenants whose levels changed.

The gateway runs in process (its lifespan driven directly, requests through httpx's ASGI
transport); its engine URL answers nothing, which these checks never need.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenpace.gateway import metrics
from tokenpace.gateway.config import load_config
from tokenpace.gateway.server import Gateway, _app
from tokenpace.gateway.tenants import Tenants

ADMIN = "sk-admin"


def document(tenants: int, ledger: Path, **extra: Any) -> dict[str, Any]:
    return {"engines": [{"url": "http://127.0.0.1:9", "models": ["tiny"]}],
            "ledger": f"sqlite:///{ledger}", "admin_api_keys": [ADMIN],
            "tenants": [{"id": f"mt{i}", "api_keys": [f"sk-{i}"],
                         "budgets": [{"tokens": 1000, "per": "1h"}]} for i in range(tenants)],
            **extra}


@asynccontextmanager
async def running(path: Path) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    gateway = Gateway(load_config(path))
    async with gateway._lifespan(None):  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=gateway)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield gateway, client


def models(client: httpx.AsyncClient, i: int) -> Any:
    return client.get("/v1/models", headers={"authorization": f"Bearer sk-{i}"})


def test_a_reload_reads_the_file_off_the_event_loop(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(document(50, tmp_path / "u.db")))
    loop_answered = threading.Event()
    threads: list[int] = []

    def load(source: Any) -> Any:
        threads.append(threading.get_ident())
        # A reload on the loop would wait here for the loop it blocks: it must not.
        assert loop_answered.wait(timeout=10), "the event loop did not run during the load"
        return load_config(source)

    async def body() -> None:
        async with running(path) as (gateway, client):
            monkeypatch.setattr(_app, "load_config", load)
            path.write_text(json.dumps(document(80, tmp_path / "u.db")))
            reload = asyncio.ensure_future(client.post(
                "/admin/reload", headers={"authorization": f"Bearer {ADMIN}"}))
            while not threads:
                await asyncio.sleep(0.01)
            assert (await models(client, 3)).status_code == 200  # served during the load
            loop_answered.set()
            resp = await reload
            assert resp.status_code == 200, resp.text
            assert threads[0] != threading.get_ident()
            assert len(gateway.config.tenants) == 80
            assert (await models(client, 79)).status_code == 200  # the new tenants are in

    asyncio.run(body())


def test_a_scrape_shows_active_tenants_only(tmp_path: Path) -> None:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(document(2000, tmp_path / "u.db", metrics_idle_after="300ms",
                                        metrics_cache=0)))

    def tenants_on(page: str) -> set[str]:
        return set(re.findall(r'tenant="(mt\d+)"', page))

    async def body() -> None:
        async with running(path) as (_, client):
            assert tenants_on((await client.get("/metrics")).text) == set()
            for i in (5, 7):
                assert (await models(client, i)).status_code == 200
            page = (await client.get("/metrics")).text
            assert tenants_on(page) == {"mt5", "mt7"}
            assert 'tokenpace_gateway_budget_remaining_tokens{budget="1000/1h",tenant="mt5"}' in page
            # Idle past metrics_idle_after (300 ms; swept every 75 ms): the series go.
            deadline = time.monotonic() + 10
            while tenants_on((await client.get("/metrics")).text):
                assert time.monotonic() < deadline, "idle tenants' series stayed"
                await asyncio.sleep(0.05)
            assert (await models(client, 7)).status_code == 200  # traffic again: back
            assert tenants_on((await client.get("/metrics")).text) == {"mt7"}

    asyncio.run(body())


def test_a_busy_tenant_keeps_its_series_however_long_it_waits(tmp_path: Path) -> None:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(document(3, tmp_path / "u.db", metrics_idle_after="1s")))
    config = load_config(path)
    now = [0.0]
    tenants = Tenants(config, lambda: now[0])
    busy, idle = tenants.get("mt0"), tenants.get("mt1")
    assert busy is not None and idle is not None
    tenants.touch(busy)
    tenants.touch(idle)
    busy.inflight = 1
    now[0] = 5.0
    assert tenants.series.sweep() == ["mt1"]
    assert metrics.has_series("mt0") and not metrics.has_series("mt1")
    busy.inflight = 0
    assert tenants.series.sweep() == ["mt0"]
    assert not metrics.has_series("mt0")


def test_the_budget_snapshot_writes_only_changed_levels(tmp_path: Path) -> None:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(document(1000, tmp_path / "u.db")))
    tenants = Tenants(load_config(path), lambda: 0.0)
    assert tenants.changed_levels() == {}
    state = tenants.get("mt42")
    assert state is not None and state.try_reserve(100.0, 0.0) is None
    assert tenants.changed_levels() == {"mt42": {"1000/1h": 900.0}}
    assert tenants.changed_levels() == {}  # written once
