"""Engines that fail, in process: a refused connection takes an engine out of
dispatch at once (but not a pool's last engine on one refusal), the request goes back first
in its tenant's order without a second charge, a restarted engine is probed soon and is not
held back by a reading from before it died. The real Dispatcher and FairQueue, a fake clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenpace.fairness import FairQueue, LaneSpec
from tokenpace.gateway import parse_config
from tokenpace.gateway.dispatch import Dispatcher
from tokenpace.gateway.fleet import (
    EJECT_LAST_AFTER,
    HEALTH_INTERVAL_S,
    PROBE_FIRST_S,
    ProbeSchedule,
)
from tokenpace.gateway.tenants import Tenants

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(urls: list[str] = URLS, **engine: Any) -> tuple[Dispatcher, Tenants, Clock]:
    clock = Clock()
    config = parse_config({
        "engines": [{"url": u, "max_inflight": 4, "models": ["chat"], **engine} for u in urls],
        "tenants": [{"id": "a", "api_keys": ["ka"]}, {"id": "b", "api_keys": ["kb"]}],
        "ledger": "sqlite:///unused.db",
    })
    return Dispatcher(config, clock), Tenants(config, clock), clock


# -- the fair queue: a request sent back goes first --------------------------------------


def test_an_item_pushed_ahead_goes_before_its_tenants_waiting_items() -> None:
    queue: FairQueue[str] = FairQueue([LaneSpec("default")], lambda: 0.0, 60.0)
    queue.set_tenant("a", "default", 1.0)
    for item in ("a1", "a2"):
        queue.push(item, "a", 1.0, 1.0)
    assert queue.pop() == "a1"
    queue.push("a0", "a", 0.0, 0.0, ahead=True)  # a1's engine refused it: back, as "a0"
    assert [queue.pop(), queue.pop()] == ["a0", "a2"]


def test_an_item_pushed_ahead_is_first_come_before_fresh_items_of_other_tenants() -> None:
    queue: FairQueue[str] = FairQueue([LaneSpec("default")], lambda: 0.0, 60.0, fair=False)
    for tenant in ("a", "b"):
        queue.set_tenant(tenant, "default", 1.0)
    queue.push("b1", "b", 1.0, 1.0)
    queue.push("a-again", "a", 0.0, 0.0, ahead=True)
    queue.push("a-again-2", "a", 0.0, 0.0, ahead=True)
    assert [queue.pop(), queue.pop(), queue.pop()] == ["a-again", "a-again-2", "b1"]


def test_an_item_pushed_ahead_with_no_cost_leaves_the_counters_as_they_were() -> None:
    queue: FairQueue[str] = FairQueue([LaneSpec("default")], lambda: 0.0, 60.0)
    queue.set_tenant("a", "default", 1.0)
    queue.push("a1", "a", 5.0, 9.0)
    queue.pop()
    before = queue.counter("a")
    queue.push("a1", "a", 0.0, 0.0, ahead=True)
    queue.pop()
    assert queue.counter("a") == before == 5.0


# -- passive health: a refused connection ------------------------------------------------


def test_a_refusal_takes_an_engine_out_of_dispatch_at_once() -> None:
    dispatcher, _, clock = setup()
    dead, live = dispatcher.pools["chat"].engines
    assert dispatcher.fleet.connect_failed(dead) is True
    assert (dead.healthy, dead.down_since, live.healthy) == (False, clock.now, True)
    assert dispatcher.fleet.connect_failed(dead) is True  # out already: still out


def test_the_last_engine_up_of_a_pool_stays_in_after_one_refusal() -> None:
    """A network blip must not empty a pool: its last engine goes out on the second
    refusal in a row; a request that reaches it in between resets the count."""
    dispatcher, _, _ = setup()
    first, last = dispatcher.pools["chat"].engines
    dispatcher.fleet.connect_failed(first)
    assert dispatcher.fleet.connect_failed(last) is False and last.healthy
    last.connect_ok()
    assert dispatcher.fleet.connect_failed(last) is False and last.healthy
    for _ in range(EJECT_LAST_AFTER - 1):
        out = dispatcher.fleet.connect_failed(last)
    assert out is True and not last.healthy


def test_a_lone_engine_is_the_last_of_its_pool() -> None:
    dispatcher, _, _ = setup(urls=URLS[:1])
    engine = dispatcher.pools["chat"].engines[0]
    assert dispatcher.fleet.connect_failed(engine) is False
    assert dispatcher.fleet.connect_failed(engine) is True


def test_requests_waiting_for_a_slot_go_to_the_engine_still_up() -> None:
    async def main() -> None:
        dispatcher, tenants, _ = setup()
        pool = dispatcher.pools["chat"]
        dead, live = pool.engines
        dispatcher.fleet.connect_failed(dead)
        waiters = [await dispatcher.acquire(tenants.get("a"), pool, 1.0, 1.0, 1.0)
                   for _ in range(4)]
        assert {w.engine.url for w in waiters} == {live.url}
        assert (dead.inflight, live.inflight) == (0, 4)
    asyncio.run(main())


def test_a_lease_sent_back_moves_to_another_engine_and_charges_nothing_more() -> None:
    async def main() -> None:
        dispatcher, tenants, _ = setup()
        pool = dispatcher.pools["chat"]
        tenant = tenants.get("a")
        lease = await dispatcher.lease(tenant, pool, 1.0, 3.0, 3.0).acquire()
        first = lease.engine
        counter = pool.queue.counter("a")
        dispatcher.fleet.connect_failed(first)
        await lease.again()
        assert lease.engine is not first and lease.engine.healthy
        assert (first.inflight, lease.engine.inflight, tenant.inflight) == (0, 1, 1)
        assert pool.queue.counter("a") == counter
        lease.release()
        assert (lease.engine.inflight, tenant.inflight, tenant.queued) == (0, 0, 0)
    asyncio.run(main())


def test_a_lease_sent_back_is_not_held_to_max_queued() -> None:
    """It was admitted: a full queue of its tenant does not refuse it on its way back."""
    async def main() -> None:
        clock = Clock()
        config = parse_config({
            "engines": [{"url": u, "max_inflight": 1, "models": ["chat"]} for u in URLS],
            "tenants": [{"id": "a", "api_keys": ["ka"], "max_queued": 1}],
            "ledger": "sqlite:///unused.db"})
        dispatcher, tenants = Dispatcher(config, clock), Tenants(config, clock)
        pool, tenant = dispatcher.pools["chat"], tenants.get("a")
        held = await dispatcher.lease(tenant, pool, 5.0, 1.0, 1.0).acquire()
        lease = await dispatcher.lease(tenant, pool, 5.0, 1.0, 1.0).acquire()
        queued = asyncio.ensure_future(dispatcher.acquire(tenant, pool, 5.0, 1.0, 1.0))
        await asyncio.sleep(0)
        assert tenant.queued == 1  # the queue is full
        dispatcher.fleet.connect_failed(lease.engine)
        again = asyncio.ensure_future(lease.again())
        await asyncio.sleep(0)
        assert not again.done()  # waiting (first in line), not refused
        held.release()
        await asyncio.sleep(0)
        assert again.done() and again.result() is lease and not queued.done()
        queued.cancel()
        lease.release()
    asyncio.run(main())


# -- coming back: probed soon, not held by an old reading --------------------------------


def test_a_restarted_engine_is_not_held_back_by_a_reading_from_before_it_died() -> None:
    """A full engine's last gauges (requests waiting) must not close the gate on it once
    it is back empty: going down forgets them."""
    dispatcher, _, _ = setup(max_engine_waiting=0)
    engine = dispatcher.pools["chat"].engines[0]
    dispatcher.fleet.set_load(engine, waiting=12.0, kv_usage=0.5, running=4.0)
    assert engine.saturated()
    dispatcher.fleet.set_health(engine, False)
    dispatcher.fleet.set_health(engine, True)
    assert not engine.saturated() and engine.has_room()
    assert engine.held.is_set()  # its gauges are read again at once


def test_an_engine_back_up_starts_a_new_run_of_refusals() -> None:
    dispatcher, _, _ = setup(urls=URLS[:1])
    engine = dispatcher.pools["chat"].engines[0]
    dispatcher.fleet.connect_failed(engine)
    dispatcher.fleet.connect_failed(engine)
    dispatcher.fleet.set_health(engine, True)
    assert engine.connect_failures == 0 and dispatcher.fleet.connect_failed(engine) is False


def test_an_engine_taken_out_is_probed_soon_then_less_often_up_to_the_interval() -> None:
    schedule = ProbeSchedule()
    url = URLS[0]
    assert schedule.due(url, True, None, 0.0)
    schedule.checked(url, True, 0.0)
    assert not schedule.due(url, True, None, 1.0)
    # Taken out at t=1.0 by a refusal: first probe 0.25 s later, whatever the interval.
    assert not schedule.due(url, False, 1.0, 1.1)
    assert schedule.due(url, False, 1.0, 1.0 + PROBE_FIRST_S)
    probes = []
    for ms in range(1250, 12_000, 10):  # every 10 ms from the first probe on
        now = ms / 1000
        if schedule.due(url, False, 1.0, now):
            probes.append(ms)
            schedule.checked(url, False, now)
    gaps = [(b - a) / 1000 for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == [0.25, 0.5, 1.0]
    assert set(gaps[3:]) == {HEALTH_INTERVAL_S}  # never longer: back within one interval
    schedule.checked(url, True, 12.0)
    assert not schedule.due(url, True, None, 12.0 + HEALTH_INTERVAL_S - 0.01)
    assert schedule.due(url, True, None, 12.0 + HEALTH_INTERVAL_S)


def test_the_health_loop_sleeps_at_most_the_first_probe_delay() -> None:
    schedule = ProbeSchedule()
    schedule.checked(URLS[0], True, 0.0)
    assert schedule.sleep_s(0.0) == PROBE_FIRST_S  # nothing due for 2 s: wake to look anyway
    assert schedule.sleep_s(1.9) == pytest.approx(0.1)
    assert schedule.sleep_s(2.5) == 0.0


# -- drain: no new dispatches, what runs finishes ----------------------------------------


def test_a_drained_engine_takes_no_new_request_and_its_running_ones_finish() -> None:
    async def main() -> None:
        dispatcher, tenants, _ = setup()
        pool = dispatcher.pools["chat"]
        tenant = tenants.get("a")
        running = [await dispatcher.acquire(tenant, pool, 1.0, 1.0, 1.0) for _ in range(8)]
        drained = running[0].engine
        dispatcher.fleet.set_draining(drained, True)
        assert drained.inflight == 4 and not drained.accepts and drained.healthy
        for waiter in running:
            dispatcher.release(waiter)  # every request finishes, the drained engine's too
        later = [await dispatcher.acquire(tenant, pool, 1.0, 1.0, 1.0) for _ in range(4)]
        assert drained.inflight == 0 and all(w.engine is not drained for w in later)
        for waiter in later:
            dispatcher.release(waiter)
        dispatcher.fleet.set_draining(drained, False)
        assert (await dispatcher.acquire(tenant, pool, 1.0, 1.0, 1.0)).engine is drained
    asyncio.run(main())


def test_a_tenant_pinned_to_a_drained_engine_moves_at_once() -> None:
    dispatcher, tenants, _ = setup(urls=URLS)
    pool = dispatcher.pools["chat"]
    first = dispatcher.engine_for("a", pool)
    dispatcher.fleet.set_draining(first, True)
    assert dispatcher.engine_for("a", pool) is not first
    dispatcher.fleet.set_draining(first, False)
    assert dispatcher.engine_for("a", pool) is first


def test_a_reload_applies_each_engines_drain_flag() -> None:
    dispatcher, _, _ = setup()
    config = parse_config({
        "engines": [{"url": URLS[0], "max_inflight": 4, "models": ["chat"], "drain": True},
                    {"url": URLS[1], "max_inflight": 4, "models": ["chat"]}],
        "tenants": [{"id": "a", "api_keys": ["ka"]}], "ledger": "sqlite:///unused.db"})
    engines = list(dispatcher.engines)
    assert dispatcher.fleet.set_engines(config.engines) == ([], [])  # drain is no engine change
    dispatcher.configure(config)  # as a reload does: the engines, then the rest
    assert dispatcher.engines == engines
    assert [e.draining for e in dispatcher.engines] == [True, False]
    undrained = parse_config({
        "engines": [{"url": u, "max_inflight": 4, "models": ["chat"]} for u in URLS],
        "tenants": [{"id": "a", "api_keys": ["ka"]}], "ledger": "sqlite:///unused.db"})
    dispatcher.fleet.set_engines(undrained.engines)
    dispatcher.configure(undrained)
    assert [e.draining for e in dispatcher.engines] == [False, False]


def test_a_drained_engine_does_not_count_as_up_for_the_last_engine_rule() -> None:
    """With the other engine drained, the one left is the last in dispatch: one refusal
    does not empty the pool."""
    dispatcher, _, _ = setup()
    drained, last = dispatcher.pools["chat"].engines
    dispatcher.fleet.set_draining(drained, True)
    assert dispatcher.fleet.connect_failed(last) is False


# -- an engine shutting down: drained until it is gone ------------------------------------


def test_an_engine_shutting_down_is_drained_not_failed_until_it_goes_down() -> None:
    dispatcher, _, clock = setup()
    stopping, other = dispatcher.pools["chat"].engines
    assert dispatcher.fleet.set_stopping(stopping) is True
    assert dispatcher.fleet.set_stopping(stopping) is False  # said once
    assert not stopping.accepts and stopping.drained and stopping.healthy
    assert stopping.connect_failures == 0  # not a failure
    for tenant in ("a", "b"):  # a tenant pinned to it moves at once, as for a drain
        assert dispatcher.engine_for(tenant, dispatcher.pools["chat"]) is other
    # Neither an operator's undrain nor a reload's configuration brings it back ...
    dispatcher.fleet.set_draining(stopping, False)
    dispatcher.configure(dispatcher._config)
    assert not stopping.accepts
    # ... it is the engine going down that ends it; it comes back as any restarted engine.
    clock.now += 3
    dispatcher.fleet.set_health(stopping, False)
    assert stopping.stopping_since is None and not stopping.drained
    dispatcher.fleet.set_health(stopping, True)
    assert stopping.accepts and other.accepts


def test_what_an_engine_answers_when_it_did_not_take_a_request() -> None:
    from tokenpace.gateway.relay import not_taken

    shutdown = (b'{"error":{"message":"cannot schedule new futures after shutdown",'
                b'"type":"InternalServerError","param":null,"code":500}}')
    assert not_taken(500, shutdown) == (True, True)  # vLLM 0.32 on SIGTERM
    assert not_taken(503, b"") == (True, False)  # queue limits, elastic EP: brief
    assert not_taken(500, b'{"error": {"message": "CUDA error"}}') == (False, False)
    assert not_taken(200, shutdown) == (False, False)
    assert not_taken(400, shutdown) == (False, False)
