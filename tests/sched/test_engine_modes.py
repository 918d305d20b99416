"""Pacing in the engine modes beyond the plainest one, on vLLM's real scheduler.

Speculative decoding has its own module (test_spec_decode.py). Here: pipeline parallel
(several batches in flight), and the paths through which prefill chunks are cut short by
something other than the token budget (the refund point must see those). Each test
checks the seed's promises: the GCRA bound over every window, streams that resume, an
unthrottled user unaffected, exact refunds.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.sched._harness import NS, Sim, make_sim, max_in_window

BURST_S = 0.1


def assert_rate(sim: Sim, user: str, rate: float, seconds: float) -> None:
    times = sim.delivered_times(user)
    assert len(times) >= rate * seconds - 2, (user, len(times))
    for window_s in (0.05, 0.5, 1.0, seconds):
        bound = (window_s + BURST_S) * rate + 1
        assert max_in_window(times, int(window_s * NS)) <= bound, (user, window_s)


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_parallel_batches_in_flight_share_one_quota(tiny_model, pp, tmp_path):
    """With ``pp`` batches in flight a request is scheduled again only once its step's
    results are back, so it is charged once per token; a paced user's four streams stay
    within its bound, and an unpaced user beside it gets what stock vLLM gives it."""
    log = tmp_path / "events.jsonl"
    pacing = {"default_user_output_tokens_per_second": 1e6,
              "user_output_tokens_per_second": {"slow": 30}, "event_log": str(log)}
    runs = {}
    for paced_class in (True, False):
        sim = make_sim(tiny_model, pacing=pacing if paced_class else None,
                       paced_class=paced_class, pipeline_parallel=pp)
        for i in range(4):
            sim.add(f"s{i}", "slow", max_tokens=3000)
        sim.add("f", "fast", max_tokens=300)
        sim.run(5)
        sim.drain()
        runs[paced_class] = sim
    paced = runs[True]
    assert_rate(paced, "slow", 30, 5)
    assert min(paced.tokens[f"s{i}"] for i in range(4)) >= 30 * 5 / 4 - 3, "streams take turns"
    # One token per ``pp`` steps per request: pipeline parallel's own cadence.
    assert paced.tokens["f"] == runs[False].tokens["f"] >= 500 // pp - 2
    assert paced.delivered_times("fast") == runs[False].delivered_times("fast")
    paced.scheduler.shutdown()
    net: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        event = json.loads(line)
        net[event["request_id"]] += 1 if event["event"] == "charge" else -1
    assert +net == +Counter(paced.tokens), "charges net of refunds = tokens delivered"


def test_decode_side_of_disaggregated_prefill(tiny_model):
    """Requests whose prompt KV was computed elsewhere (vLLM's DecodeBenchConnector plays
    the prefill side: every prompt but its last token arrives computed) sample at their
    admission step: that step is charged, a paced user's four streams keep the bound and
    resume, and an unpaced user beside them is scheduled exactly as by stock vLLM."""
    pacing = {"default_user_output_tokens_per_second": 1e6,
              "user_output_tokens_per_second": {"slow": 25}}
    connector = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}
    runs = {}
    for paced_class in (True, False):
        sim = make_sim(tiny_model, pacing=pacing if paced_class else None,
                       paced_class=paced_class, kv_transfer=connector)
        for i in range(4):
            sim.add(f"s{i}", "slow", prompt_len=200, max_tokens=3000)
        sim.add("f", "fast", prompt_len=200, max_tokens=200)
        sim.run(4)
        sim.drain()
        runs[paced_class] = sim
    paced = runs[True]
    first = paced.outputs[0]
    assert set(first.num_scheduled_tokens.values()) == {1}, "prompts arrived computed"
    assert_rate(paced, "slow", 25, 4)
    assert min(paced.tokens[f"s{i}"] for i in range(4)) >= 25 * 4 / 4 - 3
    assert paced.delivered_times("fast") == runs[False].delivered_times("fast")
