"""Per-tenant caches on the request path (issue 13): bound Prometheus children and the
rendezvous ranking. Each must give what the uncached call gave, and forget a tenant that a
reload removed."""

from __future__ import annotations

from typing import Any

from tokenpace.gateway import _metrics as metrics
from tokenpace.gateway import parse_config
from tokenpace.gateway._dispatch import Dispatcher, _score


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


def config(repin: str | None = None) -> Any:
    extra = {"repin_after": repin} if repin else {}
    return parse_config({
        "engines": [f"http://127.0.0.1:{p}" for p in (1, 2, 3, 4)],
        "tenants": [{"id": f"t{i}", "api_keys": [f"k{i}"]} for i in range(20)],
        "ledger": "sqlite:///unused.db", **extra,
    })


def test_cached_routing_is_the_rendezvous_choice_and_follows_health() -> None:
    now = [0.0]
    dispatcher = Dispatcher(config("10s"), lambda: now[0])
    for i in range(20):
        tenant = f"t{i}"
        best = max(dispatcher.engines, key=lambda e: _score(e.url, tenant))
        assert dispatcher.engine_for(tenant) is best
        assert dispatcher.engine_for(tenant) is best  # from the cache
    tenant = "t0"
    pinned = dispatcher.engine_for(tenant)
    dispatcher.set_health(pinned, False)
    assert dispatcher.engine_for(tenant) is pinned  # not down long enough to move
    now[0] = 11.0
    moved = dispatcher.engine_for(tenant)
    assert moved is not pinned and moved.healthy
    dispatcher.set_health(pinned, True)
    assert dispatcher.engine_for(tenant) is pinned
    dispatcher.configure(config())
    assert dispatcher._ranked == {}
