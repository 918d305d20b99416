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


def assert_charges_net_to_tokens(sim: Sim, log) -> None:
    """The event log's charges net of refunds, per request, are the tokens delivered."""
    net: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        event = json.loads(line)
        net[event["request_id"]] += 1 if event["event"] == "charge" else -1
    assert +net == +Counter(sim.tokens), "charges net of refunds = tokens delivered"


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
    assert_charges_net_to_tokens(paced, log)


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


def _multimodal_run(tiny_model, paced_class: bool, log=None) -> Sim:
    pacing = {"default_user_output_tokens_per_second": 1e6,
              "user_output_tokens_per_second": {"slow": 20}}
    if log is not None:
        pacing["event_log"] = str(log)
    sim = make_sim(tiny_model, pacing=pacing if paced_class else None,
                   paced_class=paced_class, max_num_batched_tokens=128)
    # One image's worth of encoder work per step and two images' room in the cache: the
    # scheduler cuts prefill chunks at image boundaries and holds requests whose image
    # does not fit, as for a vision-language model.
    sim.set_encoder_budget(compute_tokens=100, cache_tokens=200)
    images = ((40, 100), (200, 100))
    for i in range(3):
        sim.add(f"s{i}", "slow", prompt_len=320, max_tokens=40, images=images)
    sim.add("f", "fast", prompt_len=320, max_tokens=60, images=images)
    sim.run(8)
    sim.drain()
    return sim


def test_multimodal_prefill_cut_by_the_encoder_budget(tiny_model, tmp_path):
    """Encoder inputs only shape prefill: chunks that the encoder budget or cache cuts
    short of the sampling position are never charged (or refunded), a paced user's
    multimodal requests keep the bound and all finish, and an unpaced user's request is
    never later than under stock vLLM (earlier: the throttled requests give way)."""
    log = tmp_path / "events.jsonl"
    paced = _multimodal_run(tiny_model, True, log)
    stock = _multimodal_run(tiny_model, False)
    encoder_steps = [out for out in paced.outputs if out.scheduled_encoder_inputs]
    assert len(encoder_steps) >= 8, "the images went through the encoder budget"
    assert all(len(sum(out.scheduled_encoder_inputs.values(), [])) == 1
               for out in encoder_steps), "one image per step (the budget)"
    assert_rate(paced, "slow", 20, 6)
    assert [paced.tokens[f"s{i}"] for i in range(3)] == [40] * 3
    assert paced.finished.keys() >= {"s0", "s1", "s2", "f"}
    fast, fast_stock = paced.delivered_times("fast"), stock.delivered_times("fast")
    assert len(fast) == len(fast_stock) == 60
    assert all(p <= s for p, s in zip(fast, fast_stock))
    paced.scheduler.shutdown()
    assert_charges_net_to_tokens(paced, log)
