"""StepPlanner.idle_wait_seconds: how long no request can run (pure, fake clocks)."""

from __future__ import annotations

import pytest

from tokenpace.pacing import MAX_IDLE_WAIT_S, OutputRateLimiter, StepPlanner, UserRateLimits


class TickingClock:
    """Advances 1 us on every reading, like a real clock between two calls."""

    def __init__(self) -> None:
        self.ns = 10**12

    def __call__(self) -> int:
        self.ns += 1_000
        return self.ns


def _planner(clock: TickingClock) -> StepPlanner:
    limits = UserRateLimits(10.0, {"fast": 1e6})
    return StepPlanner(OutputRateLimiter(limits, clock_ns=clock))


def test_a_ready_user_means_no_wait_even_on_a_moving_clock() -> None:
    clock = TickingClock()
    planner = _planner(clock)
    assert planner.idle_wait_seconds(["fast"]) == 0.0
    assert planner.idle_wait_seconds(["slow"]) == 0.0  # never charged: has its burst
    assert planner.idle_wait_seconds([]) == 0.0


def test_wait_until_the_earliest_user_is_ready_capped_at_a_second() -> None:
    clock = TickingClock()
    planner = _planner(clock)
    while planner.limiter.try_take("slow"):  # spend the burst
        pass
    wait = planner.idle_wait_seconds(["slow", "slow"])
    ready_in = (planner.limiter.ready_at_ns("slow") - clock.ns) / 1e9
    assert wait == pytest.approx(ready_in, abs=1e-4)  # 10 tok/s: ~0.1 s, in one wait
    clock.ns = planner.limiter.ready_at_ns("slow") - 3 * 10**9
    assert planner.idle_wait_seconds(["slow"]) == MAX_IDLE_WAIT_S == 1.0
    clock.ns = planner.limiter.ready_at_ns("slow") - 20_000_000  # 20 ms before ready
    assert planner.idle_wait_seconds(["slow"]) == pytest.approx(0.02, abs=1e-4)
    assert planner.idle_wait_seconds(["slow", "fast"]) == 0.0
    assert planner.idle_wait_seconds(["slow", None]) == 0.0  # a step that needs no quota
