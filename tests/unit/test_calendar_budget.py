"""Calendar budgets (``per: month``, ``per: week``) with a fake wall clock: the period
arithmetic, the bucket across a month's and a week's edge, the in-process store, the
configuration, and saved levels restored only inside their own period."""

from __future__ import annotations

import asyncio
import math
from datetime import datetime, timezone

import pytest

from tokenpace.fairness import (
    BudgetRefusal,
    BudgetSpec,
    CalendarBucket,
    TenantBudgets,
    nominal_seconds,
    period_end,
    period_start,
)
from tokenpace.gateway.config import ConfigError, parse_config
from tokenpace.gateway.state import LocalStore, Reservation
from tokenpace.gateway.tenants import Tenants


def utc(*args: int) -> float:
    return datetime(*args, tzinfo=timezone.utc).timestamp()


class Wall:
    """A wall clock the test moves (unix seconds)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


MONTH = BudgetSpec(1000, nominal_seconds("month"), calendar="month")
WEEK = BudgetSpec(500, nominal_seconds("week"), calendar="week")


@pytest.mark.parametrize("t, start, end", [
    (utc(2027, 1, 31, 23, 59, 59), utc(2027, 1, 1), utc(2027, 2, 1)),
    (utc(2027, 2, 1), utc(2027, 2, 1), utc(2027, 3, 1)),  # 28 days
    (utc(2028, 2, 29, 12), utc(2028, 2, 1), utc(2028, 3, 1)),  # leap year: 29 days
    (utc(2026, 12, 31, 23), utc(2026, 12, 1), utc(2027, 1, 1)),  # the year's edge
])
def test_month_periods(t: float, start: float, end: float) -> None:
    assert period_start("month", t) == start
    assert period_end("month", t) == end


def test_leap_february_is_29_days_and_a_common_one_28() -> None:
    assert period_end("month", utc(2028, 2, 10)) - utc(2028, 2, 1) == 29 * 86400
    assert period_end("month", utc(2027, 2, 10)) - utc(2027, 2, 1) == 28 * 86400


def test_weeks_start_on_monday_midnight_utc() -> None:
    sunday_night = utc(2027, 1, 3, 23, 59, 59)  # a Sunday
    assert datetime.fromtimestamp(period_end("week", sunday_night), timezone.utc) == \
        datetime(2027, 1, 4, tzinfo=timezone.utc)  # a Monday
    assert period_start("week", utc(2027, 1, 4)) == utc(2027, 1, 4)
    assert period_start("week", utc(2027, 1, 10, 12)) == utc(2027, 1, 4)
    with pytest.raises(ValueError, match="fortnight"):
        period_start("fortnight", 0.0)


def test_a_month_budget_is_spent_then_whole_at_the_first_of_the_month() -> None:
    wall = Wall(utc(2027, 1, 31, 23, 0))
    budgets = TenantBudgets([MONTH], 0.0, wall=wall)
    assert budgets.try_reserve(900, 0.0) is None
    refusal = budgets.try_reserve(200, 0.0)
    assert isinstance(refusal, BudgetRefusal) and refusal.budget == MONTH
    assert refusal.remaining == 100
    assert refusal.retry_after_s == refusal.reset_s == 3600  # until Feb 1st 00:00 UTC
    wall.t += 1800  # no refill inside the period
    assert budgets.buckets[0].level(0.0) == 100
    again = budgets.try_reserve(200, 0.0)
    assert isinstance(again, BudgetRefusal) and again.retry_after_s == 1800
    wall.t = utc(2027, 2, 1)  # the period's edge
    assert budgets.buckets[0].level(0.0) == 1000
    assert budgets.try_reserve(200, 0.0) is None
    headroom = budgets.headroom(0.0)
    assert headroom is not None and headroom.remaining == 800
    assert headroom.reset_s == 28 * 86400  # February 2027
    assert budgets.try_reserve(1001, 0.0).retry_after_s == math.inf  # type: ignore[union-attr]


def test_a_debt_is_not_carried_into_the_next_period_and_a_clock_set_back_gives_nothing() -> None:
    wall = Wall(utc(2028, 2, 28, 12))  # a leap year: the period runs to Mar 1st
    bucket = CalendarBucket(MONTH, wall)
    bucket.adjust(-1200, 0.0)  # a request used more than it reserved
    assert bucket.level(0.0) == -200
    wall.t = utc(2028, 2, 29, 23, 59)
    assert bucket.level(0.0) == -200
    assert bucket.until_full(0.0) == 60
    wall.t = utc(2028, 3, 1)
    assert bucket.level(0.0) == 1000
    bucket.adjust(-300, 0.0)
    wall.t = utc(2028, 2, 29)  # the wall clock set back a day
    assert bucket.level(0.0) == 700
    assert bucket.period() == (utc(2028, 3, 1), utc(2028, 4, 1))


def test_a_week_budget_resets_on_monday() -> None:
    wall = Wall(utc(2027, 1, 10, 22))  # Sunday 22:00
    budgets = TenantBudgets([WEEK, BudgetSpec(10_000, 60.0)], 0.0, wall=wall)
    assert budgets.try_reserve(500, 0.0) is None
    refusal = budgets.try_reserve(1, 0.0)
    assert isinstance(refusal, BudgetRefusal) and refusal.budget == WEEK
    assert refusal.retry_after_s == 2 * 3600
    wall.t = utc(2027, 1, 11)
    assert budgets.try_reserve(1, 0.0) is None


def test_keys_and_figures() -> None:
    assert MONTH.key == "1000/month" and WEEK.figures == "500/week"
    assert BudgetSpec(5, 31 * 86400.0, observe=True, calendar="month").key == "observe:5/month"
    assert MONTH.refill_per_s == 0.0
    with pytest.raises(ValueError, match="calendar"):
        BudgetSpec(5, 86400.0, calendar="year")
    with pytest.raises(ValueError, match="wall clock"):
        TenantBudgets([MONTH], 0.0)


def _config(budgets: str) -> dict:
    return {"engines": [{"url": "http://127.0.0.1:1"}],
            "tenants": [{"id": "acme", "api_keys": ["sk-a"], "budgets": budgets}]}


def test_the_configuration_takes_month_and_week_and_names_a_bad_period() -> None:
    config = parse_config(_config([{"tokens": 1000, "per": "month"},  # type: ignore[arg-type]
                                   {"tokens": 100, "per": "week", "mode": "observe"},
                                   {"tokens": 50, "per": "1m"}]))
    tenant = config.tenants[0]
    assert [b.key for b in tenant.budgets] == ["1000/month", "50/1m"]
    assert [b.key for b in tenant.observed_budgets] == ["observe:100/week"]
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.budgets\[0\]\.per: .*'month' or 'week'"):
        parse_config(_config([{"tokens": 1, "per": "year"}]))  # type: ignore[arg-type]


def test_the_local_store_resets_at_the_month_and_reports_the_period_end() -> None:
    wall = Wall(utc(2027, 1, 31, 23, 59))

    async def body() -> None:
        store = LocalStore(clock=lambda: 0.0, wall=wall)
        first = await store.reserve("acme", [MONTH], 600)
        assert isinstance(first, Reservation)
        headroom = first.headroom()
        assert headroom is not None and headroom.remaining == 400 and headroom.reset_s == 60
        refused = await store.reserve("acme", [MONTH], 600)
        assert isinstance(refused, BudgetRefusal) and refused.retry_after_s == 60
        wall.t = utc(2027, 2, 1, 0, 0, 1)
        assert (await store.budget_levels("acme", [MONTH]))["1000/month"] == 1000
        assert isinstance(await store.reserve("acme", [MONTH], 600), Reservation)
        await store.settle(first, 100)  # settled after the edge: into the new period
        assert (await store.budget_levels("acme", [MONTH]))["1000/month"] == 900

    asyncio.run(body())


def test_saved_levels_come_back_only_inside_their_period() -> None:
    config = parse_config(_config([{"tokens": 1000, "per": "month"}]))  # type: ignore[arg-type]
    wall = Wall(utc(2027, 2, 1, 0, 10))
    same = Tenants(config, lambda: 0.0, {"acme": {"1000/month": (250.0, 300.0)}}, wall=wall)
    assert same.get("acme").budgets.levels(0.0) == {"1000/month": 250.0}  # type: ignore[union-attr]
    # Saved 20 minutes ago: in January, so February starts whole.
    older = Tenants(config, lambda: 0.0, {"acme": {"1000/month": (250.0, 1200.0)}}, wall=wall)
    assert older.get("acme").budgets.levels(0.0) == {"1000/month": 1000.0}  # type: ignore[union-attr]
