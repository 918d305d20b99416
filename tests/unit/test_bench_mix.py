"""`tokenpace bench mix`'s workload and figures, in process: made-up records, no server."""

from __future__ import annotations

import argparse

import pytest
import yaml

from tokenpace.bench import mix
from tokenpace.bench._mix import (
    DOCUMENT,
    EngineSample,
    LedgerRow,
    Sent,
    Workload,
    goals,
    summarize,
)

EQUAL = {"short": 1.0, "context": 1.0, "generation": 1.0, "agent": 1.0}


def test_each_class_draws_its_shape_from_the_seed() -> None:
    a, b = Workload(7), Workload(7)
    for name in ("short", "context", "generation"):
        assert [a.request(name) for _ in range(20)] == [b.request(name) for _ in range(20)]
    w = Workload(7)
    for _ in range(200):
        prompt, out = w.request("short")
        assert 25 <= len(prompt) <= 75 and 15 <= out <= 45
        prompt, out = w.request("context")
        assert 2_000 <= len(prompt) <= 3_500 and 8 <= out <= 32
        assert prompt[:DOCUMENT] == w.document  # the shared prefix a cache keeps
        prompt, out = w.request("generation")
        assert 32 <= len(prompt) <= 96 and 800 <= out <= 1_000
    assert Workload(8).request("short") != Workload(7).request("short")
    with pytest.raises(ValueError, match="agent"):
        w.request("agent")


def test_an_agent_operation_makes_6_to_10_calls_each_carrying_the_earlier_answers() -> None:
    w = Workload(3)
    ops = [w.operation() for _ in range(300)]
    assert {op.calls for op in ops} == set(range(6, 11))
    assert all(1 <= len(stage) <= 3 for op in ops for stage in op.stages)
    assert any(len(stage) > 1 for op in ops for stage in op.stages)  # some calls in parallel
    assert any(len(op.stages) >= 4 for op in ops)  # and some in sequence
    op = ops[0]
    call = op.stages[-1][0]
    answers = [[5, 6, 7], [8]]
    assert op.prompt(answers, call) == op.task + [5, 6, 7, 8] + call.instruction
    assert Workload(3).operation() == op  # the same seed, the same operations


def _tokens(start: float, n: int, gap: float) -> list[float]:
    return [start + i * gap for i in range(n)]


def test_the_figures_of_an_arm_come_from_its_window_alone() -> None:
    # Window [10, 20): a "short" request of 10 prompt tokens and 10 output tokens, a
    # "generation" one of 0 prompt and 15 output tokens in it; one before it (not counted).
    sent = [
        Sent("short", 1.0, 100, _tokens(2.0, 5, 0.1)),          # before the window
        Sent("short", 10.0, 10, _tokens(10.5, 10, 0.1)),        # TTFT 500 ms, TPOT 100 ms
        Sent("generation", 11.0, 0, _tokens(11.25, 15, 0.2)),   # TTFT 250 ms, TPOT 200 ms
    ]
    rows = [LedgerRow("short", 10.0, 40.0, 10, 0), LedgerRow("generation", 11.0, 80.0, 100, 60),
            LedgerRow("short", 1.0, 9_000.0, 100, 100)]  # before the window: left out
    weights = {"short": 2.0, "generation": 1.0}
    engine = [EngineSample(9.5, 99.0, 0, 0, 0),  # before the window: left out
              EngineSample(10.0, 3.0, 1_000, 400, 50), EngineSample(15.0, 5.0, 2_000, 900, 250),
              EngineSample(19.0, 4.0, 2_000, 900, 450)]
    s = summarize(sent, [], rows, engine, weights, 10.0, 20.0, 5.0)
    short, gen = s["tenants"]["short"], s["tenants"]["generation"]
    # Service: short 10 x 1 + 10 x 2 = 30, generation 15 x 2 = 30: half each.
    assert short["service_share"] == gen["service_share"] == 0.5
    assert short["weight_share"] == pytest.approx(0.6667, abs=1e-4)
    assert short["share_error"] == pytest.approx(-0.1667, abs=1e-4)
    assert s["max_share_error"] == pytest.approx(0.1667, abs=1e-4)
    assert short["ttft_ms"] == {"p50": 500.0, "p95": 500.0, "n": 1}
    assert gen["time_per_output_token_ms"]["p50"] == pytest.approx(200.0)
    assert short["queue_ms"]["p95"] == 40.0 and gen["queue_ms"]["p95"] == 80.0
    assert s["output_tokens_per_s"] == 2.5  # 25 tokens in 10 s
    assert s["cost_per_s"] == 6.0
    assert s["prefix_hit_rate"] == pytest.approx(60 / 110, abs=1e-4)
    assert short["prefix_hit_rate"] == 0.0 and gen["prefix_hit_rate"] == 0.6
    assert short["prompt_tokens"] == 10 and gen["prompt_tokens"] == 100
    assert s["mean_running"] == 4.0
    # 500 uncached prompt tokens and 400 generated from 10 s to 19 s
    assert s["engine_tokens_per_s"] == 100.0
    assert s["requests_per_s"] == 0.2  # both ended in the window
    assert s["window_midpoints_s"] == [12.5, 17.5]


def test_agent_operations_are_timed_from_first_send_to_last_answer() -> None:
    sent = [Sent(name, 10.0, 10, [11.0]) for name in EQUAL]
    # The first began before the window: left out; the last ends after it: counted.
    ops = [(5.0, 30.0), (10.0, 12.5), (12.0, 16.0), (15.0, 16.0), (19.0, 21.0)]
    s = summarize(sent, ops, [], [], EQUAL, 10.0, 20.0, 5.0)
    assert s["tenants"]["agent"]["operation_s"] == {"p50": 2.0, "p95": 4.0, "n": 4}
    assert s["prefix_hit_rate"] is None and s["mean_running"] is None


def test_goals_compare_vtc_with_fcfs() -> None:
    def arm(error: float, tok_s: float, hit: float, op_s: float, agent_share: float,
            context: tuple[int, float]) -> dict:
        return {"max_share_error": error, "output_tokens_per_s": tok_s, "cost_per_s": tok_s * 3,
                "engine_tokens_per_s": tok_s * 2, "requests_per_s": tok_s / 100,
                "prefix_hit_rate": hit,
                "tenants": {"agent": {"operation_s": {"p50": op_s}, "service_share": agent_share,
                                      "prompt_tokens": 1_000, "prefix_hit_rate": 0.5},
                            "context": {"prompt_tokens": context[0],
                                        "prefix_hit_rate": context[1]}}}

    # FCFS served 3,000 context prompt tokens at 0.9 and 1,000 of the agent's at 0.5 (0.8
    # overall); VTC fewer context ones, at the same 0.9: lower overall, the same on FCFS's mix.
    g = goals({"vtc": arm(0.03, 950.0, 0.70, 6.0, 0.25, (1_000, 0.9)),
               "fcfs": arm(0.3, 1000.0, 0.80, 3.0, 0.5, (3_000, 0.9)),
               "vtc_weighted": arm(0.07, 900.0, 0.9, 5.0, 0.2, (1_000, 0.9))})
    assert g["vtc_shares_met"] and not g["vtc_weighted_shares_met"]
    assert g["throughput_vtc_over_fcfs"] == 0.95 and g["cost_rate_vtc_over_fcfs"] == 0.95
    assert g["prefix_hit_vtc_over_fcfs"] == 0.875
    assert g["prefix_hit_vtc_on_fcfs_mix_over_fcfs"] == 1.0
    assert g["engine_tokens_vtc_over_fcfs"] == 0.95 and g["requests_vtc_over_fcfs"] == 0.95
    assert g["agent_operation_p50_vtc_over_fcfs"] == 2.0
    assert g["agent_share_fcfs_over_vtc"] == 2.0


def test_each_arm_is_a_pool_of_the_two_engines_with_its_weights_and_lanes(tmp_path) -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    arms = {a.name: a for a in mix.ARMS}
    plain = yaml.safe_load(mix.gateway_config(urls, arms["vtc_weighted"], 8, tmp_path / "u.db"))
    assert [e["url"] for e in plain["engines"]] == urls
    assert all(e["max_inflight"] == 8 for e in plain["engines"])
    assert {t["id"]: t["weight"] for t in plain["tenants"]} == {**EQUAL, "short": 2.0}
    assert "lanes" not in plain and plain["dispatch_order"] == "vtc"
    lanes = yaml.safe_load(mix.gateway_config(urls, arms["vtc_lanes"], 8, tmp_path / "u.db"))
    assert {t["id"]: t["lane"] for t in lanes["tenants"]} == {
        "short": "interactive", "context": "interactive", "generation": "batch",
        "agent": "interactive"}
    assert [lane["name"] for lane in lanes["lanes"]] == ["interactive", "batch"]
    fcfs = yaml.safe_load(mix.gateway_config(urls, arms["fcfs"], 8, tmp_path / "u.db"))
    assert fcfs["dispatch_order"] == "fcfs"


def test_the_gateway_accepts_each_arms_configuration(tmp_path) -> None:
    from tokenpace.gateway.config import load_config

    for arm in mix.ARMS:
        path = tmp_path / f"{arm.name}.yaml"
        path.write_text(mix.gateway_config(["http://127.0.0.1:1", "http://127.0.0.1:2"], arm,
                                           8, tmp_path / "u.db"))
        config = load_config(path)
        assert len(config.engines) == 2


@pytest.mark.parametrize("argv, message", [
    (["--arms", "vtc,nope"], "--arms: unknown arm"),
    (["--warmup", "20", "--duration", "10"], "--warmup must be shorter"),
])
def test_bad_flags_are_named(argv: list[str], message: str) -> None:
    parser = argparse.ArgumentParser()
    mix.add_cli_args(parser)
    with pytest.raises(SystemExit, match=message):
        mix.main(parser.parse_args(argv))
