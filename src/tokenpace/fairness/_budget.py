"""Token budgets: reserve on admission, settle to actual usage when the request ends.

A budget of ``T`` tokens per ``P`` is a bucket that holds at most ``T`` cost units and
refills continuously at ``T / P`` per second. A short budget (``20000 per 10s``) bounds
bursts, a long one (``2000000 per 1d``) the sustained use; a tenant may have several and a
request must fit in all of them.

Why reserve ``max_tokens`` and settle later: the output length is unknown when a request is
admitted, so admission has to assume the worst (otherwise many concurrent requests could all
be admitted against the same remaining budget); charging the worst case for good would
punish clients that set generous limits but stop early, so the difference goes back to the
bucket when the real usage is known. A request that used more than it reserved (it cannot
with an enforced ``max_tokens``, but costs may be re-priced by a reload) drives the level
below zero: the debt delays the next admission instead of being forgiven.

A calendar budget (``2000000 per month``, ``per week``) is whole at the start of each
period (UTC, ``_calendar``) and does not refill in between: its bucket
(``CalendarBucket``) reads the period from an injected wall clock, since a month starts at
a date, not at a moment of the process's monotonic clock.

Times are plain seconds from an injected clock; nothing here reads the time itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ._calendar import PERIODS, iso, period_end, period_start


@dataclass(frozen=True)
class BudgetSpec:
    """``tokens`` cost units per ``period_s`` seconds."""

    tokens: float
    period_s: float
    observe: bool = False
    """``mode: observe``: the limit refuses nothing; the gateway counts what it would have
    refused. Its bucket is kept apart from an enforced one of the same figures (``key``)."""
    calendar: str | None = None
    """``month`` or ``week``: whole at each period's start (UTC), no refill in between;
    ``period_s`` is then the period's longest length. None: a sliding bucket."""

    def __post_init__(self) -> None:
        if self.calendar is not None and self.calendar not in PERIODS:
            raise ValueError(f"unknown calendar period {self.calendar!r}; expected one of "
                             f"{', '.join(PERIODS)}")
        if not (math.isfinite(self.tokens) and self.tokens > 0):
            raise ValueError(f"budget tokens must be a positive number, got {self.tokens!r}")
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ValueError(f"budget period must be positive, got {self.period_s!r}")

    @property
    def key(self) -> str:
        """A stable name, e.g. ``20000/10s`` (``observe:20000/10s`` in observe mode):
        labels metrics and keys persisted and shared state."""
        return "observe:" + self.figures if self.observe else self.figures

    @property
    def figures(self) -> str:
        """``20000/10s`` or ``2000000/month``, whatever the mode (for messages)."""
        return f"{_number(self.tokens)}/{self.calendar or _duration(self.period_s)}"

    @property
    def refill_per_s(self) -> float:
        """Continuous refill; 0 for a calendar budget (whole again at its period's start)."""
        return 0.0 if self.calendar is not None else self.tokens / self.period_s


@dataclass(frozen=True)
class RequestLimit(BudgetSpec):
    """A request-rate limit: ``tokens`` requests per ``period_s`` seconds.

    The same bucket as a budget (it holds at most ``tokens`` requests and refills at
    ``tokens / period_s`` a second, so ``600 per 1m`` admits a burst of 600, then one every
    100 ms); each request costs one and is never settled. Its ``key`` keeps its bucket
    apart from a token budget of the same figures, in process and in Redis.
    """

    @property
    def requests(self) -> int:
        return int(self.tokens)

    @property
    def key(self) -> str:
        return "requests:" + BudgetSpec.key.fget(self)  # type: ignore[attr-defined]


class TokenBucket:
    """One budget's bucket. ``level`` may go negative (debt), never above ``tokens``."""

    __slots__ = ("spec", "_level", "_at")

    def __init__(self, spec: BudgetSpec, now: float, level: float | None = None) -> None:
        self.spec = spec
        self._level = spec.tokens if level is None else min(level, spec.tokens)
        self._at = now

    def level(self, now: float) -> float:
        """Cost units available at ``now`` (refilled since the last change)."""
        if now > self._at:
            self._level = min(self.spec.tokens, self._level + (now - self._at) * self.spec.refill_per_s)
            self._at = now
        return self._level

    def wait_for(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` fits: 0 if it fits now, ``inf`` if it never can."""
        if cost > self.spec.tokens:
            return math.inf
        missing = cost - self.level(now)
        return 0.0 if missing <= 0 else missing / self.spec.refill_per_s

    def until_full(self, now: float) -> float:
        """Seconds until the bucket is full again (OpenAI's ``x-ratelimit-reset-tokens``)."""
        return max(0.0, self.spec.tokens - self.level(now)) / self.spec.refill_per_s

    def adjust(self, delta: float, now: float) -> None:
        """Add ``delta`` (negative: take) cost units, capped at the bucket size."""
        self._level = min(self.spec.tokens, self.level(now) + delta)


class CalendarBucket:
    """A calendar budget's bucket: ``tokens`` for the period, whole again when the next
    period starts (a debt is not carried into it). The same methods as ``TokenBucket``;
    ``now`` is ignored, the period is read from ``wall`` (unix seconds). The period only
    moves forward: a wall clock set back does not give a period's budget twice.

    A request reserved just before a period's end and settled after it settles against
    the new period: at most one request's cost lands in the other period."""

    __slots__ = ("spec", "_wall", "_level", "_start", "_end")

    def __init__(self, spec: BudgetSpec, wall: Callable[[], float],
                 level: float | None = None) -> None:
        assert spec.calendar is not None
        self.spec = spec
        self._wall = wall
        t = wall()
        self._start = period_start(spec.calendar, t)
        self._end = period_end(spec.calendar, t)
        self._level = spec.tokens if level is None else min(level, spec.tokens)

    def _now(self) -> float:
        """The wall time, with the period rolled forward to it."""
        t = self._wall()
        if t >= self._end:
            assert self.spec.calendar is not None
            self._start = period_start(self.spec.calendar, t)
            self._end = period_end(self.spec.calendar, t)
            self._level = self.spec.tokens
        return t

    def level(self, now: float) -> float:
        self._now()
        return self._level

    def wait_for(self, cost: float, now: float) -> float:
        """0 if ``cost`` fits, else the seconds until the period ends; ``inf`` if never."""
        if cost > self.spec.tokens:
            return math.inf
        t = self._now()
        return 0.0 if cost <= self._level else self._end - t

    def until_full(self, now: float) -> float:
        t = self._now()
        return 0.0 if self._level >= self.spec.tokens else self._end - t

    def adjust(self, delta: float, now: float) -> None:
        self._now()
        self._level = min(self.spec.tokens, self._level + delta)

    def period(self) -> tuple[float, float]:
        """The current period's (start, end) in unix seconds."""
        self._now()
        return self._start, self._end


Bucket = TokenBucket | CalendarBucket


def make_bucket(spec: BudgetSpec, now: float, level: float | None = None,
                wall: Callable[[], float] | None = None) -> Bucket:
    """A sliding ``TokenBucket``, or a ``CalendarBucket`` for a calendar budget (which
    needs ``wall``: unix seconds)."""
    if spec.calendar is None:
        return TokenBucket(spec, now, level)
    if wall is None:
        raise ValueError(f"budget {spec.key} is a calendar budget: it needs a wall clock")
    return CalendarBucket(spec, wall, level)


def resets_at(bucket: Bucket, now: float) -> str | None:
    """A calendar bucket's next reset (``2027-01-01T00:00:00Z``); None for a sliding one."""
    return iso(bucket.period()[1]) if isinstance(bucket, CalendarBucket) else None


@dataclass(frozen=True)
class BudgetRefusal:
    """Why a reservation did not fit, in the terms of OpenAI's rate-limit headers."""

    budget: BudgetSpec
    cost: float
    retry_after_s: float  # inf: larger than the budget itself, retrying cannot help
    remaining: float
    reset_s: float


@dataclass(frozen=True)
class Headroom:
    """What is left of a limit once a request took its share, in the terms of OpenAI's
    rate-limit headers on a successful response (``x-ratelimit-limit/remaining/reset``)."""

    budget: BudgetSpec
    remaining: float  # may be negative: a debt left by a request that used more
    reset_s: float  # until the bucket is full again

    @classmethod
    def of(cls, budget: BudgetSpec, level: float, ends_in: float | None = None) -> Headroom:
        """``ends_in``: for a calendar budget, the seconds until its period ends."""
        if budget.calendar is not None:
            return cls(budget, level, 0.0 if level >= budget.tokens else max(0.0, ends_in or 0.0))
        return cls(budget, level, max(0.0, budget.tokens - level) / budget.refill_per_s)


def tightest(headrooms: Iterable[Headroom | None]) -> Headroom | None:
    """The headroom with the least left, which is what a client pacing itself must
    respect (ties: the one that takes longer to refill); None when there is none."""
    best: Headroom | None = None
    for h in headrooms:
        if h is not None and (best is None or (h.remaining, -h.reset_s)
                              < (best.remaining, -best.reset_s)):
            best = h
    return best


class TenantBudgets:
    """All budgets of one tenant, reserved and settled together."""

    def __init__(self, specs: list[BudgetSpec], now: float,
                 levels: dict[str, float] | None = None,
                 wall: Callable[[], float] | None = None) -> None:
        """``wall``: unix seconds, needed by calendar budgets only."""
        levels = levels or {}
        self.buckets: list[Bucket] = [make_bucket(s, now, levels.get(s.key), wall) for s in specs]

    def try_reserve(self, cost: float, now: float) -> BudgetRefusal | None:
        """Take ``cost`` from every bucket, or nothing and say which budget refused.

        When several budgets refuse, the one with the longest wait is reported: retrying
        any earlier would be refused again.
        """
        refusal = self.would_refuse(cost, now)
        if refusal is not None:
            return refusal
        for bucket in self.buckets:
            bucket.adjust(-cost, now)
        return None

    def would_refuse(self, cost: float, now: float) -> BudgetRefusal | None:
        """The refusal ``try_reserve(cost)`` would give now, taking nothing (a check that
        costs nothing before an expensive step)."""
        worst: Bucket | None = None
        worst_wait = 0.0
        for bucket in self.buckets:
            wait = bucket.wait_for(cost, now)
            if wait > worst_wait:
                worst, worst_wait = bucket, wait
        if worst is not None:
            return BudgetRefusal(
                budget=worst.spec,
                cost=cost,
                retry_after_s=worst_wait,
                remaining=max(0.0, worst.level(now)),
                reset_s=worst.until_full(now),
            )
        return None

    def settle(self, reserved: float, actual: float, now: float) -> None:
        """Replace a reservation by the actual cost: give back (or take) the difference."""
        for bucket in self.buckets:
            bucket.adjust(reserved - actual, now)

    def headroom(self, now: float) -> Headroom | None:
        """The budget with the least left now (None without budgets): after a
        reservation, what a successful response reports."""
        return tightest(Headroom(b.spec, b.level(now), b.until_full(now)) for b in self.buckets)

    def levels(self, now: float) -> dict[str, float]:
        """Budget key -> level, for metrics and for persisting across restarts."""
        return {b.spec.key: b.level(now) for b in self.buckets}

    def carry_over(self, old: TenantBudgets, now: float) -> None:
        """After a reload keep the levels of budgets that did not change (by key)."""
        levels = old.levels(now)
        for bucket in self.buckets:
            if bucket.spec.key in levels:
                bucket.adjust(levels[bucket.spec.key] - bucket.level(now), now)


_UNITS = (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0), ("ms", 0.001))


def parse_duration(text: str) -> float:
    """``"500ms"``, ``"10s"``, ``"15m"``, ``"2h"``, ``"1d"`` -> seconds (positive)."""
    if not isinstance(text, str):
        raise ValueError(f"expected a duration such as '10s', '15m', '1h' or '1d', got {text!r}")
    raw = text.strip()
    for suffix, scale in sorted(_UNITS, key=lambda u: -len(u[0])):
        if raw.endswith(suffix):
            number = raw[: -len(suffix)]
            break
    else:
        raise ValueError(f"expected a duration such as '10s', '15m', '1h' or '1d', got {text!r}")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"expected a duration such as '10s', '15m', '1h' or '1d', got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"duration must be positive, got {text!r}")
    return value * scale


def _duration(seconds: float) -> str:
    for suffix, scale in _UNITS:
        if seconds >= scale and (seconds / scale).is_integer():
            return f"{int(seconds / scale)}{suffix}"
    return f"{_number(seconds)}s"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
