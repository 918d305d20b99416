"""The shared dispatcher's leases against a real ``redis-server``: two replicas' dispatchers
in one process, each with its own store connection. Every way a request can end (done,
exception, cancelled while waiting, cancelled while its store call is on the wire, queue
timeout) leaves nothing held in Redis. The HTTP behaviour with real gateway processes is
in tests/gateway/test_replicas_slots_http.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests._redis import RedisServer, require_redis_client

require_redis_client()

from tokenpace.gateway import parse_config  # noqa: E402
from tokenpace.gateway.dispatch import QueueFull  # noqa: E402
from tokenpace.gateway.dispatch import SharedDispatcher  # noqa: E402
from tokenpace.gateway.state import RedisStore  # noqa: E402
from tokenpace.gateway.tenants import Tenants  # noqa: E402

URL = "http://127.0.0.1:1"
KEYS = [f"engine:{URL}", "running:t", "queued:t"]


def config() -> Any:
    return parse_config({
        "engines": [{"url": URL, "max_inflight": 4, "models": ["m"]}],
        "tenants": [{"id": "t", "api_keys": ["k"], "max_concurrency": 1, "max_queued": 1},
                    {"id": "u", "api_keys": ["k2"]}],
        "ledger": "sqlite:///unused.db",
    })


Replica = tuple[SharedDispatcher, Any, RedisStore]


async def replicas(url: str, n: int = 2) -> list[Replica]:
    out = []
    for _ in range(n):
        cfg = config()
        clock = asyncio.get_running_loop().time
        store = RedisStore(url, lease_s=5.0, timeout_s=5.0)  # generous: a loaded box
        await store.start()
        out.append((SharedDispatcher(cfg, clock, store), Tenants(cfg, clock).get("t"), store))
    return out


async def close(reps: list[Replica]) -> None:
    for dispatcher, _, store in reps:
        await dispatcher.close()
        await store.close()


def lease(rep: Replica, timeout_s: float = 30.0) -> Any:
    dispatcher, tenant, _ = rep
    return dispatcher.lease(tenant, dispatcher.pools["m"], timeout_s, 1.0, 1.0)


async def nothing_held(store: RedisStore) -> None:
    """Wait (bounded) for the background releases; fail if a slot stays held."""
    for _ in range(200):
        held = await store.held(KEYS)
        if not any(held.values()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"slots still held in Redis: {held}")


async def until_queued(store: RedisStore, task: asyncio.Task[Any]) -> None:
    """Wait (bounded) until the tenant holds a queued place; a waiter that failed instead
    raises its error here."""
    for _ in range(1000):
        if task.done():
            await task  # raises what it failed with
            raise AssertionError("the waiter got its slot instead of waiting")
        if (await store.held(KEYS))["queued:t"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the waiter took no queued place within 10 s")


def run(redis_server: RedisServer, body: Callable[[list[Replica]], Awaitable[None]]) -> None:
    async def main() -> None:
        reps = await replicas(redis_server.url)
        try:
            await body(reps)
        finally:
            await close(reps)
    asyncio.run(main())


def test_the_limit_is_global_and_a_release_hands_the_slot_over(redis_server: RedisServer) -> None:
    async def body(reps: list[Replica]) -> None:
        first = await lease(reps[0]).acquire()
        waiting = asyncio.create_task(lease(reps[1]).acquire())
        await asyncio.sleep(0.3)  # many poll intervals: it must still wait
        assert not waiting.done()
        assert (await reps[1][2].held(KEYS))["queued:t"] == 1
        first.release()
        second = await asyncio.wait_for(waiting, 10)
        assert (await reps[0][2].held(KEYS))["running:t"] == 1
        second.release()
        await nothing_held(reps[0][2])
    run(redis_server, body)


def test_max_queued_is_global(redis_server: RedisServer) -> None:
    async def body(reps: list[Replica]) -> None:
        first = await lease(reps[0]).acquire()
        waiting = asyncio.create_task(lease(reps[0]).acquire())
        await until_queued(reps[1][2], waiting)
        with pytest.raises(QueueFull):  # the other replica's queued place counts here
            await lease(reps[1]).acquire()
        first.release()
        (await asyncio.wait_for(waiting, 10)).release()
        await nothing_held(reps[0][2])
    run(redis_server, body)


@pytest.mark.parametrize("how", ["exception", "cancel_waiting", "timeout", "cancel_on_wire",
                                 "cancel_holding"])
def test_no_exit_path_leaves_a_slot_in_redis(redis_server: RedisServer, how: str) -> None:
    async def body(reps: list[Replica]) -> None:
        store = reps[0][2]
        if how == "exception":
            with pytest.raises(RuntimeError):
                async with lease(reps[0]):
                    raise RuntimeError("the engine call failed")
        elif how == "cancel_on_wire":
            # Cancelled while its first store call is on its way: the lease that call
            # brings back is released as soon as it arrives.
            task = asyncio.create_task(lease(reps[0]).acquire())
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        elif how == "cancel_holding":
            holding = asyncio.Event()

            async def hold() -> None:
                async with lease(reps[0]):
                    holding.set()
                    await asyncio.Event().wait()
            task = asyncio.create_task(hold())
            await holding.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            first = await lease(reps[1]).acquire()
            if how == "timeout":
                with pytest.raises(TimeoutError):
                    await lease(reps[0], timeout_s=0.3).acquire()
            else:
                task = asyncio.create_task(lease(reps[0]).acquire())
                await until_queued(store, task)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            first.release()
        await nothing_held(store)
        dispatcher, tenant, _ = reps[0]
        assert (tenant.inflight, tenant.queued, dispatcher.engines[0].waiting()) == (0, 0, 0)
    run(redis_server, body)
