"""The dispatch lease: a slot on an engine, given back however its holder ends
(exception, cancellation while waiting or while holding, timeout); nothing leaks. In
process, on the real Dispatcher and fair queue."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenpace.gateway import parse_config
from tokenpace.gateway.dispatch import Dispatcher, Lease
from tokenpace.gateway.tenants import Tenants


def setup() -> tuple[Dispatcher, Any]:
    config = parse_config({
        "engines": [{"url": "http://127.0.0.1:1", "max_inflight": 4, "models": ["m"]}],
        "tenants": [{"id": "t", "api_keys": ["k"], "max_concurrency": 1}],
        "ledger": "sqlite:///unused.db",
    })
    clock = asyncio.get_running_loop().time
    return Dispatcher(config, clock), Tenants(config, clock).get("t")


def lease(dispatcher: Dispatcher, tenant: Any, timeout_s: float = 60.0) -> Lease:
    return dispatcher.lease(tenant, dispatcher.pools["m"], timeout_s, 1.0, 1.0)


def idle(dispatcher: Dispatcher, tenant: Any) -> bool:
    engine = dispatcher.engines[0]
    return (engine.inflight, tenant.inflight, tenant.queued, engine.waiting()) == (0, 0, 0, 0)


def test_a_lease_is_given_back_when_its_block_raises() -> None:
    async def main() -> None:
        dispatcher, tenant = setup()
        with pytest.raises(RuntimeError):
            async with lease(dispatcher, tenant) as held:
                assert held.waiter is not None and tenant.inflight == 1
                raise RuntimeError("the engine call failed")
        assert idle(dispatcher, tenant)
        held.release()  # idempotent: a second release frees nothing
        assert idle(dispatcher, tenant)
    asyncio.run(main())


def test_a_lease_is_given_back_when_its_holder_is_cancelled() -> None:
    async def main() -> None:
        dispatcher, tenant = setup()
        holding = asyncio.Event()

        async def hold() -> None:
            async with lease(dispatcher, tenant):
                holding.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(hold())
        await holding.wait()
        assert tenant.inflight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert idle(dispatcher, tenant)
    asyncio.run(main())


def test_a_waiter_cancelled_or_timed_out_in_the_queue_leaves_nothing() -> None:
    async def main() -> None:
        dispatcher, tenant = setup()
        async with lease(dispatcher, tenant):  # max_concurrency 1: the others must wait
            waiting = asyncio.create_task(lease(dispatcher, tenant).acquire())
            await asyncio.sleep(0)
            assert tenant.queued == 1 and not waiting.done()
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert tenant.queued == 0 and dispatcher.engines[0].waiting() == 0
            with pytest.raises(TimeoutError):
                await lease(dispatcher, tenant, timeout_s=0.01).acquire()
            assert tenant.queued == 0 and tenant.inflight == 1
        assert idle(dispatcher, tenant)
        async with lease(dispatcher, tenant):  # the slot is free again: granted at once
            assert tenant.inflight == 1
        assert idle(dispatcher, tenant)
    asyncio.run(main())


def test_a_lease_never_granted_releases_nothing() -> None:
    async def main() -> None:
        dispatcher, tenant = setup()
        async with lease(dispatcher, tenant):
            unused = lease(dispatcher, tenant)
            unused.release()  # not granted: must not free the holder's slot
            assert tenant.inflight == 1 and dispatcher.engines[0].inflight == 1
        assert idle(dispatcher, tenant)
    asyncio.run(main())
