"""A model pool of two engines shared by two replicas, against a real ``redis-server``:
an engine whose global ``max_inflight`` the other replica fills is skipped and the
request goes to the pool's other engine; a paced tenant fills the same first engine on
both."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tests._redis import RedisServer, require_redis_client
from tests.state._replicas import Replica, with_replicas

require_redis_client()

from tokenpace.gateway import parse_config  # noqa: E402

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def config() -> Any:
    return parse_config({
        "engines": [{"url": u, "max_inflight": 1, "models": ["m"], "api_key": "sk-engine"}
                    for u in URLS],
        "tenants": [{"id": "u", "api_keys": ["k"]},
                    {"id": "paced", "api_keys": ["kp"], "output_tokens_per_second": 10}],
        "ledger": "sqlite:///unused.db",
    })


def run(redis_server: RedisServer, body: Callable[[list[Replica]], Awaitable[None]]) -> None:
    """``body`` with two replicas' dispatchers, each with its own store connection."""
    with_replicas(redis_server, config, body)


def test_a_full_engine_is_skipped_for_the_pools_other_one(redis_server: RedisServer) -> None:
    async def body(reps: list[Replica]) -> None:
        (d0, t0, _), (d1, t1, _) = reps
        first = await d0.lease(t0.get("u"), d0.pools["m"], 30.0, 1.0, 1.0).acquire()
        # Replica 1 has seen nothing of replica 0's slot: its own count says both
        # engines are free, the store says one is full.
        second = await d1.lease(t1.get("u"), d1.pools["m"], 30.0, 1.0, 1.0).acquire()
        assert {first.engine.url, second.engine.url} == set(URLS)
        # Both engines are full everywhere: a third request waits for a release.
        third = asyncio.create_task(
            d1.lease(t1.get("u"), d1.pools["m"], 30.0, 1.0, 1.0).acquire())
        await asyncio.sleep(0.3)  # many poll intervals
        assert not third.done()
        first.release()
        got = await asyncio.wait_for(third, 10)
        assert got.engine.url == first.engine.url
        second.release()
        got.release()
    run(redis_server, body)


def test_a_paced_tenant_fills_the_same_first_engine_on_every_replica(
        redis_server: RedisServer) -> None:
    """A paced tenant's first engine (rendezvous order) is the same on both replicas; once
    the store says it is full, the other replica's request spills to the pool's other
    engine (its rate is then split over both, ``_shared_split``)."""
    async def body(reps: list[Replica]) -> None:
        (d0, t0, _), (d1, t1, _) = reps
        pool0, pool1 = d0.pools["m"], d1.pools["m"]
        assert d0.engine_for("paced", pool0).url == d1.engine_for("paced", pool1).url
        first = await d0.lease(t0.get("paced"), pool0, 30.0, 1.0, 1.0).acquire()
        assert first.engine.url == d0.engine_for("paced", pool0).url
        second = await d1.lease(t1.get("paced"), pool1, 30.0, 1.0, 1.0).acquire()
        assert second.engine.url != first.engine.url
        first.release()
        second.release()
    run(redis_server, body)
