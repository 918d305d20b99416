"""`bench gateway`'s paired comparison: alternating order, the same work in both halves of
a pair, differences taken within pairs, and time to first token defined alike on every path.

Fake calls and a fake clock: no server, no timing."""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Awaitable, Callable

import pytest

from tokenpace.bench import _control
from tokenpace.bench._load import StreamRecord, record_chunk
from tokenpace.bench._paired import (
    bootstrap_interval,
    difference_summary,
    pair_order,
    ratio_summary,
    run_pairs,
)
from tokenpace.bench.gateway import DIRECT_SALT, body, prompt_for, work


class FakeEngine:
    """Answers after a latency that moves in phases shared by both paths (what a busy
    machine does), plus a fixed cost per path; records the order of the calls."""

    def __init__(self, phases: list[float], cost: dict[str, float]) -> None:
        self.phases = phases
        self.cost = cost
        self.calls: list[tuple[str, int]] = []

    def path(self, name: str) -> Callable[[int], Awaitable[float]]:
        async def call(i: int) -> float:
            self.calls.append((name, i))
            return self.phases[i] + self.cost[name]
        return call


def test_pairs_alternate_order_and_share_their_index() -> None:
    engine = FakeEngine([0.0] * 6, {"direct": 0.0, "gateway": 0.0})
    asyncio.run(run_pairs({"direct": engine.path("direct"), "gateway": engine.path("gateway")}, 6))
    assert engine.calls == [("direct", 0), ("gateway", 0), ("gateway", 1), ("direct", 1),
                            ("direct", 2), ("gateway", 2), ("gateway", 3), ("direct", 3),
                            ("direct", 4), ("gateway", 4), ("gateway", 5), ("direct", 5)]
    firsts = [pair_order(["direct", "gateway"], i)[0] for i in range(100)]
    assert firsts.count("direct") == firsts.count("gateway") == 50


def test_three_paths_take_every_position_and_precede_each_other_equally_often() -> None:
    # direct, gateway and the gateway with Redis: reversing alone would keep the middle
    # path in the middle, so whatever the first call leaves behind would never fall on it.
    names = ["direct", "gateway", "gateway_redis"]
    orders = [pair_order(names, i) for i in range(60)]
    assert all(sorted(o) == sorted(names) for o in orders)
    for name in names:
        for position in range(3):
            assert sum(o[position] == name for o in orders) == 20, (name, position)
    for a in names:
        for b in names:
            if a != b:
                assert sum(o.index(a) < o.index(b) for o in orders) == 30, (a, b)
    engine = FakeEngine([0.0] * 6, {n: 0.0 for n in names})
    out = asyncio.run(run_pairs({n: engine.path(n) for n in names}, 6))
    assert all(len(v) == 6 for v in out.values())
    assert [i for _, i in engine.calls] == [i for i in range(6) for _ in names]  # per pair


def test_three_paths_paired_two_by_two_recover_each_cost() -> None:
    # The engine's phases cancel in every comparison within a pair: the Redis gateway's
    # 3 ms against direct and its 2 ms against the in-process gateway.
    phases = [5.0] * 45 + [21.0] * 55
    engine = FakeEngine(phases, {"direct": 0.0, "gateway": 1.0, "gateway_redis": 3.0})
    out = asyncio.run(run_pairs({n: engine.path(n) for n in ("direct", "gateway",
                                                              "gateway_redis")}, len(phases)))
    assert difference_summary(out["gateway_redis"], out["direct"])["p50"]["value"] == 3.0
    adds = difference_summary(out["gateway_redis"], out["gateway"])
    assert adds["p50"]["value"] == 2.0 and adds["p99"]["value"] == 2.0


def test_paired_difference_recovers_the_cost_that_independent_medians_get_wrong() -> None:
    # The last run's shape: the engine flips between ~5 ms and ~21 ms phases, and the two
    # paths' own medians land on different phases. The gateway costs 1 ms in every pair.
    phases = [5.0] * 45 + [21.0] * 55
    phases_gateway = [5.0] * 55 + [21.0] * 45  # unpaired: another stretch of the same run
    medians = statistics.median([p + 1.0 for p in phases_gateway]) - statistics.median(phases)
    assert medians < 0  # what the old bench reported: a proxy that saves time

    engine = FakeEngine(phases, {"direct": 0.0, "gateway": 1.0})
    out = asyncio.run(run_pairs({"direct": engine.path("direct"),
                                 "gateway": engine.path("gateway")}, len(phases)))
    summary = difference_summary(out["gateway"], out["direct"])
    assert summary["pairs"] == 100
    assert summary["p50"]["value"] == 1.0 and summary["p50"]["interval95"] == [1.0, 1.0]
    assert summary["p99"]["value"] == 1.0 and summary["p99_shift"]["value"] == 1.0


def test_difference_summary_reports_noise_both_ways() -> None:
    gateway = [10.0, 11.0, 30.0, 12.0, 10.0, 11.0]
    direct = [9.0, 10.0, 10.0, 28.0, 9.0, 10.0]  # a phase change inside pairs 2 and 3
    summary = difference_summary(gateway, direct)
    assert summary["values"] == [1.0, 1.0, 20.0, -16.0, 1.0, 1.0]
    assert summary["p50"]["value"] == 1.0
    assert summary["p99"]["value"] == 20.0 and summary["p1"] == -16.0
    low, high = summary["p50"]["interval95"]
    assert -16.0 <= low <= 1.0 <= high <= 20.0
    with pytest.raises(ValueError):
        difference_summary([1.0, 2.0], [1.0])


def test_ratio_summary_is_per_pair() -> None:
    # Direct varies 8x from round to round; the gateway is 1.1x of it in every pair.
    direct = [40.0, 320.0, 60.0, 118.0, 290.0]
    summary = ratio_summary([d * 1.1 for d in direct], direct)
    assert summary["median"] == 1.1 and summary["interval95"] == [1.1, 1.1]
    assert summary["pairs"] == 5


def test_bootstrap_interval_is_reproducible_and_narrows() -> None:
    values = [0.82, 0.86, 0.87, 0.89, 0.9, 0.99, 1.0, 1.03, 1.12, 1.27, 1.41, 1.42]
    low, high = bootstrap_interval(values, statistics.median)
    assert (low, high) == bootstrap_interval(values, statistics.median)
    assert low <= statistics.median(values) <= high
    m_low, m_high = bootstrap_interval(values * 5, statistics.median)
    assert m_high - m_low < high - low
    assert bootstrap_interval([3.0], statistics.median) == (3.0, 3.0)


def _chunk(text: str, ids: list[int] | None, usage: dict | None = None,
           choices: bool = True) -> bytes:
    chunk: dict = {"id": "x", "choices": []}
    if choices:
        choice: dict = {"index": 0, "text": text}
        if ids is not None:
            choice["token_ids"] = ids
        chunk["choices"] = [choice]
    if usage is not None:
        chunk["usage"] = usage
    return json.dumps(chunk).encode()


def test_first_token_is_the_first_generated_token_id_from_send() -> None:
    record = StreamRecord(user="u", start=100.0)
    # a chunk without token ids (a role-only chat chunk, an empty detokenizer hold-back
    # without ids) does not count; usage-only and [DONE] neither
    record_chunk(record, json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"},
                                                  "token_ids": []}]}).encode(), 100.004)
    record_chunk(record, _chunk("", None), 100.005)
    record_chunk(record, _chunk("a", [7], {"prompt_tokens": 3, "completion_tokens": 1}), 100.010)
    record_chunk(record, _chunk("bc", [8, 9]), 100.020)
    record_chunk(record, _chunk("", None, {"prompt_tokens": 3, "completion_tokens": 3},
                                choices=False), 100.030)
    record_chunk(record, b"[DONE]", 100.031)
    assert record.ttft == pytest.approx(0.010)
    assert record.token_times == [100.010, 100.020, 100.020]
    assert record.token_ids == [7, 8, 9]
    assert record.completion_tokens == 3


def test_both_paths_send_the_same_work() -> None:
    direct, gateway = work("direct"), work("gateway")
    # the same fields but the salt, which the gateway adds (64 hex digits, like the direct one)
    assert {k: v for k, v in direct.items() if k != "cache_salt"} == gateway
    assert len(DIRECT_SALT) == 64 and "cache_salt" not in gateway
    control = work(_control.PATH)  # the byte proxy's calls reach the engine as they are
    assert {k: v for k, v in control.items() if k != "cache_salt"} == gateway
    assert len(control["cache_salt"]) == 64 and control["cache_salt"] != DIRECT_SALT
    assert gateway["temperature"] == 0
    assert gateway["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    whole = body("gateway", "p", 16)
    assert {k: v for k, v in body("direct", "p", 16).items() if k != "cache_salt"} == whole
    assert whole["vllm_xargs"] == {"output_rate_user": "bench"}  # what the gateway writes
    assert whole["return_token_ids"] is True and whole["max_tokens"] == 16
    # one prompt per pair, the same in both halves; no two pairs share their first words
    assert prompt_for("n", 3) == prompt_for("n", 3)
    starts = {prompt_for("n", i)[:12] for i in range(200)}
    assert len(starts) == 200


def test_four_paths_take_turns_first_within_a_few_pairs() -> None:
    names = ["direct", "by_hand", "pool", "pinned"]
    orders = [pair_order(names, i) for i in range(8)]
    assert sorted(o[0] for o in orders[:4]) == sorted(names)
    assert all(sorted(o) == sorted(names) for o in orders)
    assert orders[4] != orders[0]  # the second cycle runs reversed
