"""Properties of the GCRA output-token limiter, driven by an injected fake clock."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenpace.pacing import OutputRateLimiter, UserRateLimits

NS = 1_000_000_000
# The specification's burst tolerance, written out rather than imported so that a change
# of the implementation's constant fails these tests.
BURST_NS = 100_000_000


class FakeClock:
    def __init__(self, now_ns: int = 1_000 * NS) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, ns: int) -> None:
        self.now_ns += ns


def make(rates: dict[str, float], default: float | None = None) -> tuple[OutputRateLimiter, FakeClock]:
    clock = FakeClock()
    return OutputRateLimiter(UserRateLimits(default, rates), clock_ns=clock), clock


rates_st = st.one_of(
    st.sampled_from([0.5, 1.0, 2.5, 3.0, 7.0, 20.0, 100.0, 333.3, 1000.0]),
    st.floats(min_value=0.01, max_value=5000.0, allow_nan=False, allow_infinity=False),
)

# One operation: ("advance", ns) | ("take", n_times) | ("refund", n_times) | ("cleanup", 0)
op_st = st.one_of(
    st.tuples(st.just("advance"), st.integers(min_value=0, max_value=3 * BURST_NS)),
    st.tuples(st.just("advance"), st.integers(min_value=0, max_value=5_000_000)),
    st.tuples(st.just("take"), st.integers(min_value=1, max_value=20)),
    st.tuples(st.just("refund"), st.integers(min_value=1, max_value=5)),
    st.tuples(st.just("cleanup"), st.just(0)),
)


@dataclass
class Trace:
    """Net grants (time of each token not refunded) as the caller sees them."""

    grants: list[int]

    def max_in_window(self, window_ns: int) -> int:
        best, lo = 0, 0
        for hi, t in enumerate(self.grants):
            while t - self.grants[lo] > window_ns:
                lo += 1
            best = max(best, hi - lo + 1)
        return best


def run_ops(limiter: OutputRateLimiter, clock: FakeClock, user: str, ops: list[tuple[str, int]]) -> Trace:
    grants: list[int] = []
    unrefunded = 0
    for kind, arg in ops:
        if kind == "advance":
            clock.advance(arg)
        elif kind == "take":
            for _ in range(arg):
                if limiter.try_take(user):
                    grants.append(clock.now_ns)
                    unrefunded += 1
        elif kind == "refund":
            for _ in range(min(arg, unrefunded)):
                limiter.refund(user)
                grants.pop()  # a refund returns the most recent token not yet returned
                unrefunded -= 1
        else:
            limiter.cleanup_idle_users()
    return Trace(grants)


@settings(max_examples=300, deadline=None)
@given(rate=rates_st, ops=st.lists(op_st, max_size=120), window_ms=st.integers(1, 3000))
def test_window_bound_under_any_call_refund_and_clock_pattern(rate, ops, window_ms):
    limiter, clock = make({"u": rate})
    trace = run_ops(limiter, clock, "u", ops)
    window_ns = window_ms * 1_000_000
    bound = Fraction(window_ns + BURST_NS, NS) * Fraction(repr(rate)) + 1
    assert trace.max_in_window(window_ns) <= bound


@settings(max_examples=200, deadline=None)
@given(rate=rates_st, steps=st.lists(st.integers(0, BURST_NS), min_size=1, max_size=200))
def test_work_conservation_for_a_user_asking_all_the_time(rate, steps):
    """Asking at every step (steps at most the burst apart) yields >= rate x W - 1 tokens."""
    limiter, clock = make({"u": rate})
    start = clock.now_ns
    granted = 0
    for dt in steps:
        clock.advance(dt)
        while limiter.try_take("u"):
            granted += 1
        elapsed = Fraction(clock.now_ns - start, NS)
        assert granted >= elapsed * Fraction(repr(rate)) - 1


@settings(max_examples=200, deadline=None)
@given(rate=rates_st, ops=st.lists(op_st, max_size=80), probes=st.lists(op_st, max_size=60),
       refund_points=st.lists(st.integers(0, 200), max_size=10))
def test_refund_is_exact(rate, ops, probes, refund_points):
    """A grant refunded at once leaves the limiter deciding exactly as if never taken."""
    a, clock_a = make({"u": rate})
    b, clock_b = make({"u": rate})
    points = set(refund_points)
    for i, op in enumerate(ops):
        if i in points and a.try_take("u"):
            a.refund("u")
        for lim, clk in ((a, clock_a), (b, clock_b)):
            run_ops(lim, clk, "u", [op])
    for op in probes:
        ta = run_ops(a, clock_a, "u", [op])
        tb = run_ops(b, clock_b, "u", [op])
        assert ta.grants == tb.grants
        assert a.ready_at_ns("u") == b.ready_at_ns("u")


@pytest.mark.parametrize("rate", [0.5, 2.5, 10.0, 100.0, 333.3])
@pytest.mark.parametrize("refunds", [1, 2, 5])
def test_refunded_tokens_can_be_taken_again_exactly_once(rate, refunds):
    limiter, clock = make({"u": rate})
    clock.advance(1234567)
    burst = 0
    while limiter.try_take("u"):
        burst += 1
    refunds = min(refunds, burst)
    for _ in range(refunds):
        limiter.refund("u")
    again = 0
    while limiter.try_take("u"):
        again += 1
    assert again == refunds


def test_refund_without_a_grant_is_ignored():
    limiter, clock = make({"u": 10.0})
    assert limiter.try_take("u") and limiter.try_take("u")
    assert not limiter.try_take("u")
    for _ in range(5):
        limiter.refund("u")  # only two grants exist to return
    assert sum(limiter.try_take("u") for _ in range(10)) == 2


@settings(max_examples=300, deadline=None)
@given(rate=rates_st, ops=st.lists(op_st, max_size=80))
def test_ready_at_is_the_first_instant_a_take_succeeds(rate, ops):
    limiter, clock = make({"u": rate})
    run_ops(limiter, clock, "u", ops)
    ready = limiter.ready_at_ns("u")
    assert ready >= clock.now_ns
    if ready > clock.now_ns:
        early = copy.deepcopy(limiter)
        early.clock_ns.now_ns = ready - 1  # type: ignore[attr-defined]
        assert not early.try_take("u")
    on_time = copy.deepcopy(limiter)
    on_time.clock_ns.now_ns = ready  # type: ignore[attr-defined]
    assert on_time.try_take("u")


@settings(max_examples=300, deadline=None)
@given(rate=rates_st, ops=st.lists(op_st, max_size=80))
def test_room_is_what_a_take_of_any_size_grants_and_takes_nothing(rate, ops):
    limiter, clock = make({"u": rate})
    run_ops(limiter, clock, "u", ops)
    room = limiter.room("u", clock.now_ns)
    assert room == limiter.room("u", clock.now_ns)  # nothing taken
    assert limiter.take("u", 10**9, clock.now_ns) == room
    assert limiter.room("unpaced", clock.now_ns) is None


@settings(max_examples=200, deadline=None)
@given(rate=rates_st, ops=st.lists(op_st, max_size=120))
def test_cleanup_never_changes_a_decision(rate, ops):
    a, clock_a = make({"u": rate, "v": rate * 2})
    b, clock_b = make({"u": rate, "v": rate * 2})
    for op in ops:
        kind = op[0]
        if kind == "cleanup":
            a.cleanup_idle_users()  # only a cleans up
        elif kind == "advance":
            clock_a.advance(op[1])
            clock_b.advance(op[1])
        else:
            for user in ("u", "v"):
                assert run_ops(a, clock_a, user, [op]).grants == run_ops(b, clock_b, user, [op]).grants
        for user in ("u", "v"):
            assert a.ready_at_ns(user) == b.ready_at_ns(user)


@settings(max_examples=150, deadline=None)
@given(rate=rates_st, other_rate=rates_st, ops=st.lists(op_st, max_size=80),
       other_ops=st.lists(st.sampled_from(["take", "refund"]), max_size=80))
def test_users_are_independent(rate, other_rate, ops, other_ops):
    a, clock_a = make({"u": rate, "v": other_rate})
    b, clock_b = make({"u": rate, "v": other_rate})
    for i, op in enumerate(ops):
        if i < len(other_ops):
            if other_ops[i] == "take":
                a.try_take("v")
            else:
                a.refund("v")
        ta = run_ops(a, clock_a, "u", [op])
        tb = run_ops(b, clock_b, "u", [op])
        assert ta.grants == tb.grants
        assert a.ready_at_ns("u") == b.ready_at_ns("u")


@pytest.mark.parametrize(
    ("rate", "step_ns", "steps"),
    [
        (0.5, 37_000_001, 20_000),   # fractional, slow
        (2.5, 99_999_999, 20_000),   # fractional
        (7.0, 13_000_000, 20_000),   # interval 1/7 s is not a whole number of ns
        (123_456.5, BURST_NS, 82),   # a million tokens in 8.1 simulated seconds
    ],
)
def test_no_drift_over_many_tokens(rate, step_ns, steps):
    """Asking all the time, the grant count equals the exact GCRA count at every step."""
    limiter, clock = make({"u": rate})
    start = clock.now_ns
    granted = 0
    exact_rate = Fraction(repr(rate))
    for _ in range(steps):
        while limiter.try_take("u"):
            granted += 1
        expected = math.floor(Fraction(clock.now_ns - start + BURST_NS, NS) * exact_rate) + 1
        assert granted == expected
        clock.advance(step_ns)
    if rate > 100_000:
        assert granted >= 1_000_000


def test_seed_timeline_limit_10_four_streams_30ms_steps():
    """The seed's hand-worked timeline: 2 grants at t=0, then one every 100 ms."""
    limiter, clock = make({"a": 10.0})
    per_step = []
    for _ in range(11):
        n = 0
        for _stream in range(4):
            if limiter.try_take("a"):
                n += 1
        per_step.append(n)
        clock.advance(30_000_000)
    assert per_step == [2, 0, 0, 0, 1, 0, 0, 1, 0, 0, 1]


def test_unpaced_user_is_never_refused_and_keeps_no_state():
    limiter, _ = make({"paced": 1.0}, default=None)
    assert all(limiter.try_take("free") for _ in range(10_000))
    limiter.refund("free")
    assert limiter.tracked_users() == 0


def test_default_rate_applies_to_unlisted_users():
    limiter, _ = make({"fast": 100.0}, default=10.0)
    assert sum(limiter.try_take("someone") for _ in range(100)) == 2
    assert sum(limiter.try_take("fast") for _ in range(100)) == 11


def test_cleanup_drops_only_idle_users():
    limiter, clock = make({}, default=10.0)
    limiter.try_take("old")
    clock.advance(NS)
    limiter.try_take("new")
    assert limiter.cleanup_idle_users() == 1
    assert limiter.tracked_users() == 1


def test_set_limits_keeps_the_debt_of_a_user():
    limiter, clock = make({"u": 10.0})
    while limiter.try_take("u"):
        pass
    limiter.set_limits(UserRateLimits(None, {"u": 20.0}))
    assert not limiter.try_take("u")  # a reload must not hand out a fresh burst
    assert limiter.ready_at_ns("u") > clock.now_ns
    limiter.set_limits(UserRateLimits(None, {}))
    assert limiter.try_take("u") and limiter.tracked_users() == 0


@settings(max_examples=300, deadline=None)
@given(rate=rates_st, ops=st.lists(op_st, max_size=80))
def test_take_n_is_n_single_takes_at_one_instant(rate, ops):
    """``take(user, n, now)`` (one call per user per step) grants exactly what n calls of
    ``try_take`` at that instant would, and leaves the same state behind."""
    one, clock_one = make({"u": rate})
    many, clock_many = make({"u": rate})
    for kind, arg in ops:
        if kind == "advance":
            clock_one.advance(arg)
            clock_many.advance(arg)
        elif kind == "take":
            singles = sum(one.try_take("u") for _ in range(arg))
            assert many.take("u", arg, clock_many.now_ns) == singles
        elif kind == "refund":
            for _ in range(arg):
                one.refund("u")
                many.refund("u")
        else:
            one.cleanup_idle_users()
            many.cleanup_idle_users()
        assert one.ready_at_ns("u") == many.ready_at_ns("u")


def test_take_for_an_unpaced_user_counts_nothing():
    limiter, clock = make({}, default=None)
    assert limiter.take("u", 5, clock.now_ns) is None
    assert limiter.tracked_users() == 0


class ReferenceGcra:
    """GCRA written out with exact fractions and a refund count over all grants ever
    made (the limiter counts only since its TAT last restarted from the clock)."""

    def __init__(self, rate: float, now_ns: int) -> None:
        self.interval = Fraction(NS) / Fraction(repr(rate))
        self.tat = Fraction(now_ns)
        self.refundable = 0

    def take(self, now_ns: int) -> bool:
        tat = max(self.tat, Fraction(now_ns))
        if tat - now_ns > BURST_NS:
            return False
        self.tat = tat + self.interval
        self.refundable += 1
        return True

    def refund(self, now_ns: int) -> None:
        if self.refundable:
            self.refundable -= 1
            self.tat = max(self.tat - self.interval, Fraction(now_ns))


@settings(max_examples=300, deadline=None)
@given(rate=rates_st, ops=st.lists(op_st, max_size=150))
def test_refund_count_restarting_with_the_tat_decides_like_counting_every_grant(rate, ops):
    limiter, clock = make({"u": rate})
    reference = ReferenceGcra(rate, clock.now_ns)
    for kind, arg in ops:
        if kind == "advance":
            clock.advance(arg)
        elif kind == "take":
            for _ in range(arg):
                assert limiter.try_take("u") == reference.take(clock.now_ns)
        elif kind == "refund":  # any number, also of grants made long ago
            for _ in range(arg):
                limiter.refund("u")
                reference.refund(clock.now_ns)
        granted = limiter.take("u", 3, clock.now_ns)  # take_claims keeps the count alike
        for _ in range(granted or 0):
            assert reference.take(clock.now_ns)
        if granted is not None and granted < 3:
            assert not reference.take(clock.now_ns)  # stopped where GCRA stops
        for _ in range(granted or 0):
            limiter.refund("u")
            reference.refund(clock.now_ns)


def test_owed_tokens_push_the_user_past_its_burst_and_come_back_exactly() -> None:
    """``take_owed`` counts tokens that were handed out without asking: the user is
    refused until it has paid them back, and a refund returns them exactly."""
    from tokenpace.pacing import DraftBook, StepPlanner

    clock = [10**12]
    limiter = OutputRateLimiter(UserRateLimits(10.0), lambda: clock[0])
    assert limiter.take_owed("u", 5, clock[0])  # 0.5 s of tokens at 10 tok/s
    assert not limiter.try_take("u")
    clock[0] += 400_000_000  # 0.4 s: 0.1 s still owed, within the burst tolerance
    assert limiter.try_take("u")
    limiter.refund("u", 2)
    assert limiter.take("u", 3, clock[0]) == 2  # the refunds came back, no more
    # A user without a rate: nothing is counted, so nothing is to be given back later.
    planner = StepPlanner(OutputRateLimiter(UserRateLimits(None, {"p": 10.0}), lambda: clock[0]))
    book = DraftBook(planner.limiter, planner.inner)
    unpaced = planner.open_stream("r1", "free")
    assert book.owe(unpaced, 3) is False and book.granted == 0
    assert unpaced.stats.tokens == 0


def test_has_quota_says_what_try_take_would_do() -> None:
    clock = [10**12]
    limiter = OutputRateLimiter(UserRateLimits(None, {"u": 10.0}), clock_ns=lambda: clock[0])
    assert limiter.has_quota("u") and limiter.has_quota("unpaced")
    while limiter.has_quota("u"):
        assert limiter.try_take("u")
    assert not limiter.try_take("u")
    clock[0] = limiter.ready_at_ns("u")
    assert limiter.has_quota("u") and limiter.try_take("u")


def test_a_steps_drafts_granted_and_settled_at_once_leave_every_bucket_as_one_by_one() -> None:
    """``DraftBook.grant_all`` and ``settle`` (a step's streams in one loop, the GCRA
    arithmetic inline) leave each user's state, the counts and the stats exactly as
    ``grant`` and ``give_back`` called stream by stream do, whatever the rates, drafts
    and deliveries: random steps, users near and far from their rate, unpaced ones."""
    import random

    from tokenpace.pacing import DraftBook, StepPlanner

    rng = random.Random(5)
    rates = {f"u{i}": rng.choice([2.5, 10.0, 40.0, 1e9]) for i in range(12)}

    def world() -> tuple[list[int], StepPlanner, DraftBook, list]:
        clock = [10**12]
        planner = StepPlanner(OutputRateLimiter(UserRateLimits(None, rates), lambda: clock[0]))
        book = DraftBook(planner.limiter, planner.inner)
        users = [*rates, "free"]
        streams = [planner.open_stream(f"r{i}", users[i % len(users)]) for i in range(30)]
        return clock, planner, book, streams

    a_clock, a_planner, a_book, a_streams = world()
    b_clock, b_planner, b_book, b_streams = world()
    for _ in range(300):
        step = rng.randrange(1, 60_000_000)
        a_clock[0] += step
        b_clock[0] += step
        now = a_clock[0]
        wants = [rng.choice([0, 1, 3, 5]) for _ in a_streams]
        delivered = [rng.randrange(0, 7) for _ in a_streams]
        for s, t, w in zip(a_streams, b_streams, wants):
            s.drafts = t.drafts = w
        paced, granted, cut = a_book.grant_all(a_streams, now)
        expected = []
        for t, w in zip(b_streams, wants):
            got = b_book.grant(t, w, now) if w else None
            if got is not None:
                expected.append((t.key, got))
        assert [(s.key, g) for s, g in zip(paced, granted)] == expected
        assert cut == any(g < s.drafts for s, g in zip(paced, granted))
        index = {s.key: i for i, s in enumerate(a_streams)}
        got_back = [min(delivered[index[s.key]], g + 1) for s, g in zip(paced, granted)]
        a_book.settle(paced, granted, got_back, 1, now)
        for (key, g), n in zip(expected, got_back):
            back = g - max(n - 1, 0)
            b_book.give_back(b_streams[index[key]], back, now)
        for user in rates:
            ba, bb = a_planner.limiter._buckets.get(user), b_planner.limiter._buckets.get(user)
            assert (ba is None) == (bb is None)
            if ba is not None:
                assert (ba.tat, ba.refundable) == (bb.tat, bb.refundable), user
        assert (a_book.granted, a_book.returned) == (b_book.granted, b_book.returned)
        assert [s.stats.tokens for s in a_streams] == [t.stats.tokens for t in b_streams]
        assert [s.stats.refunds for s in a_streams] == [t.stats.refunds for t in b_streams]
    assert a_book.granted > 0 and a_book.returned > 0
