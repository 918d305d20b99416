"""Budgets after a crash, in process: the settlements and reservations the journal holds
are applied to levels restored from a snapshot according to their times, and an orphan's
row is priced from the engine's counts (``server._recovery``), with a fake clock."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tokenpace.gateway import parse_config
from tokenpace.gateway.ledger import BudgetState
from tokenpace.gateway.server._recovery import (
    _settle_local,
    correct_settled,
    priced,
    snapshot_times,
)
from tokenpace.gateway.tenants import Tenants

SNAPSHOT_AT = 1_000.0  # wall clock of the restored snapshot


def _runtime(level: float, app_level: float = 500.0) -> Any:
    config = parse_config({"engines": ["http://127.0.0.1:1"], "tenants": [
        {"id": "acme", "api_keys": ["sk-a"], "budgets": [{"tokens": 1000, "per": "1d"}],
         "applications": [{"id": "bot", "api_keys": ["sk-bot"],
                           "budgets": [{"tokens": 600, "per": "1d"}]}]}],
        "ledger": "sqlite:///unused.db"})
    now = [50.0]
    [budget] = config.tenants[0].budgets
    [app] = config.tenants[0].applications
    tenants = Tenants(config, lambda: now[0], {
        "acme": {budget.key: (level, 0.0)},
        app.owner("acme"): {app.budgets[0].key: (app_level, 0.0)}})
    return SimpleNamespace(tenants=tenants, store=None, clock=lambda: now[0]), budget.key


def _app_level(rt: Any) -> float:
    app = rt.tenants.get("acme").applications["bot"]
    [level] = app.budgets.levels(rt.clock()).values()
    return level


def _entry(reserved: float, reserved_at: float, shared: bool = False,
           app_reserved: float | None = None) -> dict[str, Any]:
    holders: list[list[Any]] = [["", reserved, shared]]
    if app_reserved is not None:
        holders.append(["bot", app_reserved, shared])
    return {"open": {"request_id": "tpg-1", "tenant": "acme", "model": "tiny",
                     "lane": "default", "prompt_tokens": 10, "completion_tokens": 100,
                     "cost": 210.0, "queue_ms": None, "ttft_ms": None, "e2e_ms": 1.0,
                     "finish_reason": "interrupted", "started_at": reserved_at,
                     "ended_at": reserved_at, "served": 1, "route": "/v1/chat/completions",
                     "application": "", "cached_prompt_tokens": 0, "batch_id": "",
                     "estimated": 1},
            "engine": "http://e", "kind": "chat", "cost": [1.0, 2.0, 1.0],
            "prompt_bound": False, "holders": holders, "reserved_at": reserved_at}


def _level(rt: Any, key: str) -> float:
    return rt.tenants.get("acme").budgets.levels(rt.clock())[key]


def test_snapshot_times_are_per_tenant() -> None:
    assert snapshot_times([BudgetState("a", "x", 1.0, 5.0), BudgetState("a", "y", 1.0, 7.0),
                           BudgetState("b", "x", 1.0, 3.0)]) == {"a": 7.0, "b": 3.0}


def test_a_reservation_in_the_snapshot_is_replaced_by_the_cost() -> None:
    rt, key = _runtime(level=700.0)  # 210 reserved before the snapshot
    assert _settle_local(rt, _entry(210.0, SNAPSHOT_AT - 1), 40.0, None,
                         {"acme": SNAPSHOT_AT}) == 1
    assert _level(rt, key) == 700.0 + 210.0 - 40.0


def test_an_applications_reservation_is_settled_by_its_own_snapshot() -> None:
    rt, key = _runtime(level=700.0, app_level=300.0)
    app_owner = rt.tenants.get("acme").applications["bot"].owner
    # The tenant's levels were saved after the reservation, the application's before it.
    snapshots = {"acme": SNAPSHOT_AT, app_owner: SNAPSHOT_AT - 10}
    assert _settle_local(rt, _entry(210.0, SNAPSHOT_AT - 1, app_reserved=210.0), 40.0,
                         None, snapshots) == 2
    assert _level(rt, key) == 700.0 + 210.0 - 40.0
    assert _app_level(rt) == 300.0 - 40.0


def test_a_reservation_after_the_snapshot_is_charged_its_cost() -> None:
    rt, key = _runtime(level=700.0)
    _settle_local(rt, _entry(210.0, SNAPSHOT_AT + 1), 40.0, None, {"acme": SNAPSHOT_AT})
    assert _level(rt, key) == 700.0 - 40.0


def test_journaled_settlements_apply_only_after_the_snapshot() -> None:
    rt, key = _runtime(level=700.0)
    settled = [
        (_entry(210.0, SNAPSHOT_AT - 5), 30.0, SNAPSHOT_AT - 2),  # all in the snapshot
        (_entry(210.0, SNAPSHOT_AT - 5), 50.0, SNAPSHOT_AT + 2),  # settled after it
        (_entry(100.0, SNAPSHOT_AT + 1), 20.0, SNAPSHOT_AT + 3),  # both after it
    ]
    assert correct_settled(rt, settled, {"acme": SNAPSHOT_AT}) == 2  # the tenant's: 2 of 3
    assert _level(rt, key) == 700.0 + (210.0 - 50.0) - 20.0


def test_shared_reservations_are_not_corrected_in_process() -> None:
    rt, key = _runtime(level=700.0)
    assert _settle_local(rt, _entry(210.0, SNAPSHOT_AT - 1, shared=True), 40.0, None,
                         {"acme": SNAPSHOT_AT}) == 0
    assert _level(rt, key) == 700.0


def test_an_orphan_is_priced_from_the_engines_counts() -> None:
    row = priced(_entry(210.0, SNAPSHOT_AT), 12, 33)
    assert (row.prompt_tokens, row.completion_tokens, row.cost) == (12, 33, 12 + 66.0)
    assert row.finish_reason == "interrupted" and not row.estimated
    kept = priced(_entry(210.0, SNAPSHOT_AT), None, 33)  # the engine did not say the prompt
    assert (kept.prompt_tokens, kept.cost, kept.estimated) == (10, 10 + 66.0, False)
    bounded = priced({**_entry(210.0, SNAPSHOT_AT), "prompt_bound": True}, None, 33)
    assert bounded.estimated  # the prompt is the admission's byte bound
