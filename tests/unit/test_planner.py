"""StepPlanner's step decisions on a fake clock: fair slots (with the lift of newcomers),
stream rotation, refused users, the uncontended and the contended path."""

from __future__ import annotations

from collections import Counter

from tokenpace.pacing import NO_SAMPLE, SAMPLES, OutputRateLimiter, StepPlanner, UserRateLimits

STEP_NS = 10_000_000


class Clock:
    def __init__(self) -> None:
        self.ns = 10**12

    def __call__(self) -> int:
        return self.ns


def _planner(default: float | None, **rates: float) -> tuple[StepPlanner, Clock]:
    clock = Clock()
    return StepPlanner(OutputRateLimiter(UserRateLimits(default, rates), clock_ns=clock)), clock


def _step(planner, clock, streams, slots):
    """One step where every stream that runs is dispatched; returns the keys that ran."""
    planner.begin_step()
    for s in streams:
        s.samples = SAMPLES
    plan = planner.plan_running(streams, slots)
    sat_out = set(plan.throttled) | set(plan.deferred)
    ran = [s.key for s in streams if s.key not in sat_out]
    planner.settle(set(ran), lambda key: False)
    clock.ns += STEP_NS
    return ran


def test_a_newcomer_starts_at_the_smallest_counter_not_at_zero() -> None:
    planner, clock = _planner(None)  # nobody paced: only the slots decide
    a, b = planner.open_stream("a1", "a"), planner.open_stream("b1", "b")
    for _ in range(100):
        _step(planner, clock, [a, b], slots=1)
    c = planner.open_stream("c1", "c")
    ran = Counter(key for _ in range(30) for key in _step(planner, clock, [a, b, c], slots=1))
    # Lifted to the others' level, c takes turns with them (about 10 of 30 slots each);
    # starting from zero it would take all 30 to catch up on the 50 slot-steps a and b had.
    assert all(9 <= ran[key] <= 11 for key in ("a1", "b1", "c1")), ran


def test_a_users_streams_take_turns_when_its_quota_allows_one_per_step() -> None:
    planner, clock = _planner(100.0)  # one token per 10 ms step once the burst is spent
    streams = [planner.open_stream(f"r{i}", "u") for i in range(4)]
    for _ in range(20):  # spend the burst
        _step(planner, clock, streams, slots=8)
    ran = Counter(key for _ in range(40) for key in _step(planner, clock, streams, slots=8))
    assert sum(ran.values()) == 40
    assert set(ran.values()) == {10}, ran


def test_a_refused_user_is_throttled_and_others_run() -> None:
    planner, clock = _planner(None, slow=1.0)
    slow = [planner.open_stream(f"s{i}", "slow") for i in range(3)]
    free = planner.open_stream("f", "free")
    _step(planner, clock, slow + [free], slots=8)  # slow's one token
    planner.begin_step()
    for s in slow + [free]:
        s.samples = SAMPLES
    plan = planner.plan_running(slow + [free], 8)
    assert sorted(plan.throttled) == ["s0", "s1", "s2"] and plan.deferred == []
    assert planner.refused_any


def test_a_step_that_samples_nothing_needs_no_quota() -> None:
    planner, clock = _planner(None, slow=1.0)
    s = planner.open_stream("s", "slow")
    _step(planner, clock, [s], slots=8)  # the only token
    planner.begin_step()
    s.samples = NO_SAMPLE  # an intermediate prefill chunk
    plan = planner.plan_running([s], 8)
    assert plan.throttled == [] and not planner.refused_any


def test_an_undispatched_charge_is_refunded_once() -> None:
    planner, clock = _planner(None, u=1.0)
    s = planner.open_stream("s", "u")
    planner.begin_step()
    s.samples = SAMPLES
    assert planner.plan_running([s], 8).throttled == []
    planner.settle(set(), lambda key: False)  # not scheduled after all: refunded
    assert planner.limiter.try_take("u")  # the token is there again
    assert not planner.limiter.try_take("u")


class TickingClock(Clock):
    """A real clock's one property that matters here: every reading is later than the last."""

    def __call__(self) -> int:
        self.ns += 1
        return self.ns


def test_a_stream_left_out_for_lack_of_a_slot_is_deferred_not_throttled_on_a_moving_clock() -> None:
    clock = TickingClock()
    planner = StepPlanner(OutputRateLimiter(UserRateLimits(100_000.0, {}), clock_ns=clock))
    streams = [planner.open_stream(f"r{i}", "u") for i in range(5)]
    planner.begin_step()
    for s in streams:
        s.samples = SAMPLES
    plan = planner.plan_running(streams, 4)
    # The user has quota (100,000 tokens per second, four taken): the fifth stream sat out
    # for the slot, not for the quota; a throttled one would give its slot away.
    assert plan.throttled == [] and len(plan.deferred) == 1
