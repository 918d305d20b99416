"""Applications with ``state: redis``: against a real ``redis-server``, two replicas share
an application's budgets, request limits and ``max_concurrency`` exactly as its tenant's,
under keys of their own (``<tenant>\\x1f<application>``), and an application's running
slot is one more claim of the same atomic acquire: a request takes the engine's, the
tenant's and its application's slots, all or none."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from tests._redis import RedisServer, require_redis_client

require_redis_client()

from tokenpace.gateway import parse_config  # noqa: E402
from tokenpace.gateway.admission import Admission, admit  # noqa: E402
from tokenpace.gateway.wire import parse_request  # noqa: E402
from tokenpace.gateway.dispatch import Dispatcher  # noqa: E402
from tokenpace.gateway.dispatch import SharedDispatcher  # noqa: E402
from tokenpace.gateway.wire import GatewayError  # noqa: E402
from tokenpace.gateway.ledger import open_ledger  # noqa: E402
from tokenpace.gateway.exchange import Runtime  # noqa: E402
from tokenpace.gateway.exchange import Exchange  # noqa: E402
from tokenpace.gateway.state import RedisStore  # noqa: E402
from tokenpace.gateway.tenants import Tenants  # noqa: E402

CLOSED = "http://127.0.0.1:1"  # no request here needs the engine
CHAT = "t\x1fchat"  # ApplicationConfig.owner("t")


def _config(tmp_path: Path, name: str, redis_url: str) -> Any:
    return parse_config({
        "engines": [{"url": CLOSED, "max_inflight": 8, "models": ["m"]}],
        "ledger": f"sqlite:///{tmp_path / f'{name}.db'}",
        "state": {"url": redis_url, "timeout": "1s"},
        "cost": {"prompt": 1.0, "completion": 1.0},
        "tenants": [{
            "id": "t", "api_keys": ["k"], "budgets": [{"tokens": 1000, "per": "1h"}],
            "applications": [
                {"id": "chat", "api_keys": ["k-chat"], "max_concurrency": 1,
                 "budgets": [{"tokens": 5, "per": "1h"}],
                 "max_requests": [{"requests": 3, "per": "1h"}]},
                {"id": "agent", "api_keys": ["k-agent"]},
            ]}],
    })


def _runtime(tmp_path: Path, name: str, redis_url: str) -> Runtime:
    config = _config(tmp_path, name, redis_url)
    store = RedisStore(redis_url, timeout_s=1.0)
    return Runtime(config, Tenants(config, time.monotonic), Dispatcher(config, time.monotonic),
                   {}, open_ledger(config.ledger), clock=time.monotonic, store=store)


def _exchange(rt: Runtime, application: str) -> Exchange:
    tenant = rt.tenants.get("t")
    return Exchange(rt, "tpg-test", "completion", tenant, rt.clock(), time.time(),
                    application=tenant.applications[application])


async def _close(*runtimes: Runtime) -> None:
    for rt in runtimes:
        await rt.store.close()  # type: ignore[union-attr]
        rt.ledger.close()


async def _admit(rt: Runtime, application: str, ex: Exchange | None = None) -> Any:
    """Admit a one-token request of ``application`` (in ``ex``, when given): the
    admission, or the refusal."""
    ex = ex if ex is not None else _exchange(rt, application)
    req = parse_request("completion", {"model": "m", "prompt": [1], "max_tokens": 1})
    async with httpx.AsyncClient(base_url=CLOSED) as client:
        try:
            return await admit(rt, ex, req, client)
        except GatewayError as exc:
            return exc


def test_replicas_share_an_applications_budget_and_request_limit(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """chat: 5 cost units an hour and 3 requests an hour; each request reserves 2."""
    async def body() -> None:
        a, b = (_runtime(tmp_path, name, redis_server.url) for name in ("a", "b"))
        try:
            assert isinstance(await _admit(a, "chat"), Admission)
            assert isinstance(await _admit(b, "chat"), Admission)  # 1 left in chat's budget
            refused = await _admit(a, "chat")
            assert isinstance(refused, GatewayError) and refused.reason == "budget", refused
            assert "of application 'chat' of tenant 't'" in refused.message
            assert refused.headers["x-ratelimit-limit-tokens"] == "5"
            # That third request counted against chat's request limit (3 an hour): the
            # fourth is refused by it on the other replica, before the budget is asked.
            refused = await _admit(b, "chat")
            assert isinstance(refused, GatewayError) and refused.reason == "requests", refused
            assert refused.headers["x-ratelimit-limit-requests"] == "3"
            # The sibling goes on; the tenant's budget counted both applications' reservations.
            assert isinstance(await _admit(b, "agent"), Admission)
            levels = await a.store.budget_levels("t", a.config.tenants[0].budgets)  # type: ignore[union-attr]
            assert 994.0 <= levels["1000/1h"] <= 994.6  # 3 x 2 taken; 2 s of refill at most
            chat = await a.store.budget_levels(CHAT, a.config.tenants[0].applications[0].budgets)  # type: ignore[union-attr]
            assert 1.0 <= chat["5/1h"] <= 1.01
        finally:
            await _close(a, b)

    asyncio.run(body())


def test_an_applications_concurrency_is_global_and_spares_its_sibling(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """chat runs 1 at a time over both replicas; agent's requests go meanwhile."""
    async def body() -> None:
        reps = []
        for name in ("a", "b"):
            cfg = _config(tmp_path, name, redis_server.url)
            clock = asyncio.get_running_loop().time
            store = RedisStore(redis_server.url, lease_s=5.0, timeout_s=5.0)
            await store.start()
            reps.append((SharedDispatcher(cfg, clock, store), Tenants(cfg, clock).get("t"), store))

        def lease(i: int, application: str) -> Any:
            dispatcher, tenant, _ = reps[i]
            return dispatcher.lease(tenant, dispatcher.pools["m"], 30.0, 1.0, 1.0,
                                    application=tenant.applications[application])

        try:
            first = await lease(0, "chat").acquire()
            waiting = asyncio.create_task(lease(1, "chat").acquire())
            agents = [await asyncio.wait_for(lease(i, "agent").acquire(), 10) for i in (1, 0, 1)]
            await asyncio.sleep(0.3)  # many poll intervals: chat's second must still wait
            assert not waiting.done()
            held = await reps[0][2].held([f"running:{CHAT}", "running:t"])
            assert held == {f"running:{CHAT}": 1, "running:t": 4}
            first.release()
            second = await asyncio.wait_for(waiting, 10)
            assert reps[1][1].applications["chat"].inflight == 1
            for granted in (second, *agents):
                granted.release()
            for _ in range(200):
                held = await reps[0][2].held([f"running:{CHAT}", "running:t"])
                if not any(held.values()):
                    break
                await asyncio.sleep(0.01)
            assert not any(held.values()), held
        finally:
            for dispatcher, _, store in reps:
                await dispatcher.close()
                await store.close()

    asyncio.run(body())


def test_the_application_budget_gauge_reads_the_shared_level(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """What replica b spent from chat's budget shows in replica a's reading for the gauge
    (``application_budget_remaining_tokens``); agent, without budgets, has no series; a
    store that does not answer leaves no series rather than a stale level."""
    from tokenpace.gateway.tenants import SharedBudgetLevels

    async def body() -> None:
        a, b = (_runtime(tmp_path, name, redis_server.url) for name in ("a", "b"))
        try:
            assert isinstance(await _admit(b, "chat"), Admission)  # 2 of chat's 5
            assert isinstance(await _admit(b, "agent"), Admission)
            a.tenants.touch(a.tenants.get("t"))  # active on replica a: its series are shown
            levels = SharedBudgetLevels(a.tenants.series, a.store)  # type: ignore[arg-type]
            await levels.refresh()
            (labels, level), = levels.application_samples()
            assert labels == ("t", "chat", "5/1h") and 3.0 <= level <= 3.01
            (labels, level), = levels.samples()
            assert labels == ("t", "1000/1h") and 996.0 <= level <= 996.6
            redis_server.kill()
            await levels.refresh()
            assert list(levels.application_samples()) == [] and list(levels.samples()) == []
        finally:
            a.tenants.series.clear()
            await _close(a, b)

    asyncio.run(body())


def test_an_admitted_requests_headroom_is_the_shared_one(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """The x-ratelimit-* figures of an admitted request come from the shared buckets (the
    levels the store's reservation returns): what replica a spent shows in what replica
    b's response says is left."""
    from tokenpace.gateway.wire import headroom_headers

    async def body() -> None:
        a, b = (_runtime(tmp_path, name, redis_server.url) for name in ("a", "b"))
        try:
            assert isinstance(await _admit(a, "chat"), Admission)  # chat: 5 -> 3, 3 -> 2 requests
            ex = _exchange(b, "chat")
            assert isinstance(await _admit(b, "chat", ex), Admission)
            h = headroom_headers(ex.requests_headroom, ex.tokens_headroom)
            assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("5", "1")
            assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) \
                == ("3", "1")
        finally:
            await _close(a, b)

    asyncio.run(body())
