"""The engine-saturation gate: a reading of the engine's gauges projected forward with
what the gateway itself dispatched since, on the real Dispatcher."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenpace.gateway import parse_config
from tokenpace.gateway.dispatch import Dispatcher
from tokenpace.gateway.tenants import Tenants


def setup(**engine: Any) -> tuple[Dispatcher, Any]:
    """One engine and one tenant, with no slots reserved for other tenants (the gate alone:
    tests/unit/test_reserved_slots.py has the reserve)."""
    config = parse_config({
        "engines": [{"url": "http://127.0.0.1:1", "max_inflight": 64, "models": ["m"],
                     "reserved_slots": 0, **engine}],
        "tenants": [{"id": "t", "api_keys": ["k"]}],
        "ledger": "sqlite:///unused.db",
    })
    clock = lambda: 0.0  # noqa: E731  (the gate does not read the clock)
    tenants = Tenants(config, clock)
    return Dispatcher(config, clock), tenants.get("t")


async def burst(dispatcher: Dispatcher, tenant: Any, n: int) -> list[asyncio.Task[Any]]:
    pool = dispatcher.pools["m"]
    tasks = [asyncio.create_task(dispatcher.acquire(tenant, pool, 60.0, 1.0, 1.0)) for _ in range(n)]
    await asyncio.sleep(0)
    return tasks


def granted(tasks: list[asyncio.Task[Any]]) -> int:
    return sum(1 for t in tasks if t.done())


def test_a_reading_that_shows_the_gateways_own_burst_does_not_close_the_gate() -> None:
    async def main() -> None:
        dispatcher, tenant = setup()
        engine = dispatcher.engines[0]
        dispatcher.fleet.set_load(engine, 0.0, 0.0, running=0.0)
        first = await burst(dispatcher, tenant, 16)
        assert granted(first) == 16
        # The poll lands before the engine's next step: all 16 still "waiting" in it.
        dispatcher.fleet.set_load(engine, 16.0, 0.01, running=16.0)
        second = await burst(dispatcher, tenant, 16)
        assert granted(second) == 16  # the old gate held these until a later poll
        for t in first + second:
            t.cancel()
    asyncio.run(main())


def test_with_a_known_capacity_a_larger_burst_waits_in_the_gateway() -> None:
    async def main() -> None:
        dispatcher, tenant = setup(max_num_seqs=8, max_engine_waiting=4)
        engine = dispatcher.engines[0]
        dispatcher.fleet.set_load(engine, 0.0, 0.0, running=0.0)
        tasks = await burst(dispatcher, tenant, 32)
        assert granted(tasks) == 8 + 4  # capacity + what may wait in the engine
        assert engine.inflight == 12 and engine.waiting() == 20
        dispatcher.fleet.set_load(engine, 4.0, 0.2, running=8.0)  # the engine holds our 12
        dispatcher.release(await tasks[0])
        assert engine.inflight == 12  # the freed slot went to the next one in the queue
        # Another client now has 3 more requests waiting in the engine: 7 > 4 wait there.
        dispatcher.fleet.set_load(engine, 4.0 + 3, 0.2, running=8.0)
        dispatcher.release(await tasks[1])
        assert engine.inflight == 11  # the gate holds
        for t in tasks:
            t.cancel()
    asyncio.run(main())


def test_capacity_is_learned_from_requests_waiting_across_two_readings() -> None:
    async def main() -> None:
        dispatcher, tenant = setup(max_engine_waiting=2)
        engine = dispatcher.engines[0]
        tasks = await burst(dispatcher, tenant, 20)
        assert granted(tasks) == 20  # capacity unknown: nothing holds a first burst
        dispatcher.fleet.set_load(engine, 12.0, 0.1, running=8.0)  # just after the burst
        assert engine.capacity is None
        dispatcher.fleet.set_load(engine, 12.0, 0.1, running=8.0)  # still so, one poll later
        assert engine.capacity == 8
        more = await burst(dispatcher, tenant, 4)
        assert granted(more) == 0  # 20 in flight on an engine that runs 8
        for t in tasks + more:
            t.cancel()
    asyncio.run(main())


def test_waiting_the_gateway_did_not_cause_holds_requests() -> None:
    """Without a running count (or capacity), another client's queue in the engine still
    closes the gate; the gateway's own fresh dispatches do not."""
    async def main() -> None:
        dispatcher, tenant = setup(max_engine_waiting=4)
        engine = dispatcher.engines[0]
        dispatcher.fleet.set_load(engine, 9.0, None)
        held = await burst(dispatcher, tenant, 1)
        assert granted(held) == 0
        dispatcher.fleet.set_load(engine, 0.0, None)
        await asyncio.sleep(0)
        assert granted(held) == 1
        tasks = await burst(dispatcher, tenant, 10)
        dispatcher.fleet.set_load(engine, 10.0, None)  # the 11 just dispatched, not yet scheduled
        more = await burst(dispatcher, tenant, 1)
        assert granted(more) == 1
        dispatcher.fleet.set_load(engine, 10.0, None)  # ... still waiting a poll later: real
        last = await burst(dispatcher, tenant, 1)
        assert granted(last) == 0
        for t in held + tasks + more + last:
            t.cancel()
    asyncio.run(main())


def test_a_full_kv_cache_holds_requests() -> None:
    async def main() -> None:
        dispatcher, tenant = setup(max_kv_cache_usage=0.9)
        engine = dispatcher.engines[0]
        dispatcher.fleet.set_load(engine, 0.0, 0.95, running=3.0)
        tasks = await burst(dispatcher, tenant, 2)
        assert granted(tasks) == 0
        dispatcher.fleet.set_load(engine, 0.0, 0.5, running=3.0)
        await asyncio.sleep(0)
        assert granted(tasks) == 2
    asyncio.run(main())


def test_a_stale_running_gauge_of_an_idle_engine_does_not_hold_a_burst() -> None:
    """vLLM's gauges keep the values of the engine's last step while it is idle: a reading
    of 32 running after the last burst ended must not count as load."""
    async def main() -> None:
        dispatcher, tenant = setup(max_num_seqs=32, max_engine_waiting=4)
        engine = dispatcher.engines[0]
        dispatcher.fleet.set_load(engine, 0.0, 0.1, running=32.0)
        tasks = await burst(dispatcher, tenant, 40)
        assert granted(tasks) == 36
        for t in tasks:
            t.cancel()
    asyncio.run(main())


def test_a_gate_closed_on_an_old_reading_reads_again_at_once() -> None:
    from tokenpace.gateway.fleet import LOAD_SOON_S, reread_delay

    # closed 0.4 s after the reading (taken under load that has since ended): at once
    assert reread_delay(10.0, 10.4) == 0.0
    assert reread_delay(10.0, 10.0 + LOAD_SOON_S) == 0.0
    # closed 5 ms after it: what the engine's next step admits is left time to show
    assert abs(reread_delay(10.0, 10.005) - (LOAD_SOON_S - 0.005)) < 1e-12
    # no reading yet
    assert reread_delay(float("-inf"), 3.0) == 0.0


def test_batch_lines_count_on_the_engines_capacity_not_its_max_inflight() -> None:
    """An engine whose lanes hold batch lines for live requests: max_inflight 32 above its
    capacity of 16. Batch lines take at most 16 - keep; live requests may go past them."""
    async def main() -> None:
        dispatcher, tenant = setup(max_inflight=32, max_num_seqs=16, max_engine_waiting=8)
        pool = dispatcher.pools["m"]
        engine = dispatcher.engines[0]
        dispatcher.fleet.set_load(engine, 0.0, 0.0, running=0.0)
        assert dispatcher.spare(pool, 1) == 15
        tasks = await burst(dispatcher, tenant, 15)  # the batch lines
        assert dispatcher.spare(pool, 1) == 0
        live = await burst(dispatcher, tenant, 4)
        assert granted(live) == 4  # past the batch: capacity + max_engine_waiting allows it
        for t in tasks + live:
            t.cancel()
        plain, _ = setup(max_inflight=32)  # capacity unknown: max_inflight counts
        assert plain.spare(plain.pools["m"], 1) == 31
    asyncio.run(main())
