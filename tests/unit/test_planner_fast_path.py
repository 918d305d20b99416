"""The planner's one-pass fast path (no user refused yet this step) against the exact
path: same grants at the GCRA boundary, same turns, and a cached limiter state that
follows rate changes and idle cleanup."""

from __future__ import annotations

import random

from tests._gc import collections_during
from tokenpace.pacing import (
    NO_SAMPLE,
    SAMPLES,
    OutputRateLimiter,
    StepPlanner,
    UserRateLimits,
)

NS = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.ns = 10**12

    def __call__(self) -> int:
        return self.ns


def _planner(default: float | None, clock: Clock, **rates: float) -> StepPlanner:
    return StepPlanner(OutputRateLimiter(UserRateLimits(default, rates), clock_ns=clock))


def _ran(planner: StepPlanner, streams: list) -> list[str]:
    """One step in which everything that runs is dispatched."""
    planner.begin_step()
    for s in streams:
        s.samples = SAMPLES
    plan = planner.plan_running(streams, len(streams))
    ran = [s.key for s in streams if s.key not in set(plan.throttled)]
    planner.settle(set(ran), lambda key: False)
    return ran


def test_grants_stop_exactly_at_the_burst_boundary() -> None:
    # 10 tok/s: the interval (100 ms) equals the burst, so a fresh user gets exactly two
    # tokens at one instant, then one per interval, and none a nanosecond before.
    clock = Clock()
    planner = _planner(10.0, clock)
    streams = [planner.open_stream(f"r{i}", "u") for i in range(3)]
    assert len(_ran(planner, streams)) == 2  # room == burst: 2 granted, the third refused
    assert _ran(planner, streams) == []  # same instant: room < 0
    clock.ns += NS // 10 - 1
    assert _ran(planner, streams) == []  # one ns short of the next token
    clock.ns += 1
    assert len(_ran(planner, streams)) == 1  # room == 0 grants exactly one
    assert _ran(planner, streams) == []


def test_refused_streams_take_turns_as_on_the_exact_path() -> None:
    clock = Clock()
    planner = _planner(10.0, clock)
    streams = [planner.open_stream(f"r{i}", "u") for i in range(3)]
    first = _ran(planner, streams)
    clock.ns += NS // 10
    second = _ran(planner, streams)
    # The stream left out first gets the next token, not the first in list order.
    assert set(first) | set(second) == {"r0", "r1", "r2"}, (first, second)


def test_the_cached_limiter_state_follows_reloads_and_cleanup() -> None:
    clock = Clock()
    planner = _planner(10.0, clock)
    limiter = planner.limiter
    s = planner.open_stream("r", "u")
    while _ran(planner, [s]):  # spend the burst
        pass
    limiter.set_limits(UserRateLimits(None, {}))  # u no longer paced
    assert all(_ran(planner, [s]) == ["r"] for _ in range(50))
    assert limiter.tracked_users() == 0
    limiter.set_limits(UserRateLimits(10.0, {}))  # paced again: a fresh burst of 2
    assert [len(_ran(planner, [s])) for _ in range(3)] == [1, 1, 0]
    clock.ns += 3600 * NS
    assert limiter.cleanup_idle_users() == 1  # state dropped: the next grant makes new
    assert _ran(planner, [s]) == ["r"]
    assert limiter.tracked_users() == 1  # the grant was counted in the live state
    assert _ran(planner, [s]) == ["r"]
    assert _ran(planner, [s]) == []


def test_fast_path_decides_exactly_as_the_exact_path() -> None:
    """Twin planners, one forced onto the exact path, under random streams, rates,
    clock steps (0, exact intervals, odd ones), refunds, reloads and cleanups."""
    rng = random.Random(16)
    # g and h share their interval (250 in scaled units, a cached small int) but not
    # their scale (1 and 3): the fast path's restart value must not carry over.
    rates = {"a": 5.0, "b": 10.0, "c": 33.3, "d": 100.0, "e": 2.5, "g": 4e6, "h": 1.2e7}
    clocks = (Clock(), Clock())
    fast = _planner(None, clocks[0], **rates)
    exact = _planner(None, clocks[1], **rates)
    exact._plan_uncontended = exact._plan_uncontended_exact  # type: ignore[method-assign]
    users = [*rates, "free"]
    keys = [(f"{u}{i}", u) for u in users for i in range(rng.randint(1, 4))]
    twins = [[p.open_stream(k, u) for k, u in keys] for p in (fast, exact)]
    throttled = 0
    for step in range(3000):
        alive = [i for i in range(len(keys)) if rng.random() < 0.8]
        samples = [rng.choice((SAMPLES, SAMPLES, SAMPLES, NO_SAMPLE)) for _ in alive]
        dispatched = {keys[i][0] for i in alive if rng.random() < 0.9}
        advance = rng.choice((0, NS // 10, NS // 100, 7_777_777, 40_000_001))
        reload = rng.random() < 0.01
        new_rates = {u: rng.choice((None, 5.0, 10.0, 50.0)) for u in rates}
        outcome = []
        for planner, streams, clock in zip((fast, exact), twins, clocks):
            planner.begin_step()
            batch = [streams[i] for i in alive]
            for s, kind in zip(batch, samples):
                s.samples = kind
            plan = planner.plan_running(batch, len(batch))
            refused = dict(planner._refused)  # who was refused, and when it has quota again
            settled = planner.settle(dispatched, lambda key: False, report=True)
            limiter = planner.limiter
            outcome.append((
                sorted(plan.throttled), sorted(settled),
                [s.account.service for s in streams],
                {u: limiter.ready_at_ns(u) for u in users},
                refused,
                # How much of its burst is left (consumed alike in both twins).
                [limiter.take(u, 10**9, clock.ns) for u in ("g", "h") if step % 50 == 0],
            ))
            clock.ns += advance
            if reload:
                limiter.set_limits(UserRateLimits(
                    None, {u: r for u, r in new_rates.items() if r is not None}))
            if step % 97 == 0:
                limiter.cleanup_idle_users()
        assert outcome[0] == outcome[1], step
        throttled += len(outcome[0][0])
    assert throttled > 1000  # the boundary was crossed often, not only the easy grants


def test_an_all_throttled_step_sets_off_no_garbage_collection() -> None:
    """A throttled stream costs no object of its own: a step of 4,096 throttled users
    (one request each) stays far below the collector's threshold (700 objects), so such
    steps never pay for a collection, nor for the process's next full one."""
    clock = Clock()
    planner = _planner(1e-6, clock)  # one token, then none for days
    streams = [planner.open_stream(f"r{i}", f"u{i}") for i in range(4096)]
    assert len(_ran(planner, streams)) == 4096  # each user's one token
    with collections_during() as collections:
        for _ in range(3):
            clock.ns += NS // 100
            planner.begin_step()
            for s in streams:
                s.samples = SAMPLES
            plan = planner.plan_running(streams, len(streams))
            planner.settle((), lambda key: False)
    assert len(plan.throttled) == 4096
    assert collections == []
