"""The fairness benchmark's measure: service per window, backlog, and the gap between tenants."""

from __future__ import annotations

import random

import pytest

from tokenpace.bench._service import Request, service_difference, service_windows
from tokenpace.bench.fairness import LONG, SHORT, Load, Shape, workloads


def _steady(tenant: str, sent: float, first: float, tokens: int, gap: float,
            prompt: int = 10) -> Request:
    return Request(tenant, sent, prompt, [first + i * gap for i in range(tokens)])


def test_prompt_is_credited_at_the_first_token_and_outputs_as_they_arrive() -> None:
    req = _steady("a", sent=0.0, first=1.5, tokens=4, gap=0.5, prompt=10)  # 1.5 2.0 2.5 3.0
    w = service_windows([req], ["a"], 0.0, 4.0, 1.0, prompt_cost=1.0, completion_cost=2.0)
    assert w.rates["a"] == [0.0, 10 + 2.0, 4.0, 2.0]
    assert w.midpoints() == [0.5, 1.5, 2.5, 3.5]


def test_tokens_outside_the_span_are_ignored() -> None:
    req = _steady("a", sent=-1.0, first=-0.5, tokens=10, gap=1.0, prompt=0)  # -0.5 .. 8.5
    w = service_windows([req], ["a"], 0.0, 4.0, 2.0, prompt_cost=1.0, completion_cost=1.0)
    assert w.rates["a"] == [1.0, 1.0]  # two tokens per 2 s window


def test_backlog_is_the_time_between_sending_and_the_first_token() -> None:
    reqs = [
        _steady("a", sent=0.0, first=1.0, tokens=1, gap=0.1),
        _steady("a", sent=0.5, first=1.5, tokens=1, gap=0.1),  # overlaps: union is 0.0-1.5
        Request("a", sent=3.5, prompt_tokens=5),  # never started: backlogged to the end
    ]
    w = service_windows(reqs, ["a"], 0.0, 4.0, 1.0, prompt_cost=1.0, completion_cost=1.0)
    assert w.backlogged["a"] == pytest.approx([1.0, 0.5, 0.0, 0.5])


def test_gap_is_taken_only_where_both_tenants_are_backlogged() -> None:
    # a is served 3 units/s and b 1 unit/s for 4 s; b waits only in the first two windows.
    reqs = [Request("a", 0.0, 0, [i / 3 for i in range(12)]),
            Request("a", 0.0, 0, []),  # a always has one waiting
            Request("b", 0.0, 0, [float(i) for i in range(4)]),
            Request("b", 0.0, 0, [2.0]),  # b's second request starts at 2.0
            ]
    w = service_windows(reqs, ["a", "b"], 0.0, 4.0, 1.0, prompt_cost=1.0, completion_cost=1.0)
    assert w.backlogged["b"] == [1.0, 1.0, 0.0, 0.0]
    diff = service_difference(w, {"a": 1.0, "b": 1.0})
    assert diff["windows"] == 2
    assert diff["max"] == pytest.approx(2.0) and diff["mean"] == pytest.approx(2.0)
    assert diff["max_relative"] == pytest.approx(0.5)  # (3 - 1) / (3 + 1)


def test_weights_divide_the_service_before_comparing() -> None:
    reqs = [Request("a", 0.0, 0, [i / 2 for i in range(8)]), Request("a", 0.0, 0, []),
            Request("b", 0.0, 0, [float(i) for i in range(4)]), Request("b", 0.0, 0, [])]
    w = service_windows(reqs, ["a", "b"], 0.0, 4.0, 2.0, prompt_cost=1.0, completion_cost=1.0)
    assert service_difference(w, {"a": 2.0, "b": 1.0})["max"] == pytest.approx(0.0)
    assert service_difference(w, {"a": 1.0, "b": 1.0})["max"] == pytest.approx(1.0)


def test_no_common_backlog_gives_no_figure() -> None:
    reqs = [Request("a", 0.0, 0, [0.1]), Request("b", 0.0, 0, [0.2])]
    w = service_windows(reqs, ["a", "b"], 0.0, 2.0, 1.0, prompt_cost=1.0, completion_cost=1.0)
    assert service_difference(w, {"a": 1.0, "b": 1.0}) == {
        "windows": 0, "max": None, "mean": None, "max_relative": None, "mean_relative": None}


def test_bad_windows_are_refused() -> None:
    with pytest.raises(ValueError):
        service_windows([], ["a"], 0.0, 1.0, 0.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        service_windows([], ["a"], 1.0, 1.0, 1.0, 1.0, 1.0)


def test_arrivals_follow_the_demand_and_skip_off_phases() -> None:
    load = Load("b", Shape(50, 50), demand=0.5, period_s=10.0)  # cost 150 at prompt 1, out 2
    times = load.arrivals(capacity=3000.0, duration=400.0, rng=random.Random(7))
    assert all(load.is_on(t) and 0 <= t < 400 for t in times)
    assert all((t // 10) % 2 == 1 for t in times)  # off first, then on
    on_time = 200.0
    assert len(times) / on_time == pytest.approx(0.5 * 3000 / 150, rel=0.1)  # 10 per second


def test_drawn_lengths_spread_around_the_mean() -> None:
    rng = random.Random(3)
    draws = [SHORT.draw(rng) for _ in range(500)]
    assert {len(p) for p, _ in draws} <= set(range(16, 49))
    assert {o for _, o in draws} <= set(range(16, 49))
    assert all(3 <= tok < 512 for p, _ in draws for tok in p)
    assert 30 < sum(o for _, o in draws) / len(draws) < 34


def test_short_and_long_tenants_send_at_the_same_request_rate() -> None:
    short_long = next(w for w in workloads(10.0) if w.name == "short_long")
    a, b = short_long.loads
    assert a.shape == SHORT and b.shape == LONG
    assert a.demand / a.shape.cost == pytest.approx(b.demand / b.shape.cost)
