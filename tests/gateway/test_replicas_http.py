"""Gateway replicas sharing their tenants' budgets in a real ``redis-server``: separate
processes, and ``--workers`` on one port.

Budgets here; shared slots and fair-queue counters through replicas are in
test_replicas_slots_http.py (docs/gateway/replicas.md).
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from tests._redis import RedisServer, require_redis_client
from tests._servers import Server, free_port
from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_A, GatewayProcess, base_config

require_redis_client()

PROMPT = "x" * 99  # 100 prompt tokens in the fake engine's count
BODY = {"model": "fake", "prompt": PROMPT, "max_tokens": 8}
COST = 100 + 2 * 8  # reserved and (the fake engine streams max_tokens) actual
BUDGET = 1000  # per hour: refill 0.28 per second, under one request's cost per minute



def replicas(engine: EngineServer, tmp_path: Path, redis_url: str, n: int,
             budget: int = BUDGET, **state: Any) -> list[GatewayProcess]:
    out = []
    for i in range(n):
        home = tmp_path / f"replica-{i}"
        home.mkdir()
        config = base_config(engine.url, home / "usage.db",
                             budgets=[{"tokens": budget, "per": "1h"}])
        # A generous timeout: on a loaded CI box 100 ms Redis calls would time out and
        # answer 503; the timeout itself is tested in tests/state.
        config["state"] = {"url": redis_url, "timeout": "1s"}
        config.update(state)
        out.append(GatewayProcess(home, config).start())
    return out


def post(gw: GatewayProcess) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/completions", json=BODY, timeout=30,
                      headers={"authorization": f"Bearer {KEY_A}"})


def test_two_replicas_admit_what_one_would(engine: EngineServer, tmp_path: Path,
                                          redis_server: RedisServer) -> None:
    gws = replicas(engine, tmp_path, redis_server.url, 2)
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: post(gws[i % 2]), range(20)))
        elapsed = time.monotonic() - started
        ok = [a for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code == 429]
        assert len(ok) + len(refused) == 20, [a.status_code for a in answers]
        # One replica admits floor(1000 / 116) = 8; two with their own budgets would admit 16.
        assert len(ok) == BUDGET // COST, len(ok)
        rows = [r for gw in gws for r in gw.rows(0)]
        charged = sum(r.cost for r in rows)
        assert charged <= BUDGET + BUDGET / 3600 * (elapsed + 5)
        # Exact headers from either replica: the same shared bucket answers.
        late = [post(gw) for gw in gws]
        assert [r.status_code for r in late] == [429, 429]
        for r in late:
            assert r.headers["x-ratelimit-limit-tokens"] == str(BUDGET)
        remaining = [int(r.headers["x-ratelimit-remaining-tokens"]) for r in late]
        assert all(abs(x - (BUDGET - len(ok) * COST)) <= 2 for x in remaining), remaining
    finally:
        for gw in gws:
            gw.stop()


def test_closed_answers_503_while_redis_is_down_and_recovers(
        engine: EngineServer, tmp_path: Path, redis_server: RedisServer) -> None:
    (gw,) = replicas(engine, tmp_path, redis_server.url, 1)
    try:
        assert post(gw).status_code == 200
        redis_server.kill()
        started = time.monotonic()
        down = post(gw)
        took = time.monotonic() - started
        assert down.status_code == 503, down.text
        assert down.headers["retry-after"] == "1"
        assert down.json()["error"]["code"] == "state_unavailable"
        assert took < 2.0  # a refused connection fails at once; 2 s of margin for the box
        health = gw.health()
        assert health["state"]["healthy"] is False and health["state"]["backend"] == "redis"
        redis_server.start()
        deadline = time.monotonic() + 10
        while (answer := post(gw)).status_code != 200:
            assert answer.status_code == 503 and time.monotonic() < deadline
            time.sleep(0.2)
        assert gw.health()["state"]["healthy"] is True
        # The append-only file kept the first reservation: 1000 - 2 x 116 remain.
        level = gw.metric("tokenpace_gateway_state_up")
        assert level == 1.0
    finally:
        gw.stop()


def test_workers_share_one_port_and_one_budget(engine: EngineServer, tmp_path: Path,
                                               redis_server: RedisServer) -> None:
    """``--workers 2``: two processes answer on one port and together admit what one would."""
    config = base_config(engine.url, tmp_path / "usage.db",
                         budgets=[{"tokens": BUDGET, "per": "1h"}])
    config["state"] = {"url": redis_server.url, "timeout": "1s"}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    server = Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(path),
                     "--port", str(port), "--workers", "2", "--log-level", "warning"],
                    port, tmp_path / "gateway.log")
    try:
        server.wait_ready(timeout_s=30)
        deadline = time.monotonic() + 20
        while len(psutil.Process(server.proc.pid).children()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/v1/completions"
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: httpx.post(
                url, json=BODY, timeout=30, headers={"authorization": f"Bearer {KEY_A}"}
            ).status_code, range(16)))
        assert codes.count(200) == BUDGET // COST, codes
        assert set(codes) == {200, 429}, codes
    finally:
        server.stop()


def test_open_admits_under_fallback_budgets_while_redis_is_down(
        engine: EngineServer, tmp_path: Path, redis_server: RedisServer) -> None:
    (gw,) = replicas(engine, tmp_path, redis_server.url, 1, on_state_failure="open")
    gw.write({**gw.config, "state": {**gw.config["state"], "replicas": 2}})
    gw.stop()
    gw.start()
    try:
        redis_server.kill()
        codes = [post(gw).status_code for _ in range(6)]
        # Fallback budget: 1000 / 2 replicas = 500, room for 4 requests of 116.
        assert codes == [200] * 4 + [429] * 2, codes
        # Reservations: 4 admitted on the prompt's byte bound; 2 refused on it, then again
        # on the exact count (a refusal is only given on the exact cost).
        assert gw.metric("tokenpace_gateway_state_fallbacks_total", operation="reserve") == 8
        assert gw.metric("tokenpace_gateway_state_up") == 0.0
        redis_server.start()
        deadline = time.monotonic() + 10
        while gw.metric("tokenpace_gateway_state_up") != 1.0:
            post(gw)  # the next call after the probe interval finds Redis again
            assert time.monotonic() < deadline
            time.sleep(0.2)
        # Shared again: Redis's budget saw none of the fallback's requests, and this one is
        # decided there, not in the fallback (whose budget the loop above kept exhausted).
        fallbacks = gw.metric("tokenpace_gateway_state_fallbacks_total", operation="reserve")
        assert post(gw).status_code == 200
        assert gw.metric("tokenpace_gateway_state_fallbacks_total", operation="reserve") == fallbacks
    finally:
        gw.stop()


def test_a_sigkilled_replica_leaves_the_survivor_serving_with_every_ledger_row(
        engine: EngineServer, tmp_path: Path, redis_server: RedisServer) -> None:
    started = time.monotonic()
    gws = replicas(engine, tmp_path, redis_server.url, 2, budget=100_000)
    try:
        assert [post(gw).status_code for gw in gws * 3] == [200] * 6
        assert gws[0].server is not None
        gws[0].server.proc.kill()  # SIGKILL: no shutdown, no settlement, no ledger flush
        gws[0].server.proc.wait(10)
        survivor = gws[1]
        assert [post(survivor).status_code for _ in range(4)] == [200] * 4
        rows = survivor.rows(7)
        assert len(rows) == 7 and all(r.finish_reason == "length" for r in rows), rows
        # The shared budget holds every request of both replicas: 10 x 116 taken.
        level = asyncio.run(_level(redis_server.url, 100_000))
        refill = 100_000 / 3600 * (time.monotonic() - started + 1)
        assert 100_000 - 10 * COST - 1 <= level <= 100_000 - 10 * COST + refill
    finally:
        for gw in gws:
            gw.stop()


async def _level(url: str, tokens: int, per: str = "1h") -> float:
    """team-a's budget level, read from Redis."""
    from tokenpace.fairness import BudgetSpec, parse_duration
    from tokenpace.gateway.state import RedisStore

    store = RedisStore(url, timeout_s=2.0)
    try:
        spec = BudgetSpec(tokens, parse_duration(per))
        return (await store.budget_levels("team-a", [spec]))[spec.key]
    finally:
        await store.close()


def test_budget_gauge_shows_the_shared_level_on_every_replica(
        engine: EngineServer, tmp_path: Path, redis_server: RedisServer) -> None:
    """A request spent on one replica shows in the other's ``budget_remaining_tokens``:
    the gauge publishes the shared bucket (read in the background), not the process's own
    unused one, which would stay full."""
    gws = replicas(engine, tmp_path, redis_server.url, 2)
    try:
        assert post(gws[0]).status_code == 200
        # A replica shows the tenants active on it: team-a calls the other one
        # too, with a request that spends nothing.
        assert httpx.get(gws[1].url + "/v1/models", timeout=30,
                         headers={"authorization": f"Bearer {KEY_A}"}).status_code == 200
        spent = BUDGET - COST
        deadline = time.monotonic() + 10.0  # the gauge is refreshed every 2 s
        levels: list[float | None] = []
        while time.monotonic() < deadline:
            levels = [gw.metric("tokenpace_gateway_budget_remaining_tokens", tenant="team-a")
                      for gw in gws]
            if all(level is not None and level < BUDGET - COST / 2 for level in levels):
                break
            time.sleep(0.1)
        # refill over the test's seconds is 0.28 a second: well under 2 units
        assert all(level is not None and abs(level - spent) <= 2 for level in levels), levels
        redis_server.kill()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and gws[1].metric(
                "tokenpace_gateway_budget_remaining_tokens", tenant="team-a") is not None:
            time.sleep(0.1)
        # no reading, no series: a stale level is not published while the store is down
        assert gws[1].metric("tokenpace_gateway_budget_remaining_tokens", tenant="team-a") is None
    finally:
        for gw in gws:
            gw.stop()
