"""Lanes on vLLM's real scheduler and KV cache manager, sync and async: a better-priority
arrival gets a slot by holding a running lower-priority request (KV kept, no recompute),
lower lanes keep their reserve, and a lower lane's prompt chunks sit out a better lane's
prefill for a bounded number of steps."""

from __future__ import annotations

import pytest

from tests.sched._harness import NS, Sim, make_sim, max_in_window

pytestmark = pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])

LOW, HIGH = 10, 0


def lanes_sim(tiny_model, is_async: bool, *, min_share: float = 0.0, pacing: dict | None = None,
              active: int = 4, seqs: int = 8, **kwargs) -> Sim:
    section = {**(pacing or {}), "lanes": {"min_share": min_share}}
    return make_sim(tiny_model, is_async=is_async, pacing=section, policy="priority",
                    max_num_seqs=seqs, max_num_active_seqs=active, **kwargs)


def scheduled(out) -> set[str]:
    return set(out.num_scheduled_tokens)


def start_low(sim: Sim, n: int, *, max_tokens: int = 400, prompt_len: int = 8) -> None:
    for i in range(n):
        sim.add(f"low{i}", f"batch{i % 2}", priority=LOW, max_tokens=max_tokens,
                prompt_len=prompt_len)
    for _ in range(4):
        sim.step()
    assert all(sim.tokens[f"low{i}"] > 0 for i in range(n))


def steps_to_first_token(sim: Sim, rid: str, limit: int = 200) -> int:
    for k in range(1, limit + 1):
        sim.step()
        if sim.tokens.get(rid, 0) > 0 or any(rid == r for _, _, _, r in sim.dispatched):
            return k
    return limit + 1


def test_a_better_priority_arrival_runs_at_once_and_the_held_request_resumes(tiny_model, is_async):
    sim = lanes_sim(tiny_model, is_async)
    start_low(sim, 4)
    computed = {f"low{i}": sim.scheduler.requests[f"low{i}"].num_computed_tokens for i in range(4)}
    sim.add("live", "chat", priority=HIGH, max_tokens=20)
    assert steps_to_first_token(sim, "live") <= 2
    batch_sizes = []
    held_steps = 0
    while "live" not in sim.finished:
        out = sim.step()
        batch_sizes.append(len(scheduled(out)))
        held_steps += sum(1 for i in range(4) if f"low{i}" not in scheduled(out))
    assert held_steps > 0  # one low request sat out while the live one ran
    assert max(batch_sizes) <= 4  # the active limit holds once the live request is in
    assert sim.preempted == []  # held, not preempted: nothing is recomputed
    for rid, before in computed.items():
        assert sim.scheduler.requests[rid].num_computed_tokens >= before
    for _ in range(3):
        out = sim.step()
    assert {f"low{i}" for i in range(4)} <= scheduled(out)  # all four run again
    lane = sim.scheduler.planner.stats.snapshot().lanes
    assert lane[str(LOW)][0] >= held_steps and lane[str(HIGH)][2] == 1
    low_user = sim.scheduler.planner.stats.snapshot().users
    assert all(v[2] == 0 for v in low_user.values())  # held is not throttled


def test_stock_vllm_keeps_the_arrival_waiting(tiny_model, is_async):
    """What lanes change: the same load on vLLM's own priority scheduler makes the arrival
    wait for a running request to end (here: hundreds of steps)."""
    sim = make_sim(tiny_model, is_async=is_async, paced_class=False, policy="priority",
                   max_num_seqs=8, max_num_active_seqs=4)
    start_low(sim, 4)
    sim.add("live", "chat", priority=HIGH, max_tokens=20)
    assert steps_to_first_token(sim, "live", limit=50) > 50


def test_lower_lanes_keep_their_reserve(tiny_model, is_async):
    """min_share 0.25 of 4 active slots: the low lane keeps one slot every step while a
    flood of live requests waits; with min_share 0 it gets none."""
    for share, floor in ((0.25, 1), (0.0, 0)):
        sim = lanes_sim(tiny_model, is_async, min_share=share)
        start_low(sim, 4)
        for i in range(12):
            sim.add(f"live{i}", f"chat{i}", priority=HIGH, max_tokens=400)
        low_per_step = []
        for _ in range(100):
            out = sim.step()
            low_per_step.append(sum(1 for r in scheduled(out) if r.startswith("low")))
        assert min(low_per_step[5:]) == floor, (share, low_per_step)
        assert max(low_per_step[5:]) == floor, (share, low_per_step)
        assert sim.preempted == []


def test_a_lower_lane_prompt_sits_out_a_better_prefill_for_a_bounded_time(tiny_model, is_async):
    """A low-priority 3,500-token prompt in chunks of the 512-token budget: a live request
    arriving beside it is prefilled in its first step (stock: after the long prompt's
    chunks took the budget); the long prompt sits out at most max_yields steps in a row."""
    sim = lanes_sim(tiny_model, is_async, min_share=0.1, active=4, seqs=8,
                    max_num_batched_tokens=512, max_model_len=4096)
    sim.add("long", "batch", priority=LOW, prompt_len=3500, max_tokens=5)
    sim.step()
    assert "long" in scheduled(sim.outputs[-1])
    sim.add("live", "chat", priority=HIGH, prompt_len=300, max_tokens=200)
    first = steps_to_first_token(sim, "live")
    assert first <= 2, first
    # Keep live prompts arriving: the long prompt still progresses, at least one step in 10.
    run = 0
    longest = 0
    for i in range(60):
        sim.add(f"next{i}", "chat", priority=HIGH, prompt_len=300, max_tokens=1)
        out = sim.step()
        if "long" in scheduled(out) or "long" in sim.finished:
            run = 0
        else:
            run += 1
            longest = max(longest, run)
    assert 1 <= longest <= 9
    lane = sim.scheduler.planner.stats.snapshot().lanes
    assert lane[str(LOW)][1] > 0  # yielded chunks are counted


def test_stock_runs_the_long_prompt_first(tiny_model, is_async):
    sim = make_sim(tiny_model, is_async=is_async, paced_class=False, policy="priority",
                   max_num_seqs=8, max_num_active_seqs=4, max_num_batched_tokens=512,
                   max_model_len=4096)
    sim.add("long", "batch", priority=LOW, prompt_len=3500, max_tokens=5)
    sim.step()
    sim.add("live", "chat", priority=HIGH, prompt_len=300, max_tokens=200)
    assert steps_to_first_token(sim, "live") >= 3


def test_pacing_holds_in_every_lane(tiny_model, is_async):
    """The live user is paced at 50 tok/s; its rate holds while it outranks the batch, and
    its throttled steps give the slot back to the batch lane (work-conserving)."""
    sim = lanes_sim(tiny_model, is_async, min_share=0.1,
                    pacing={"default_user_output_tokens_per_second": 50,
                            "user_output_tokens_per_second": {"batch0": 1e6, "batch1": 1e6}})
    start_low(sim, 4, max_tokens=2000)
    for i in range(4):
        sim.add(f"live{i}", "chat", priority=HIGH, max_tokens=2000)
    sim.run(5)
    times = sim.user_times("chat")
    assert len(times) >= 50 * 4.5
    assert max_in_window(times, NS) <= (1 + 0.1) * 50 + 1
    low_tokens = sum(sim.tokens[f"low{i}"] for i in range(4))
    # The live user is throttled most of the time: its slots go to the batch lane.
    assert low_tokens > 3 * len(times)


def test_the_reserve_holds_when_better_requests_regain_quota_together(tiny_model, is_async):
    """Four live requests throttled (their user's rate cut to 0.5 tok/s) give their slots to four batch
    requests; when the live user's rate is raised all eight are running with quota: the
    live lane takes the active slots but one (min_share 0.25 of 4), the batch lane one."""
    sim = lanes_sim(tiny_model, is_async, min_share=0.25,
                    pacing={"trusted_gateway": True,
                            "default_user_output_tokens_per_second": 1e6,
                            })
    for i in range(4):
        sim.add(f"live{i}", "chat", priority=HIGH, max_tokens=2000)
    for _ in range(3):
        sim.step()
    sim.scheduler.set_user_rates({"chat": (0.5, None)})
    for _ in range(3):
        sim.step()
    start_low(sim, 4, max_tokens=2000)
    assert len(sim.scheduler.running) == 8
    sim.scheduler.set_user_rates({"chat": (1e6, None)})
    for _ in range(300):  # the user's place in time is kept: it gets quota within ~2 s
        if any(r.startswith("live") for r in scheduled(sim.step())):
            break
    sim.step()
    for _ in range(20):
        out = sim.step()
        names = scheduled(out)
        assert sum(1 for r in names if r.startswith("live")) == 3, names
        assert sum(1 for r in names if r.startswith("low")) == 1, names
    assert sim.preempted == []


def test_lanes_with_drafts(tiny_model, is_async):
    """Speculative decoding (3 drafts, 70% accepted in turn): the live arrival still runs
    within two steps with the batch lane holding one request, and the live user's rate (250
    tok/s, drafts needed to reach it) holds within the drafts' bound."""
    k, rate = 3, 250
    sim = lanes_sim(tiny_model, is_async, spec_tokens=k, max_model_len=4096,
                    pacing={"default_user_output_tokens_per_second": 1e6,
                            "user_output_tokens_per_second": {"chat": rate}})
    start_low(sim, 4, max_tokens=3000)
    sim.add("live", "chat", priority=HIGH, max_tokens=3000)
    assert steps_to_first_token(sim, "live") <= 2
    sim.run(5)
    sim.drain()
    assert sim.preempted == []
    assert sim.drafts_accepted > 100
    times = sim.delivered_times("chat")
    assert len(times) >= rate * 4.5
    for window_s in (0.2, 1.0):
        assert max_in_window(times, int(window_s * NS)) <= (window_s + 0.1) * rate + 1 + k
    lane = sim.scheduler.planner.stats.snapshot().lanes
    assert lane[str(LOW)][0] > 0  # the batch lane was held while the live request ran
