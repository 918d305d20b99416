"""Gauges read at scrape time: a budget's level is the bucket's level now, and a tenant a
reload removed has no series; only active tenants have series."""

from __future__ import annotations

from typing import Any

from tokenpace.gateway import metrics, parse_config
from tokenpace.gateway.tenants import Tenants


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


def application_levels() -> dict[tuple[str, str, str], float]:
    out = {}
    for family in metrics._Page([g.family() for g in metrics.LIVE]).collect():
        for sample in family.samples:
            if sample.name == "tokenpace_gateway_application_budget_remaining_tokens":
                labels = sample.labels
                out[(labels["tenant"], labels["application"], labels["budget"])] = sample.value
    return out


def test_an_applications_own_budget_has_its_gauge_beside_its_tenants() -> None:
    """An application's budget level is read at scrape time like its tenant's, under the
    tenant's and the application's names; an application without budgets of its own has
    no series, and one a reload removed drops out."""
    now = [0.0]
    apps = [{"id": "bot", "api_keys": ["kbot"], "budgets": [{"tokens": 100, "per": "10s"}]},
            {"id": "chat", "api_keys": ["kchat"]}]
    a = {"id": "a", "api_keys": ["ka"], "budgets": [{"tokens": 300, "per": "1m"}],
         "applications": apps}
    tenants = Tenants(cfg(a), lambda: now[0])
    metrics.BUDGET_REMAINING.source = tenants.budget_samples
    metrics.APPLICATION_BUDGET_REMAINING.source = tenants.application_budget_samples
    try:
        assert application_levels() == {}  # no traffic yet: no series
        state = tenants.get("a")
        tenants.touch(state)
        state.applications["bot"].try_reserve(80.0, now[0])
        state.try_reserve(80.0, now[0])
        assert application_levels() == {("a", "bot", "100/10s"): 20.0}
        assert levels() == {("a", "300/1m"): 220.0}
        now[0] = 4.0  # refilled at 10 a second, read when scraped
        assert application_levels() == {("a", "bot", "100/10s"): 60.0}
        tenants.apply(cfg({**a, "applications": apps[1:]}))
        assert application_levels() == {}
    finally:
        metrics.BUDGET_REMAINING.source = None
        metrics.APPLICATION_BUDGET_REMAINING.source = None
        metrics.forget_tenant("a")
