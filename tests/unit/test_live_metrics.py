"""Gauges read at scrape time: a budget's level is the bucket's level now, and a tenant a
reload removed has no series (issue 15.6); only active tenants have series (issue 28)."""

from __future__ import annotations

from typing import Any

from tokenpace.gateway import parse_config
from tokenpace.gateway import _metrics as metrics
from tokenpace.gateway._tenants import Tenants


def cfg(*tenants: dict[str, Any]) -> Any:
    return parse_config({"engines": ["http://127.0.0.1:1"], "ledger": "sqlite:///unused.db",
                         "tenants": list(tenants)})


def levels() -> dict[tuple[str, str], float]:
    out = {}
    for family in metrics._Page([g.family() for g in metrics.LIVE]).collect():
        for sample in family.samples:
            if sample.name == "tokenpace_gateway_budget_remaining_tokens":
                out[(sample.labels["tenant"], sample.labels["budget"])] = sample.value
    return out


def test_budget_level_is_read_when_scraped_and_removed_tenants_vanish() -> None:
    now = [0.0]
    a = {"id": "a", "api_keys": ["ka"], "budgets": [{"tokens": 300, "per": "1m"}]}
    b = {"id": "b", "api_keys": ["kb"], "budgets": [{"tokens": 100, "per": "10s"}]}
    tenants = Tenants(cfg(a, b), lambda: now[0])
    metrics.BUDGET_REMAINING.source = tenants.budget_samples
    try:
        assert levels() == {}  # no traffic yet: no series
        tenants.touch(tenants.get("a"))
        tenants.touch(tenants.get("b"))
        tenants.get("a").try_reserve(300.0, now[0])
        assert levels()[("a", "300/1m")] == 0.0
        now[0] = 30.0  # no request since: the pushed gauge stayed at 0
        assert levels()[("a", "300/1m")] == 150.0
        tenants.apply(cfg(a))
        assert set(levels()) == {("a", "300/1m")}
    finally:
        metrics.BUDGET_REMAINING.source = None
        metrics.forget_tenant("a")
