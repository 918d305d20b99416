"""Token budgets: reserve, settle, refill, refusals with exact waits (pure, explicit clock)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenpace.fairness import BudgetSpec, CostModel, TenantBudgets, TokenBucket, parse_duration


def test_bucket_refills_continuously_up_to_its_size() -> None:
    bucket = TokenBucket(BudgetSpec(100, 10.0), now=0.0)
    bucket.adjust(-100, 0.0)
    assert bucket.level(2.5) == pytest.approx(25)
    assert bucket.level(50.0) == 100
    assert bucket.until_full(50.0) == 0


def test_reserve_takes_from_every_budget_and_settle_gives_back_the_difference() -> None:
    budgets = TenantBudgets([BudgetSpec(1000, 10.0), BudgetSpec(5000, 86400.0)], now=0.0)
    assert budgets.try_reserve(300, 0.0) is None
    assert budgets.levels(0.0) == {"1000/10s": 700, "5000/1d": 4700}
    budgets.settle(reserved=300, actual=120, now=0.0)
    assert budgets.levels(0.0) == {"1000/10s": 880, "5000/1d": 4880}


def test_refusal_reports_the_budget_with_the_longest_wait() -> None:
    budgets = TenantBudgets([BudgetSpec(1000, 10.0), BudgetSpec(1200, 1200.0)], now=0.0)
    assert budgets.try_reserve(1000, 0.0) is None
    refusal = budgets.try_reserve(300, 1.0)
    assert refusal is not None
    # short bucket: 100 left, needs 200 more at 100/s -> 2 s; long: 200+1 left, needs 99 at 1/s.
    assert refusal.budget.key == "1200/20m"
    assert refusal.retry_after_s == pytest.approx(99.0)
    assert refusal.remaining == pytest.approx(201.0)
    assert refusal.reset_s == pytest.approx(999.0)
    # Nothing was taken by the refused reservation.
    assert budgets.levels(1.0) == {"1000/10s": pytest.approx(100), "1200/20m": pytest.approx(201)}
    assert budgets.try_reserve(300, 100.0) is None


def test_a_request_larger_than_a_budget_never_fits() -> None:
    budgets = TenantBudgets([BudgetSpec(100, 1.0)], now=0.0)
    refusal = budgets.try_reserve(101, 0.0)
    assert refusal is not None and math.isinf(refusal.retry_after_s)


def test_usage_above_the_reservation_becomes_debt() -> None:
    budgets = TenantBudgets([BudgetSpec(100, 100.0)], now=0.0)
    assert budgets.try_reserve(50, 0.0) is None
    budgets.settle(reserved=50, actual=130, now=0.0)
    assert budgets.levels(0.0)["100/100s"] == pytest.approx(-30)
    refusal = budgets.try_reserve(10, 0.0)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(40.0)


def test_reload_keeps_levels_of_unchanged_budgets() -> None:
    old = TenantBudgets([BudgetSpec(100, 10.0), BudgetSpec(50, 1.0)], now=0.0)
    old.try_reserve(40, 0.0)
    new = TenantBudgets([BudgetSpec(100, 10.0), BudgetSpec(70, 1.0)], now=0.0)
    new.carry_over(old, 0.0)
    assert new.levels(0.0) == {"100/10s": 60, "70/1s": 70}


@given(st.lists(st.tuples(st.floats(0, 5), st.integers(1, 300), st.integers(0, 300)), max_size=40))
def test_admitted_reservations_never_exceed_budget_plus_refill(steps: list[tuple[float, int, int]]) -> None:
    """Whatever the arrivals, admitted cost in [0, t] <= size + refill x t (the bucket bound)."""
    spec = BudgetSpec(500, 10.0)
    budgets = TenantBudgets([spec], now=0.0)
    now = 0.0
    admitted = 0.0
    for gap, reserve, actual in steps:
        now += gap
        if budgets.try_reserve(reserve, now) is None:
            used = min(actual, reserve)
            budgets.settle(reserve, used, now)
            admitted += used
        assert admitted <= spec.tokens + spec.refill_per_s * now + 1e-6


def test_parse_duration() -> None:
    assert parse_duration("500ms") == pytest.approx(0.5)
    assert parse_duration("10s") == 10
    assert parse_duration("15m") == 900
    assert parse_duration("2h") == 7200
    assert parse_duration("1d") == 86400
    for bad in ("10", "s", "-1s", "0s", "1w", 5):
        with pytest.raises(ValueError):
            parse_duration(bad)  # type: ignore[arg-type]


def test_budget_keys_and_cost_model() -> None:
    assert BudgetSpec(20000, 10.0).key == "20000/10s"
    assert BudgetSpec(2_000_000, 86400.0).key == "2000000/1d"
    assert BudgetSpec(1.5, 0.25).key == "1.5/250ms"
    assert CostModel(1.0, 2.0).of(10, 5) == 20.0
    with pytest.raises(ValueError):
        CostModel(-1.0, 1.0)
    with pytest.raises(ValueError):
        BudgetSpec(0, 1.0)


def test_headroom_is_the_budget_with_the_least_left() -> None:
    from tokenpace.fairness import Headroom, tightest

    budgets = TenantBudgets([BudgetSpec(100, 10), BudgetSpec(1000, 3600)], now=0.0)
    assert budgets.headroom(0.0) == Headroom(BudgetSpec(100, 10), 100, 0.0)  # both full
    assert budgets.try_reserve(80, 0.0) is None
    assert budgets.headroom(0.0) == Headroom(BudgetSpec(100, 10), 20, 8.0)
    assert budgets.headroom(2.0) == Headroom(BudgetSpec(100, 10), 40.0, 6.0)
    assert TenantBudgets([], 0.0).headroom(0.0) is None
    # Equal levels: the one slower to refill is the one to respect.
    slow, fast = Headroom.of(BudgetSpec(10, 100), 5), Headroom.of(BudgetSpec(10, 1), 5)
    assert tightest([fast, None, slow]) == slow and tightest([None]) is None
    assert Headroom.of(BudgetSpec(10, 10), -4).reset_s == 14.0  # a debt takes longer


def test_go_duration_is_openais_reset_format() -> None:
    from tokenpace.gateway.wire import go_duration

    assert [go_duration(s) for s in (0.0, 0.0004, 0.02, 1.5, 36.0, 360.0, 3723.25)] == \
        ["0s", "1ms", "20ms", "1.5s", "36s", "6m0s", "1h2m3.25s"]
