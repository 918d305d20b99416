"""Calendar periods: the month or the week (from Monday) a moment falls in, in UTC.

A calendar budget (``per: month``, ``per: week``) is whole again at the start of each
period, not refilled continuously. Times are unix seconds from an injected wall clock;
nothing here reads the time itself. Each function is O(1) (a few integer operations).

Periods are in UTC: the moment a month starts is the same on every replica and in the
ledger's timestamps, and no daylight-saving change can make a period 23 or 25 hours
longer at its edges.
"""

from __future__ import annotations

import calendar
from datetime import datetime, timedelta, timezone

PERIODS = ("month", "week")
"""The calendar periods a budget may name (``per``)."""

_DAY = 86400.0


def period_start(period: str, t: float) -> float:
    """Unix seconds at which the ``period`` containing ``t`` began (UTC midnight of the
    month's 1st, or of the week's Monday)."""
    day = datetime.fromtimestamp(t, timezone.utc).replace(hour=0, minute=0, second=0,
                                                          microsecond=0)
    if period == "month":
        return day.replace(day=1).timestamp()
    if period == "week":
        return (day - timedelta(days=day.weekday())).timestamp()
    raise ValueError(f"unknown calendar period {period!r}; expected one of {', '.join(PERIODS)}")


def period_end(period: str, t: float) -> float:
    """Unix seconds at which the ``period`` containing ``t`` ends (the next one starts)."""
    start = period_start(period, t)
    if period == "week":
        return start + 7 * _DAY
    first = datetime.fromtimestamp(start, timezone.utc)
    return start + calendar.monthrange(first.year, first.month)[1] * _DAY


def nominal_seconds(period: str) -> float:
    """A period's longest length (31 days, 7 days): an upper bound for what needs one."""
    if period == "month":
        return 31 * _DAY
    if period == "week":
        return 7 * _DAY
    raise ValueError(f"unknown calendar period {period!r}; expected one of {', '.join(PERIODS)}")


def iso(t: float) -> str:
    """``2027-01-01T00:00:00Z``: a period's edge in messages and JSON."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
