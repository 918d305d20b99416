"""The paced schedulers on vLLM's real scheduler and KV cache manager, sync and async."""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path

import pytest

from tests.sched._harness import NS, Sim, make_sim, max_in_window
from tokenpace.engine._aborted import tokenpace_aborted_outputs
from tokenpace.engine._ended import install_ended_requests, tokenpace_ended_requests
from tokenpace.pacing import MAX_IDLE_WAIT_S

pytestmark = pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])

BURST_S = 0.1


def paced(default: float, **overrides: float) -> dict:
    cfg: dict = {"default_user_output_tokens_per_second": default}
    if overrides:
        cfg["user_output_tokens_per_second"] = overrides
    return cfg


def assert_rate(sim: Sim, user: str, rate: float, seconds: float) -> None:
    times = sim.user_times(user)
    assert len(times) >= rate * seconds - 1, (user, len(times))
    for window_s in (0.05, 0.5, 1.0, seconds):
        bound = (window_s + BURST_S) * rate + 1
        assert max_in_window(times, int(window_s * NS)) <= bound, (user, window_s)


def assert_charges_match_dispatch(sim: Sim, log: Path) -> None:
    """Charges minus refunds per request equal the sampling steps actually dispatched."""
    sim.scheduler.shutdown()
    net: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        event = json.loads(line)
        net[event["request_id"]] += 1 if event["event"] == "charge" else -1
    dispatched = Counter(rid for _, _, _, rid in sim.dispatched)
    assert +net == +dispatched


@pytest.mark.parametrize("streams", [1, 4])
def test_one_user_at_20_tok_s(tiny_model, is_async, streams, tmp_path):
    log = tmp_path / "events.jsonl"
    sim = make_sim(tiny_model, is_async=is_async, pacing={**paced(20), "event_log": str(log)})
    for i in range(streams):
        sim.add(f"a{i}", "a", max_tokens=1000)
    spread = 0
    for _ in range(1000):  # 10 simulated seconds at 10 ms per step
        sim.step()
        counts = [sim.per_request("a").get(f"a{i}", 0) for i in range(streams)]
        spread = max(spread, max(counts) - min(counts))
    assert_rate(sim, "a", 20, 10)
    assert spread <= 2, "streams of one user must take turns"
    assert_charges_match_dispatch(sim, log)


def test_two_users_each_at_its_own_rate(tiny_model, is_async):
    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(20, fast=100))
    for i in range(4):
        sim.add(f"slow{i}", "slow", max_tokens=1000)
    sim.add("fast0", "fast", max_tokens=2000)
    sim.run(10)
    assert_rate(sim, "slow", 20, 10)
    assert_rate(sim, "fast", 100, 10)


def test_throttled_user_does_not_take_active_slots(tiny_model, is_async):
    """A 5 tok/s user's 8 streams are resident first; max 4 active of 16 resident."""
    def scenario(pacing):
        sim = make_sim(tiny_model, is_async=is_async, pacing=pacing,
                       max_num_seqs=16, max_num_active_seqs=4)
        for i in range(8):
            sim.add(f"a{i}", "a", max_tokens=400)
        sim.run(2)
        arrival = sim.step_index
        sim.add("b0", "b", max_tokens=400)
        sim.run(2)
        return sim, arrival

    sim, arrival = scenario(paced(5, b=100_000))
    assert len(sim.scheduler.running) == 9, "throttled streams stay resident"
    b_steps = sorted({step for step, _, user, _ in sim.dispatched if user == "b"})
    assert b_steps[0] <= arrival + 2, "b must start at once"
    assert b_steps == list(range(b_steps[0], sim.step_index + 1)), "b samples every step"
    assert_rate(sim, "a", 5, 4)

    stock, _ = scenario(None)  # list order: a's four first streams hold every active slot
    assert not [1 for _, _, user, _ in stock.dispatched if user == "b"]


def test_freed_slots_go_to_the_least_served_user(tiny_model, is_async):
    """Two users, three resident streams each, two active slots: slots alternate.

    While steps are short both users are throttled most of the time, so all six streams
    become resident (throttled requests do not count as active). With 100 ms steps each
    user then has quota for two tokens per step: four candidates for two slots. List
    order (a's streams first) would give a both slots every step and b nothing.
    """
    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(20),
                   max_num_seqs=16, max_num_active_seqs=2)
    for i in range(3):
        sim.add(f"a{i}", "a", max_tokens=1000)
    for i in range(3):
        sim.add(f"b{i}", "b", max_tokens=1000)
    sim.run(1)
    assert len(sim.scheduler.running) == 6
    sim.step_ns = 100_000_000
    start = len(sim.dispatched)
    sim.run(10)
    later = Counter(user for _, _, user, _ in sim.dispatched[start:])
    assert abs(later["a"] - later["b"]) <= 3, later
    assert later["a"] + later["b"] >= 2 * 100 - 2  # both slots used every step
    for user in ("a", "b"):
        counts = [n for rid, n in sim.per_request(user).items()]
        assert max(counts) - min(counts) <= 2


def test_throttled_request_resumes_and_completes(tiny_model, is_async):
    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(20))
    sim.add("r0", "u", max_tokens=30)
    sim.add("r1", "u", max_tokens=30)
    for _ in range(600):
        sim.step()
        if len(sim.finished) == 2:
            break
    sim.drain()
    assert sim.finished == {"r0": "length", "r1": "length"}
    assert sim.tokens["r0"] == 30 and sim.tokens["r1"] == 30
    assert 2.5 <= (sim.step_index * sim.step_ns) / NS <= 3.2  # 60 tokens at 20 tok/s


def test_chunked_prefill_charges_only_the_last_chunk(tiny_model, is_async, tmp_path):
    log = tmp_path / "events.jsonl"
    sim = make_sim(tiny_model, is_async=is_async, max_num_batched_tokens=256,
                   pacing={**paced(20), "event_log": str(log)})
    sim.add("long", "u", prompt_len=700, max_tokens=5)
    chunks = []
    for _ in range(3):
        out = sim.step()
        chunks.append(out.num_scheduled_tokens.get("long", 0))
    assert chunks == [256, 256, 188]
    steps_sampled = [step for step, _, _, rid in sim.dispatched if rid == "long"]
    assert steps_sampled == [3]
    sim.scheduler.shutdown()
    events = [json.loads(x) for x in log.read_text().splitlines()]
    assert [e["event"] for e in events if e["request_id"] == "long"] == ["charge"]


def test_refund_when_kv_allocation_fails(tiny_model, is_async, tmp_path):
    log = tmp_path / "events.jsonl"
    # 8 blocks of 16 tokens: the 200-token prompt of the second request cannot fit.
    sim = make_sim(tiny_model, is_async=is_async, num_blocks=16,
                   pacing={**paced(5), "event_log": str(log)})
    sim.add("fits", "u", prompt_len=100, max_tokens=40)
    sim.add("too_big", "v", prompt_len=200, max_tokens=5)
    sim.step()
    sim.step()
    assert "too_big" not in {rid for _, _, _, rid in sim.dispatched}
    # At 5 tok/s the burst is one token: it is still there only if every charge of v
    # was refunded.
    assert sim.scheduler.planner.limiter.try_take("v"), "v's token was refunded"
    sim.scheduler.shutdown()
    events = [json.loads(x) for x in log.read_text().splitlines() if '"too_big"' in x]
    assert [e["event"] for e in events][:2] == ["charge", "refund"]


def test_a_charged_step_that_vllm_skips_is_refunded(tiny_model, is_async, tmp_path):
    # Under async scheduling vLLM skips a running request whose last token is already in
    # flight (max_tokens reached), though it still looks like a decode step to the
    # planner: that charge must come back even though nothing was preempted (the refund
    # point's shortcut must not apply when fewer requests were scheduled than planned).
    log = tmp_path / "events.jsonl"
    sim = make_sim(tiny_model, is_async=is_async,
                   pacing={**paced(1000), "event_log": str(log)})
    for i in range(4):
        sim.add(f"r{i}", f"u{i}", max_tokens=3 + i)
    for _ in range(12):
        sim.step()
    sim.drain()
    assert dict(sim.tokens) == {f"r{i}": 3 + i for i in range(4)}
    assert_charges_match_dispatch(sim, log)


def run_until_preemption(tiny_model, is_async, policy: str, **pacing) -> Sim:
    """Few KV blocks; the throttled user's request arrives first (stock vLLM would evict
    the newest request, the fast user's). Stops at the first preemption."""
    sim = make_sim(tiny_model, is_async=is_async, num_blocks=12, policy=policy,
                   pacing={**paced(1, fast=100_000), **pacing})
    sim.add("slow", "slow", prompt_len=60, max_tokens=200, arrival=0.0)
    sim.add("fast", "fast", prompt_len=60, max_tokens=200, arrival=1.0)
    for _ in range(150):
        sim.step()
        if sim.preempted:
            break
    return sim


def test_throttled_requests_are_preempted_first(tiny_model, is_async, tmp_path):
    log = tmp_path / "events.jsonl"
    sim = run_until_preemption(tiny_model, is_async, "fcfs", event_log=str(log))
    assert sim.preempted and sim.preempted[0] == "slow"
    sim.drain()
    assert_charges_match_dispatch(sim, log)


def test_abort_of_a_throttled_request(tiny_model, is_async):
    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(2))
    sim.add("r0", "u", max_tokens=100)
    sim.add("r1", "u", max_tokens=100)
    sim.run(0.5)
    sim.abort("r1")
    sim.run(2)
    sim.drain()
    assert "r1" not in sim.scheduler.requests
    assert_rate(sim, "u", 2, 2.5)
    assert sim.per_request("u")["r0"] >= 4  # r0 carries on alone


def test_an_aborted_requests_count_is_kept_for_the_gateway(tiny_model, is_async):
    """The client left a Responses stream: the API server aborts the request, and the
    gateway asks what it generated, by the id it knows (vLLM's random suffix off)."""
    rid = "resp_tpg-1f2e-abcdef12"
    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(20))
    sim.add(rid, "u", max_tokens=100, prompt_len=11)
    sim.run(1.0)
    generated = sim.scheduler.requests[rid].num_output_tokens
    assert generated >= 10

    class Core:  # what the engine process runs for the utility call
        scheduler = sim.scheduler

    assert tokenpace_aborted_outputs(Core, ["resp_tpg-1f2e"]) == {
        "output_tokens": {}, "prompt_tokens": {}, "running": ["resp_tpg-1f2e"]}
    sim.abort(rid)
    sim.drain()
    assert tokenpace_aborted_outputs(Core, ["resp_tpg-1f2e", rid, "nobody"]) == {
        "output_tokens": {"resp_tpg-1f2e": generated, rid: generated},
        "prompt_tokens": {"resp_tpg-1f2e": 11, rid: 11}, "running": []}
    assert tokenpace_aborted_outputs(Core, [])["status"] == 400


@pytest.mark.parametrize("pacing", [paced(20), None], ids=["paced", "pacing-off"])
def test_finished_and_aborted_requests_are_both_in_the_book(tiny_model, is_async, pacing):
    """Every request that ends is kept with its prompt and output counts, whether it
    stopped at ``max_tokens`` or was aborted, and with pacing off too (the scheduler class
    is tokenpace's, no rate is set): the gateway meters every request through it."""
    sim = make_sim(tiny_model, is_async=is_async, pacing=pacing)
    sim.add("cmpl-g1-0-aaaaaaaa", "u", max_tokens=5, prompt_len=9)
    sim.add("cmpl-g2-0-bbbbbbbb", "u", max_tokens=1000, prompt_len=30)
    sim.add("0_chatcmpl-g3-cccccccc", "v", max_tokens=4, prompt_len=7)  # n = 2
    sim.add("1_chatcmpl-g3-cccccccc", "v", max_tokens=4, prompt_len=7)
    sim.run(0.5)
    sim.drain()
    assert sim.finished["cmpl-g1-0-aaaaaaaa"] == "length"
    aborted = sim.scheduler.requests["cmpl-g2-0-bbbbbbbb"].num_output_tokens
    assert 5 < aborted < 1000
    sim.abort("cmpl-g2-0-bbbbbbbb")
    sim.drain()
    book = sim.scheduler.ended_requests
    ids = ["cmpl-g1-0", "cmpl-g2-0", "0_chatcmpl-g3", "1_chatcmpl-g3"]
    assert book.lookup(ids) == {"cmpl-g1-0": (9, 5), "cmpl-g2-0": (30, aborted),
                                "0_chatcmpl-g3": (7, 4), "1_chatcmpl-g3": (7, 4)}
    assert book.lookup(["cmpl-g1-0-aaaaaaaa"]) == {"cmpl-g1-0-aaaaaaaa": (9, 5)}
    assert book.running(ids) == []
    assert sum(sim.tokens[r] for r in sim.tokens if r.startswith("cmpl-g2")) == aborted


@pytest.mark.parametrize("pacing", [paced(20), None], ids=["paced", "pacing-off"])
def test_the_book_lists_ended_requests_in_order_with_their_users(tiny_model, is_async, pacing):
    """``GET /tokenpace/v1/ended``'s source: every ended request once, numbered in the
    order it ended, with the API server's id, its pacing user ("" for none), its counts
    and its end time; a cursor gives what ended after it."""
    sim = make_sim(tiny_model, is_async=is_async, pacing=pacing)
    sim.add("chatcmpl-g1-aaaaaaaa", "u", max_tokens=3, prompt_len=9)
    sim.add("cmpl-g2-0-bbbbbbbb", "v", max_tokens=1000, prompt_len=5)
    sim.add("chatcmpl-g3-cccccccc", None, max_tokens=2, prompt_len=4)
    sim.run(0.5)
    sim.drain()
    aborted = sim.scheduler.requests["cmpl-g2-0-bbbbbbbb"].num_output_tokens
    sim.abort("cmpl-g2-0-bbbbbbbb")
    sim.drain()

    class Core:  # what the engine process runs for the utility call
        scheduler = sim.scheduler

    book = sim.scheduler.ended_requests.book
    answer = tokenpace_ended_requests(Core, {"after": {}, "limit": 10})
    entries = answer["requests"]
    assert [e[0] for e in entries] == [0, 1, 2] and answer["after"] == -1
    assert entries[-1][1:5] == ["cmpl-g2-0", "v", 5, aborted]
    assert sorted(e[1:5] for e in entries[:2]) == [["chatcmpl-g1", "u", 9, 3],
                                                   ["chatcmpl-g3", "", 4, 2]]
    assert entries[0][5] <= entries[1][5] <= entries[2][5]
    after = tokenpace_ended_requests(Core, {"after": {book: 1}, "limit": 10})
    assert after["requests"] == entries[2:] and after["book"] == book
    # As vLLM's engine process calls it: its arguments checked against the method's.
    from vllm.v1.engine.core import EngineCoreProc

    install_ended_requests(EngineCoreProc)  # done by the plugin (or the scheduler) in vLLM
    method = EngineCoreProc.tokenpace_ended_requests.__get__(Core)
    assert method(*EngineCoreProc._convert_msgspec_args(
        method, ({"after": {}, "limit": 10},))) == answer


def test_idle_wait_when_every_request_is_throttled(tiny_model, is_async):
    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(10))
    sim.add("r0", "u", max_tokens=100)
    sim.run(0.05)
    limiter = sim.scheduler.planner.limiter
    waits = []
    for _ in range(30):
        sim.step()
        wait = sim.scheduler.idle_wait_seconds()
        ready_in = max(0, limiter.ready_at_ns("u") - sim.clock.now_ns) / NS
        # Asked only after a step that refused someone (else the next step finds out).
        expected = min(MAX_IDLE_WAIT_S, ready_in) if sim.scheduler.planner.refused_any else 0.0
        assert wait == pytest.approx(expected)
        if wait:
            waits.append(wait)
    assert len(waits) >= 20 and max(waits) > 0.02, waits


def test_no_idle_wait_while_some_request_can_run(tiny_model, is_async):
    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(10, free=1e6))
    sim.add("r0", "u", max_tokens=100)
    sim.run(0.3)  # u is throttled now and then
    assert any(sim.scheduler.idle_wait_seconds() > 0 for _ in [sim.step() for _ in range(5)])
    sim.add("r1", "free", max_tokens=100)
    for _ in range(10):
        sim.step()
        assert sim.scheduler.idle_wait_seconds() == 0.0  # the free user always can run
    sim.abort("r1")
    sim.add("r2", "u", prompt_len=1800, max_tokens=5)  # several 512-token prefill chunks
    sim.step()
    assert sim.scheduler.idle_wait_seconds() == 0.0  # intermediate chunks need no quota


def test_feature_off_is_stock_behaviour(tiny_model, is_async):
    def drive(paced_class: bool) -> list[tuple]:
        rng = random.Random(7)
        sim = make_sim(tiny_model, is_async=is_async, paced_class=paced_class,
                       num_blocks=40, max_num_seqs=8, max_num_active_seqs=6,
                       max_num_batched_tokens=128)
        trace = []
        n = 0
        for step in range(300):
            if rng.random() < 0.3:
                sim.add(f"r{n}", rng.choice(["a", "b", None]), prompt_len=rng.randint(1, 300),
                        max_tokens=rng.randint(1, 60), arrival=float(step))
                n += 1
            if rng.random() < 0.03 and sim.scheduler.running:
                sim.abort(rng.choice(sim.scheduler.running).request_id)
            out = sim.step()
            trace.append((
                dict(out.num_scheduled_tokens),
                [r.req_id for r in out.scheduled_new_reqs],
                sorted(out.preempted_req_ids or ()),
                sorted(out.finished_req_ids),
            ))
        return trace

    assert drive(True) == drive(False)


def test_priority_policy_preempts_throttled_first_within_its_level(tiny_model, is_async):
    sim = run_until_preemption(tiny_model, is_async, "priority")
    assert sim.preempted and sim.preempted[0] == "slow"
    # The victim's queue key is its real arrival time again.
    assert sim.scheduler.requests["slow"].arrival_time == 0.0
    sim.run(0.5)
    assert sim.scheduler.requests["slow"].arrival_time == 0.0


def test_limits_file_edit_applies_between_steps(tiny_model, is_async, tmp_path):
    limits = tmp_path / "limits.json"
    limits.write_text('{"u": 10}')
    sim = make_sim(tiny_model, is_async=is_async, pacing={
        "default_user_output_tokens_per_second": 5,
        "user_output_tokens_per_second": f"@{limits}",
    })
    sim.add("r0", "u", max_tokens=400)
    sim.run(2)
    assert_rate(sim, "u", 10, 2)
    limits.write_text('{"u": 40, "v": 1}')
    os.utime(limits, ns=(1, 2))  # a distinct mtime even on coarse file systems
    sim.run(1.5)  # looked at once a second of the engine clock
    assert sim.scheduler.planner.limiter.limits.rate("u") == 40
    assert sim.scheduler.planner.limiter.limits.rate("v") == 1
    limits.write_text('{"u": ')  # half-written: the last good limits stay
    os.utime(limits, ns=(3, 4))
    sim.run(1.5)
    assert sim.scheduler.planner.limiter.limits.rate("u") == 40


def test_pacing_counters_match_what_was_dispatched(tiny_model, is_async):
    """The engine's /metrics counters, read through the utility call: per user,
    tokens = the sampling steps dispatched (charges minus refunds), throttled request-steps
    and seconds only for the user held back, the rate in force."""
    from tokenpace.engine._metrics import tokenpace_pacing_stats

    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(20, fast=1000))
    for i in range(4):
        sim.add(f"slow{i}", "slow", max_tokens=1000)
    sim.add("fast0", "fast", max_tokens=300)
    sim.run(5)
    sim.drain()

    class Core:
        scheduler = sim.scheduler

    stats = tokenpace_pacing_stats(Core())["pacing"]
    dispatched = Counter(user for _, _, user, _ in sim.dispatched)
    users = stats["users"]
    assert users["slow"][0] == dispatched["slow"] and users["fast"][0] == dispatched["fast"]
    assert users["slow"][2] > 0 and users["fast"][2] == 0  # throttled request-steps
    # The slow user had throttled streams nearly all the time; the fast one never.
    assert users["slow"][3] >= 4.0 and users["fast"][3] == 0.0
    assert users["slow"][4] == 20 and users["fast"][4] == 1000
    assert stats["folded_users"] == 0


def test_users_past_the_label_cap_share_one_label(tiny_model, is_async):
    sim = make_sim(tiny_model, is_async=is_async,
                   pacing={**paced(1000), "metrics_users": 2})
    for user in ("a", "b", "c", "d"):
        sim.add(f"{user}0", user, max_tokens=5)
    sim.run(1)
    stats = sim.scheduler.pacing_stats()
    assert set(stats["users"]) == {"a", "b", "__other__"}
    assert stats["users"]["__other__"][0] == 10 and stats["folded_users"] == 2
    assert stats["users"]["__other__"][4] is None  # no one rate stands for the others
