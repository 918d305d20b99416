"""``paced_rate`` (the e2e tests' rate at the engine) against the real limiter, fake clock.

An engine that steps every 2 ms serves a backlogged user through ``OutputRateLimiter``;
``paced_rate`` must give the limit back despite stalls in which nothing was dispatched,
and must not forgive a gap in which another user got tokens (a held user is a defect).
"""

from __future__ import annotations

import pytest

from tests.e2e._engine_log import paced_rate
from tokenpace.pacing import OutputRateLimiter, UserRateLimits

STEP_NS = 2_000_000


def _serve(limit: float, seconds: float, stalls: dict[int, int],
           held: range = range(0), slow: float = 1.0) -> tuple[list[float], list[float]]:
    """Dispatch instants (s) of user ``u`` and of everyone; ``stalls``: step -> ns lost;
    in steps ``held`` the engine runs user ``other`` only (as a defective scheduler would);
    ``slow``: the limiter runs at ``limit / slow`` (a defective limiter)."""
    now = [0]
    limiter = OutputRateLimiter(UserRateLimits.from_json(f'{{"u": {limit / slow}, "other": 1e6}}',
                                                         default=1), clock_ns=lambda: now[0])
    mine, everyone = [], []
    for step in range(int(seconds * 1e9 / STEP_NS)):
        now[0] += STEP_NS + stalls.get(step, 0)
        if step not in held and limiter.try_take("u"):
            mine.append(now[0] / 1e9)
            everyone.append(now[0] / 1e9)
        if step in held and limiter.try_take("other"):
            everyone.append(now[0] / 1e9)
    return mine, everyone


def test_steady_engine_gives_the_limit() -> None:
    mine, everyone = _serve(20, 10, {})
    rate = paced_rate(mine, 20, everyone)
    assert rate.stalls == 0 and rate.paced_rate == pytest.approx(20, rel=0.01)
    assert rate.paced_rate <= 20


def test_engine_absences_are_left_out_and_gcra_bound_still_holds() -> None:
    stalls = {500: 400_000_000, 2000: 600_000_000, 3000: 150_000_000}
    stalls.update({s: 80_000_000 for s in range(4000, 4050, 5)})  # a cluster of short ones
    mine, everyone = _serve(100, 12, stalls)
    rate = paced_rate(mine, 100, everyone)
    assert rate.rate < 0.95 * 100  # what the user received
    assert rate.stalls >= 3
    assert 0.98 * 100 <= rate.paced_rate <= 100 * (1 + 1e-9)  # GCRA exact, but for rounding


def test_a_user_held_while_the_engine_runs_others_is_not_forgiven() -> None:
    mine, everyone = _serve(100, 10, {}, held=range(1000, 1300))  # 0.6 s held
    rate = paced_rate(mine, 100, everyone)
    assert rate.stalls == 0 and rate.paced_rate < 0.95 * 100


@pytest.mark.parametrize("slow", [1.05, 1.1, 1.2, 1.5, 3.0])
@pytest.mark.parametrize(("limit", "tokens"), [(20, 800), (40, 120), (20, 60), (10, 40)])
def test_a_slow_limiter_alone_on_the_engine_is_not_forgiven(slow: float, limit: float,
                                                            tokens: int) -> None:
    """The token counts and rates of the end-to-end tests."""
    mine, everyone = _serve(limit, tokens * slow / limit + 0.5, {}, slow=slow)
    mine = mine[:tokens]
    rate = paced_rate(mine, limit, everyone)
    assert rate.paced_rate < 0.97 * limit, rate


def test_a_slow_limiter_next_to_a_busy_user_is_not_forgiven() -> None:
    """Its tokens restart while the other user's run: nearly all of them, none forgiven."""
    mine, everyone = _serve(20, 10, {}, slow=1.05)
    everyone = sorted(everyone + [i * 0.003 + 0.001 for i in range(3300)])
    rate = paced_rate(mine, 20, everyone)
    assert rate.restarts > 0.25 * len(mine) and rate.paced_rate < 0.97 * 20, rate


def test_a_slow_limiter_is_not_forgiven_by_the_engine_absences_around_it() -> None:
    """Its drift uses up the burst, then restarts by less than half an interval: never
    forgiven. (An absence forgives the drift that used up the burst before it, at most
    0.1 s each: absences more often than that drift hide a slow limiter.)"""
    stalls = {s: 300_000_000 for s in range(100, 12000, 2500)}  # 0.3 s every 5 s of steps
    mine, everyone = _serve(100, 30, stalls, slow=1.05)
    rate = paced_rate(mine, 100, everyone)
    assert rate.stalls >= 4 and rate.paced_rate < 0.97 * 100, rate
