"""LoRA under pacing, on vLLM's real scheduler and KV cache manager, sync and async.

vLLM's rule (``Scheduler.schedule`` in ``vllm/v1/core/sched/scheduler.py``): after the
running requests are scheduled, the adapters of those *scheduled* this step form the
step's set (it asserts the set has at most ``max_loras``); a waiting request whose adapter
is not in a full set is skipped, and an admitted one adds its adapter. The running loop
itself checks no adapter: it relies on every running request being scheduled each step.
A throttled request stays in ``running`` but is skipped, so its adapter leaves the set and
a waiting request on another adapter can be admitted beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import vllm
from packaging.version import Version

from tests.sched._harness import NS, Sim, make_sim, max_in_window

pytestmark = pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])

BURST_S = 0.1
MAX_STEPS = 3000

# A request skipped for its rate lets a waiting request on another adapter start; once
# it is ready again the scheduler defers the later adapter's requests (``_lora_misfits``),
# or vLLM's ``assert len(scheduled_loras) <= max_loras`` would fail inside ``schedule()``.
# Deferring in ``running`` order would starve the throttled request (it sits at the
# tail): ``assert_not_starved`` checks the order is vLLM's own (priority, arrival).


def step_loras(sim: Sim, out: Any) -> set[int]:
    """The distinct adapters among the step's scheduled requests (new and cached)."""
    ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
    assert sorted(ids) == sorted(out.num_scheduled_tokens)
    for new in out.scheduled_new_reqs:  # the scheduler carries the request's adapter
        lora = new.lora_request.lora_int_id if new.lora_request else None
        assert lora == sim.loras.get(new.req_id)
    return {sim.loras[rid] for rid in ids if rid in sim.loras}


def run_until_done(sim: Sim, max_loras: int, expected: int) -> list[set[int]]:
    """Step until ``expected`` requests finished; every step keeps the LoRA limit."""
    sets = []
    for _ in range(MAX_STEPS):
        loras = step_loras(sim, sim.step())
        assert len(loras) <= max_loras, (sim.step_index, loras)
        sets.append(loras)
        if len(sim.finished) == expected:
            break
    sim.drain()
    assert len(sim.finished) == expected, "every request must finish"
    return sets


def assert_bound(sim: Sim, user: str, rate: float) -> None:
    """Kept charges (dispatched sampling steps) within ``(W + 0.1) x rate + 1``."""
    times = sim.user_times(user)
    for window_s in (0.05, 0.2, 0.5, 1.0, 5.0):
        bound = (window_s + BURST_S) * rate + 1
        assert max_in_window(times, int(window_s * NS)) <= bound, (user, window_s)


def assert_not_starved(sim: Sim, user: str, rate: float) -> None:
    """Once running, a paced user waits at most two token intervals for its next token:
    a request on another adapter admitted beside it must not take its turns for good."""
    times = sorted(set(sim.user_times(user)))
    gap = max(b - a for a, b in zip(times, times[1:]))
    assert gap <= 2 * NS / rate + sim.step_ns, (user, gap / NS)


def schedule(sim: Sim, steps: int) -> list[list[tuple[str, int]]]:
    return [sorted(sim.step().num_scheduled_tokens.items()) for _ in range(steps)]


def test_the_limit_and_the_bound_hold_when_the_adapters_fit(tiny_model: Path, is_async):
    """Two adapters, max_loras=2: the limit cannot bind, pacing works as without LoRA."""
    sim = make_sim(tiny_model, is_async=is_async, max_loras=2,
                   pacing={"default_user_output_tokens_per_second": 100_000,
                           "user_output_tokens_per_second": {"slow": 20, "mid": 50}})
    for i in range(2):
        sim.add(f"slow{i}", "slow", lora=1, max_tokens=40)
        sim.add(f"mid{i}", "mid", lora=2, max_tokens=100)
        sim.add(f"fast{i}", "fast", lora=1 + i, max_tokens=300)
    sets = run_until_done(sim, 2, 6)
    assert max(map(len, sets)) == 2
    assert all(sim.tokens[rid] == n for rid, n in
               [("slow0", 40), ("slow1", 40), ("mid0", 100), ("mid1", 100),
                ("fast0", 300), ("fast1", 300)])
    assert_bound(sim, "slow", 20)
    assert_bound(sim, "mid", 50)
    assert 3.8 <= sim.step_index * sim.step_ns / NS <= 4.3  # slow's 80 tokens at 20 tok/s


@pytest.mark.parametrize("max_loras", [1, 2])
def test_throttled_users_on_their_own_adapters_keep_the_limit(tiny_model: Path, is_async,
                                                              max_loras):
    """Four users, an adapter each; two paced low so they are throttled most steps."""
    rates = {"u0": 20, "u1": 50}
    sim = make_sim(tiny_model, is_async=is_async, max_loras=max_loras,
                   pacing={"default_user_output_tokens_per_second": 100_000,
                           "user_output_tokens_per_second": rates})
    lengths = {"u0": 30, "u1": 60, "u2": 120, "u3": 200}
    for lora, (user, n) in enumerate(lengths.items(), start=1):
        for i in range(2):
            sim.add(f"{user}-{i}", user, lora=lora, max_tokens=n)
    sets = run_until_done(sim, max_loras, 8)
    assert max(map(len, sets)) == max_loras
    for user, n in lengths.items():
        assert sim.tokens[f"{user}-0"] == sim.tokens[f"{user}-1"] == n
    for user, rate in rates.items():
        assert_bound(sim, user, rate)
        assert_not_starved(sim, user, rate)


# vLLM 0.33 counts the adapters of every running request against max_loras, scheduled in
# the step or not (0.32: only those scheduled): there a request waiting for its rate keeps
# its adapter's place, and a request of another adapter starts once it ends.
RUNNING_HOLD_ADAPTERS = Version(vllm.__version__).release[:2] >= (0, 33)


def test_a_throttled_adapter_does_not_hold_the_lora_slot(tiny_model: Path, is_async):
    """max_loras=1: a (adapter 1) spends its burst, then b (adapter 2, unpaced) arrives
    and runs in the steps where a waits for its next token (vLLM 0.32), or once a ends
    (vLLM 0.33, whose rule it is: ``RUNNING_HOLD_ADAPTERS``); never beside it."""
    sim = make_sim(tiny_model, is_async=is_async, max_loras=1,
                   pacing={"default_user_output_tokens_per_second": 100_000,
                           "user_output_tokens_per_second": {"a": 20}})
    sim.add("a0", "a", lora=1, max_tokens=30)
    for _ in range(5):  # admitted, prefilled, burst spent: a is throttled now
        sim.step()
    arrival = sim.step_index
    sim.add("b0", "b", lora=2, max_tokens=200)
    run_until_done(sim, 1, 2)
    assert sim.tokens["a0"] == 30 and sim.tokens["b0"] == 200
    assert_bound(sim, "a", 20)
    assert_not_starved(sim, "a", 20)
    a_steps = {step for step, _, user, _ in sim.dispatched if user == "a"}
    b_steps = {step for step, _, user, _ in sim.dispatched if user == "b"}
    assert not a_steps & b_steps
    if RUNNING_HOLD_ADAPTERS:
        assert min(b_steps) > max(a_steps)
        return
    # While a is unfinished, its adapter is idle in most steps (a has a token every 5th):
    # b must take them, not wait for a to end.
    a_idle = set(range(arrival + 1, max(a_steps))) - a_steps
    assert len(b_steps & a_idle) >= len(a_idle) // 2, (len(b_steps & a_idle), len(a_idle))
    assert min(b_steps) <= arrival + 3


@pytest.mark.parametrize("max_loras", [1, 2])
@pytest.mark.parametrize("pacing", [None, {"default_user_output_tokens_per_second": 1e6}],
                         ids=["off", "limits-nobody"])
def test_without_a_binding_limit_the_schedule_is_stock(tiny_model: Path, is_async, max_loras,
                                                       pacing):
    """Same LoRA workload, step by step: the paced class schedules exactly as vLLM's."""
    def scenario(paced_class: bool, loras: int, cfg: dict | None) -> Sim:
        sim = make_sim(tiny_model, is_async=is_async, max_loras=loras, pacing=cfg,
                       paced_class=paced_class)
        for i in range(12):
            sim.add(f"r{i}", f"u{i % 4}", lora=1 + i % 3, prompt_len=8 + 5 * i,
                    max_tokens=20 + 7 * i)
        return sim

    stock, paced = scenario(False, max_loras, None), scenario(True, max_loras, pacing)
    differences = [(i, a, b) for i, (a, b) in
                   enumerate(zip(schedule(stock, 400), schedule(paced, 400))) if a != b]
    assert differences == []
    stock.drain()
    paced.drain()
    assert len(stock.finished) == 12 and stock.finished == paced.finished
    assert dict(stock.tokens) == dict(paced.tokens)
    # the limit binds in this workload: with room for every adapter it ends sooner
    roomy = scenario(False, 3, None)
    schedule(roomy, 400)
    roomy.drain()
    last_step = [max(step for step, _, _, _ in sim.dispatched) for sim in (stock, roomy)]
    assert last_step[1] < last_step[0], last_step
