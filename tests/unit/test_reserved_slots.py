"""An engine's reserved slots (``engines[].reserved_slots``): the last slots of an engine go
only to tenants that hold few requests on it, so one tenant's long requests cannot take
every slot. On the real Dispatcher, without an engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenpace.gateway import ConfigError, parse_config
from tokenpace.gateway.dispatch import Dispatcher, Waiter
from tokenpace.gateway.tenants import Tenants

TENANTS = [{"id": t, "api_keys": [f"k{t}"]} for t in ("heavy", "light", "other")]


def setup(engines: list[dict[str, Any]] | None = None,
          tenants: list[dict[str, Any]] | None = None, **engine: Any) -> tuple[Dispatcher, Tenants]:
    config = parse_config({
        "engines": engines or [{"url": "http://127.0.0.1:1", "models": ["m"], **engine}],
        "tenants": tenants or TENANTS,
        "ledger": "sqlite:///unused.db",
    })
    clock = lambda: 0.0  # noqa: E731
    return Dispatcher(config, clock), Tenants(config, clock)


async def burst(dispatcher: Dispatcher, tenants: Tenants, tenant: str,
                n: int) -> list[asyncio.Task[Waiter]]:
    pool = dispatcher.pools["m"]
    tasks = [asyncio.create_task(dispatcher.acquire(tenants.get(tenant), pool, 60.0, 1.0, 1.0))
             for _ in range(n)]
    await asyncio.sleep(0)
    return tasks


def granted(tasks: list[asyncio.Task[Waiter]]) -> int:
    return sum(1 for t in tasks if t.done())


def cancel(*groups: list[asyncio.Task[Waiter]]) -> None:
    for tasks in groups:
        for t in tasks:
            t.cancel()


def test_a_tenant_with_many_long_requests_leaves_the_reserve_to_the_next_tenant() -> None:
    """16 slots (2 kept by default): one tenant's 40 requests take 14; another tenant's
    request starts at once, and so does its second; its third (it holds 2, the reserve)
    waits like the first tenant's. With no reserve the first tenant would hold all 16
    and 4 more waiting in the engine, and the second would wait for one of them to end."""
    async def main() -> None:
        dispatcher, tenants = setup(max_num_seqs=16, max_engine_waiting=4)
        engine = dispatcher.engines[0]
        assert engine.reserve == 2
        heavy = await burst(dispatcher, tenants, "heavy", 40)
        assert granted(heavy) == 14 and engine.inflight == 14
        light = await burst(dispatcher, tenants, "light", 3)
        assert granted(light) == 2 and engine.inflight == 16
        assert engine.by_tenant == {"heavy": 14, "light": 2}
        # The light tenant's request ends: its waiting third takes the slot, not the
        # first tenant's next (which holds 14, and 16 are in flight).
        dispatcher.release(await light[0])
        await asyncio.sleep(0)
        assert granted(light) == 3 and engine.by_tenant == {"heavy": 14, "light": 2}
        # One of the first tenant's ends: its slot is its own again (14 + 2 = 16).
        dispatcher.release(await heavy[0])
        await asyncio.sleep(0)
        assert engine.by_tenant == {"heavy": 14, "light": 2} and granted(heavy) == 15
        cancel(heavy, light)
    asyncio.run(main())


def test_the_reserve_idles_only_while_every_waiting_tenant_holds_it() -> None:
    """Two tenants that both hold the reserve's worth: the reserved slots stay free for a
    third (at most ``reserve`` slots idle), which then gets one at once."""
    async def main() -> None:
        dispatcher, tenants = setup(max_num_seqs=16, max_engine_waiting=4)
        engine = dispatcher.engines[0]
        heavy = await burst(dispatcher, tenants, "heavy", 12)
        light = await burst(dispatcher, tenants, "light", 6)
        assert engine.by_tenant == {"heavy": 12, "light": 2} and engine.inflight == 14
        other = await burst(dispatcher, tenants, "other", 1)
        assert granted(other) == 1 and engine.inflight == 15
        cancel(heavy, light, other)
    asyncio.run(main())


def test_no_reserve_lets_one_tenant_take_every_slot() -> None:
    """``reserved_slots: 0`` (the gate's limit alone: capacity + max_engine_waiting)."""
    async def main() -> None:
        dispatcher, tenants = setup(max_num_seqs=16, max_engine_waiting=4, reserved_slots=0)
        heavy = await burst(dispatcher, tenants, "heavy", 40)
        assert granted(heavy) == 20
        light = await burst(dispatcher, tenants, "light", 1)
        assert granted(light) == 0
        cancel(heavy, light)
    asyncio.run(main())


@pytest.mark.parametrize(("engine", "reserve"), [
    ({"max_num_seqs": 16}, 2),
    ({"max_num_seqs": 256, "max_inflight": 512}, 32),
    ({"max_num_seqs": 7}, 0),  # an eighth of fewer than 8 slots: none
    ({}, 8),  # capacity not known yet: max_inflight (64) counts
    ({"max_num_seqs": 16, "reserved_slots": 5}, 5),
    ({"max_num_seqs": 4, "reserved_slots": 9}, 3),  # one slot always left to anyone
    ({"max_num_seqs": 1, "reserved_slots": 1}, 0),
    ({"max_num_seqs": 16, "max_inflight": 8}, 1),  # max_inflight below the capacity
])
def test_the_reserve_is_an_eighth_of_the_slots_unless_set(engine: dict[str, Any],
                                                          reserve: int) -> None:
    dispatcher, _ = setup(**engine)
    assert dispatcher.engines[0].reserve == reserve


def test_a_learned_capacity_sets_the_reserve() -> None:
    dispatcher, _ = setup()
    engine = dispatcher.engines[0]
    assert engine.reserve == 8
    engine.record_reading(16.0, 3.0, 0.1)
    engine.record_reading(16.0, 3.0, 0.1)  # waiting beside the same running count twice
    assert engine.capacity == 16 and engine.reserve == 2


def test_a_paced_tenant_spills_to_its_next_engine_before_the_reserve() -> None:
    """A paced tenant fills its first engine up to the reserve, then the next."""
    async def main() -> None:
        dispatcher, tenants = setup(
            engines=[{"url": f"http://127.0.0.1:{p}", "models": ["m"], "max_num_seqs": 8,
                      "api_key": "sk-engine"} for p in (1, 2)],
            tenants=[{"id": "heavy", "api_keys": ["kh"], "output_tokens_per_second": 50}])
        first = dispatcher.engine_for("heavy", dispatcher.pools["m"])
        heavy = await burst(dispatcher, tenants, "heavy", 10)
        assert granted(heavy) == 10
        assert first.inflight == 7 and sum(e.inflight for e in dispatcher.engines) == 10
        cancel(heavy)
    asyncio.run(main())


def test_batch_lines_leave_the_reserve_or_the_headroom_whichever_is_larger() -> None:
    dispatcher, _ = setup(max_num_seqs=32, max_engine_waiting=4)
    pool = dispatcher.pools["m"]
    dispatcher.fleet.set_load(dispatcher.engines[0], 0.0, 0.0, running=0.0)
    assert dispatcher.spare(pool, 1) == 28  # the reserve: 4
    assert dispatcher.spare(pool, 6) == 26


def test_released_slots_leave_no_entry_behind() -> None:
    """Many tenants, one request each, all ended: the per-tenant counts are empty (their
    memory is bounded by the requests in flight, not the tenants ever seen)."""
    async def main() -> None:
        tenants_cfg = [{"id": f"t{i}", "api_keys": [f"k{i}"]} for i in range(50)]
        dispatcher, tenants = setup(tenants=tenants_cfg, max_num_seqs=64, max_inflight=64)
        engine = dispatcher.engines[0]
        tasks = [t for i in range(50) for t in await burst(dispatcher, tenants, f"t{i}", 1)]
        assert len(engine.by_tenant) == 50
        for task in tasks:
            dispatcher.release(await task)
        assert engine.by_tenant == {} and engine.inflight == 0
    asyncio.run(main())


@pytest.mark.parametrize("value", [-1, "2", True, 1.5])
def test_a_bad_reserved_slots_names_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match=r"engines\[0\]\.reserved_slots"):
        setup(reserved_slots=value)
