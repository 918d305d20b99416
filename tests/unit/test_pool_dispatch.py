"""Model pools on the real in-process Dispatcher: one fair queue per model over
its engines, the engine chosen at dispatch by load with the tenant's rendezvous engine as a
soft preference, paced tenants and ``routing: pinned`` on one engine, pools learned."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenpace.gateway import parse_config
from tokenpace.gateway.dispatch import Dispatcher, Waiter
from tokenpace.gateway.tenants import Tenants

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def setup(tenants: list[dict[str, Any]] | None = None, max_inflight: int = 4,
          key: str | None = "sk-engine", **top: Any) -> tuple[Dispatcher, Tenants]:
    locked = {"api_key": key} if key else {}
    config = parse_config({
        "engines": [{"url": u, "max_inflight": max_inflight, "models": ["chat"], **locked}
                    for u in URLS]
        + [{"url": "http://127.0.0.1:3", "max_inflight": max_inflight, "models": ["code"],
            **locked}],
        "tenants": tenants or [{"id": "a", "api_keys": ["ka"]}, {"id": "b", "api_keys": ["kb"]}],
        "ledger": "sqlite:///unused.db", **top,
    })
    clock = lambda: 0.0  # noqa: E731
    return Dispatcher(config, clock), Tenants(config, clock)


def grab(dispatcher: Dispatcher, tenants: Tenants, tenant: str, n: int,
         model: str = "chat") -> list[asyncio.Task[Waiter]]:
    pool = dispatcher.pools[model]
    return [asyncio.ensure_future(dispatcher.acquire(tenants.get(tenant), pool, 60.0, 1.0, 1.0))
            for _ in range(n)]


def test_pools_are_the_engines_of_each_model() -> None:
    dispatcher, _ = setup()
    assert [e.url for e in dispatcher.pools["chat"].engines] == URLS
    assert [e.url for e in dispatcher.pools["code"].engines] == ["http://127.0.0.1:3"]
    assert dispatcher.served_models() == ["chat", "code"]
    assert dispatcher.pool_for("gpt-4o") is None


def test_a_lone_tenant_uses_every_engine_of_its_pool() -> None:
    """Pinning kept a tenant on one engine: with 8 slots in the pool it got 4."""
    async def main() -> None:
        dispatcher, tenants = setup()
        tasks = grab(dispatcher, tenants, "a", 10)
        await asyncio.sleep(0)
        assert sum(t.done() for t in tasks) == 8
        assert [e.inflight for e in dispatcher.pools["chat"].engines] == [4, 4]
        dispatcher.release(tasks[0].result())  # a freed slot goes to the next waiter at once
        await asyncio.sleep(0)
        assert sum(t.done() for t in tasks) == 9
        for t in tasks:
            t.cancel()
    asyncio.run(main())


def test_affinity_holds_until_the_preferred_engine_is_pool_affinity_ahead() -> None:
    async def main() -> None:
        dispatcher, tenants = setup(max_inflight=16, pool_affinity=2)
        pool = dispatcher.pools["chat"]
        first = dispatcher.preferred(tenants.get("a"), pool)
        assert first is not None
        tasks = grab(dispatcher, tenants, "a", 6)
        await asyncio.sleep(0)
        # Its own engine takes a request while it is at most 2 ahead of the other: the
        # first three (0, 1, 2 ahead), then one each way: 4 against 2.
        other = next(e for e in pool.engines if e is not first)
        assert (first.inflight, other.inflight) == (4, 2)
        for t in tasks:
            t.cancel()
    asyncio.run(main())


def test_zero_affinity_is_least_loaded() -> None:
    async def main() -> None:
        dispatcher, tenants = setup(max_inflight=16, pool_affinity=0)
        tasks = grab(dispatcher, tenants, "a", 6)
        await asyncio.sleep(0)
        assert [e.inflight for e in dispatcher.pools["chat"].engines] == [3, 3]
        for t in tasks:
            t.cancel()
    asyncio.run(main())


def test_pinned_routing_keeps_each_tenant_on_one_engine() -> None:
    async def main() -> None:
        dispatcher, tenants = setup([{"id": "a", "api_keys": ["ka"]}], routing="pinned")
        tasks = grab(dispatcher, tenants, "a", 6)
        await asyncio.sleep(0)
        assert sum(t.done() for t in tasks) == 4
        assert sorted(e.inflight for e in dispatcher.pools["chat"].engines) == [0, 4]
        for t in tasks:
            t.cancel()
    asyncio.run(main())


def test_a_paced_tenant_fills_its_first_engine_then_spills_over() -> None:
    """Its rate is split over the engines its streams run on (``_rate_split``): it takes
    a second engine only when the first is full, and comes back to the first one."""
    async def main() -> None:
        dispatcher, tenants = setup([{"id": "a", "api_keys": ["ka"],
                                      "output_tokens_per_second": 50}])
        first = dispatcher.engine_for("a", dispatcher.pools["chat"])
        tasks = grab(dispatcher, tenants, "a", 3)
        await asyncio.sleep(0)
        assert first.inflight == 3 and sum(e.inflight for e in dispatcher.engines) == 3
        more = grab(dispatcher, tenants, "a", 3)
        await asyncio.sleep(0)
        assert sorted(e.inflight for e in dispatcher.pools["chat"].engines) == [2, 4]
        assert first.inflight == 4
        for t in tasks + more:
            t.cancel()
    asyncio.run(main())


def test_without_engine_keys_a_paced_tenant_keeps_its_first_engine() -> None:
    """The shares are moved by a control call that needs each engine's key: without keys a
    paced tenant stays on one engine, paced there at its whole rate (as before pools)."""
    async def main() -> None:
        dispatcher, tenants = setup([{"id": "a", "api_keys": ["ka"],
                                      "output_tokens_per_second": 50}], key=None)
        assert not dispatcher.splits_rates and dispatcher.pinned(tenants.get("a"))
        tasks = grab(dispatcher, tenants, "a", 6)
        await asyncio.sleep(0)
        assert sorted(e.inflight for e in dispatcher.pools["chat"].engines) == [0, 4]
        for t in tasks:
            t.cancel()
    asyncio.run(main())


def test_two_backlogged_tenants_share_the_pool_by_weight() -> None:
    """One VTC queue over both engines: equal weights get alternate slots as slots free,
    whichever engine frees them."""
    async def main() -> None:
        dispatcher, tenants = setup(max_inflight=1)
        held = grab(dispatcher, tenants, "a", 2)  # both engines busy with a's requests
        await asyncio.sleep(0)
        waiting_a = grab(dispatcher, tenants, "a", 20)
        waiting_b = grab(dispatcher, tenants, "b", 20)
        await asyncio.sleep(0)
        running = [t.result() for t in held]
        served = {"a": 0, "b": 0}
        for _ in range(20):
            done = running.pop(0)
            dispatcher.charge(done, 10.0)
            dispatcher.release(done)
            await asyncio.sleep(0)
            for t in waiting_a + waiting_b:
                if t.done() and not t.cancelled() and t.result() not in running \
                        and not t.result().released:
                    running.append(t.result())
                    served[t.result().tenant.id] += 1
        assert abs(served["a"] - served["b"]) <= 2, served
        for t in held + waiting_a + waiting_b:
            t.cancel()
    asyncio.run(main())


def test_a_down_engine_is_skipped_and_a_pool_with_none_up_cannot_wait() -> None:
    dispatcher, tenants = setup()
    pool = dispatcher.pools["chat"]
    a = tenants.get("a")
    assert a is not None
    preferred = dispatcher.preferred(a, pool)
    assert preferred is not None
    dispatcher.fleet.set_health(preferred, False)
    other = dispatcher.preferred(a, pool)
    assert other is not None and other is not preferred
    assert dispatcher.choose(a, pool) is other
    dispatcher.fleet.set_health(other, False)
    assert not dispatcher.may_wait(a, pool) and dispatcher.choose(a, pool) is None


def test_learned_models_move_an_engine_between_pools() -> None:
    async def main() -> None:
        config = parse_config({"engines": URLS, "tenants": [{"id": "a", "api_keys": ["ka"]}],
                               "ledger": "sqlite:///unused.db"})
        clock = lambda: 0.0  # noqa: E731
        dispatcher, tenants = Dispatcher(config, clock), Tenants(config, clock)
        assert dispatcher.served_models() == [] and len(dispatcher.fleet.unlearned()) == 2
        first, second = dispatcher.engines
        assert dispatcher.fleet.set_models(first, frozenset({"chat"}))
        assert not dispatcher.fleet.set_models(first, frozenset({"chat"}))  # unchanged
        waiting = grab(dispatcher, tenants, "a", 1, model="chat")
        await asyncio.sleep(0)
        assert waiting[0].done() and waiting[0].result().engine is first
        # The second engine comes up serving another model, then is restarted with chat.
        dispatcher.fleet.set_models(second, frozenset({"code"}))
        assert dispatcher.served_models() == ["chat", "code"]
        dispatcher.fleet.set_models(second, frozenset({"chat"}))
        assert dispatcher.pool_for("code") is None
        assert [e.url for e in dispatcher.pools["chat"].engines] == URLS
        assert dispatcher.fleet.unlearned() == []
    asyncio.run(main())
