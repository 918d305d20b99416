"""Per-tenant caches on the request path: bound Prometheus children and the
rendezvous ranking. Each must give what the uncached call gave, and forget a tenant that a
reload removed. Routing itself is checked by what rendezvous hashing promises, through
``Dispatcher.engine_for``, not by recomputing the gateway's hash."""

from __future__ import annotations

from typing import Any

from tokenpace.gateway import metrics, parse_config
from tokenpace.gateway.dispatch import Dispatcher


def series(name: str, tenant: str) -> list[float]:
    return [s.value for f in metrics.REGISTRY.collect() for s in f.samples
            if s.name == name and s.labels.get("tenant") == tenant]


def test_a_bound_child_is_reused_and_a_removed_tenant_gets_a_live_one_back() -> None:
    first = metrics.child(metrics.REJECTIONS, "gone-tenant", "queue_full")
    assert metrics.child(metrics.REJECTIONS, "gone-tenant", "queue_full") is first
    first.inc()
    assert series("tokenpace_gateway_rejections_total", "gone-tenant") == [1.0]
    metrics.forget_tenant("gone-tenant")
    assert series("tokenpace_gateway_rejections_total", "gone-tenant") == []
    assert not [k for k in metrics._CHILDREN if "gone-tenant" in k[1]]
    # A stale child would count into a series nobody exports any more.
    again = metrics.child(metrics.REJECTIONS, "gone-tenant", "queue_full")
    assert again is not first
    again.inc()
    assert series("tokenpace_gateway_rejections_total", "gone-tenant") == [1.0]
    metrics.forget_tenant("gone-tenant")


TENANTS = [f"t{i}" for i in range(20)]


def config(repin: str | None = None, ports: tuple[int, ...] = (1, 2, 3, 4)) -> Any:
    extra = {"repin_after": repin} if repin else {}
    return parse_config({
        "engines": [f"http://127.0.0.1:{p}" for p in ports],
        "tenants": [{"id": t, "api_keys": [f"k-{t}"]} for t in TENANTS],
        "ledger": "sqlite:///unused.db", **extra,
    })


def routes(dispatcher: Dispatcher) -> dict[str, str]:
    return {t: dispatcher.engine_for(t).url for t in TENANTS}


def test_routing_is_rendezvous_hashing() -> None:
    """What rendezvous hashing promises: the tenants spread over the engines, and an added
    engine takes tenants from the others without moving any between the old ones."""
    before = routes(Dispatcher(config(), lambda: 0.0))
    assert len(set(before.values())) == 4
    after = routes(Dispatcher(config(ports=(1, 2, 3, 4, 5)), lambda: 0.0))
    moved = {t for t in TENANTS if after[t] != before[t]}
    assert moved and all(after[t] == "http://127.0.0.1:5" for t in moved)


def test_cached_routing_is_the_uncached_choice_and_follows_health() -> None:
    now = [0.0]
    dispatcher = Dispatcher(config("10s"), lambda: now[0])
    cached = routes(dispatcher)
    assert routes(dispatcher) == cached  # from the cache, every tenant's ranking filled
    for tenant in TENANTS:  # a new dispatcher's first answer is computed, not cached
        assert cached[tenant] == Dispatcher(config("10s"), lambda: now[0]).engine_for(tenant).url
    tenant = "t0"
    pinned = dispatcher.engine_for(tenant)
    dispatcher.fleet.set_health(pinned, False)
    assert dispatcher.engine_for(tenant) is pinned  # not down long enough to move
    now[0] = 11.0
    moved = dispatcher.engine_for(tenant)
    assert moved is not pinned and moved.healthy
    dispatcher.fleet.set_health(pinned, True)
    assert dispatcher.engine_for(tenant) is pinned
    dispatcher.configure(config())
    assert dispatcher._ranked == {}
