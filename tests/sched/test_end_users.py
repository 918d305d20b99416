"""End users paced inside their user, on vLLM's real scheduler.

A request names its end user in ``vllm_xargs.output_rate_end_user``; with an end-user rate
r each end user gets at most r while its user (a gateway's tenant) stays within its own
rate R. Bounds are GCRA's: in any window of W s at most ``(W + 0.1) x rate + 1``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.sched._harness import NS, Sim, make_sim, max_in_window

pytestmark = pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])


def paced(default: float, end_user: float | None, **extra: object) -> dict:
    cfg: dict = {"default_user_output_tokens_per_second": default, **extra}
    if end_user is not None:
        cfg["end_user_output_tokens_per_second"] = end_user
    return cfg


def add(sim: Sim, rid: str, user: str, end_user: str | None, **kw: object) -> None:
    sim.add(rid, user, xargs={"output_rate_end_user": end_user} if end_user else None,
            **kw)  # type: ignore[arg-type]


def times_of(sim: Sim, rids: set[str]) -> list[int]:
    return [t for _, t, _, rid in sim.dispatched if rid in rids]


def assert_within(times: list[int], rate: float, seconds: float, *, at_least: bool) -> None:
    if at_least:
        assert len(times) >= rate * seconds - 1, len(times)
    for window_s in (0.05, 0.5, 1.0, seconds):
        assert max_in_window(times, int(window_s * NS)) <= (window_s + 0.1) * rate + 1, window_s


def test_each_end_user_at_its_rate_and_the_user_within_its_own(tiny_model: Path,
                                                               is_async: bool) -> None:
    """User t at 15 tok/s; its end users at 10 each: two of them want 20, t caps at 15."""
    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(15, 10))
    for e in ("alice", "bob"):
        for i in range(2):
            add(sim, f"{e}{i}", "t", e, max_tokens=1000)
    sim.run(10)
    alice = times_of(sim, {"alice0", "alice1"})
    bob = times_of(sim, {"bob0", "bob1"})
    assert_within(alice, 10, 10, at_least=False)
    assert_within(bob, 10, 10, at_least=False)
    assert_within(sorted(alice + bob), 15, 10, at_least=True)  # t gets all of its 15
    assert abs(len(alice) - len(bob)) <= 0.1 * len(alice), (len(alice), len(bob))


def test_an_end_user_below_its_user_gets_its_own_rate(tiny_model: Path, is_async: bool) -> None:
    """User t at 100; end user slow at 5 with 3 streams (taking turns); a request of t
    without an end user is paced under t alone and takes the rest."""
    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(100, 5))
    for i in range(3):
        add(sim, f"slow{i}", "t", "slow", max_tokens=1000)
    add(sim, "plain", "t", None, max_tokens=2000)
    sim.run(10)
    slow = times_of(sim, {"slow0", "slow1", "slow2"})
    assert_within(slow, 5, 10, at_least=True)
    counts = Counter(rid for _, _, _, rid in sim.dispatched if rid.startswith("slow"))
    assert max(counts.values()) - min(counts.values()) <= 2, counts  # turns
    assert_within(times_of(sim, {"plain"}), 100 - 5, 10, at_least=True)


def test_end_users_are_namespaced_by_their_user(tiny_model: Path, is_async: bool) -> None:
    """bob of tenant a and bob of tenant b are two people: each gets 5 tok/s."""
    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(100, 5))
    add(sim, "a-bob", "a", "bob", max_tokens=1000)
    add(sim, "b-bob", "b", "bob", max_tokens=1000)
    sim.run(6)
    for rid in ("a-bob", "b-bob"):
        assert_within(times_of(sim, {rid}), 5, 6, at_least=True)


def test_a_refund_returns_both_levels(tiny_model: Path, is_async: bool, tmp_path: Path) -> None:
    """Charges the scheduler does not dispatch (chunked last prefill chunks, KV pressure)
    come back to the user and the end user: the event log's charges minus refunds equal
    what was dispatched, and both rates hold."""
    log = tmp_path / "events.jsonl"
    sim = make_sim(tiny_model, is_async=is_async, max_num_batched_tokens=64, num_blocks=60,
                   pacing=paced(30, 10, event_log=str(log)))
    for i in range(6):
        add(sim, f"r{i}", "t", ("e1", "e2", "e3")[i % 3], prompt_len=150, max_tokens=60)
    sim.run(6)
    sim.scheduler.shutdown()
    net: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        event = json.loads(line)
        net[event["request_id"]] += 1 if event["event"] == "charge" else -1
    assert +net == +Counter(rid for _, _, _, rid in sim.dispatched)
    for e, rids in (("e1", {"r0", "r3"}), ("e2", {"r1", "r4"}), ("e3", {"r2", "r5"})):
        times = times_of(sim, rids)
        assert_within(times, 10, 6, at_least=False)
        # Backlogged from the end of the prompts (0.2 s): a charge not returned to the
        # end user would cost it tokens for good.
        assert len(times) >= 10 * 5.8 - 1, (e, len(times))
    assert_within(times_of(sim, {f"r{i}" for i in range(6)}), 30, 6, at_least=False)


def test_a_throttled_end_user_gives_its_active_slot_away(tiny_model: Path,
                                                         is_async: bool) -> None:
    """2 active slots of 16: an end user at 2 tok/s with 4 streams resident does not keep
    another user's stream from sampling every step."""
    sim = make_sim(tiny_model, is_async=is_async, max_num_seqs=16, max_num_active_seqs=2,
                   pacing=paced(1000, 2))
    for i in range(4):
        add(sim, f"e{i}", "t", "reader", max_tokens=400)
    sim.run(1)
    arrival = sim.step_index
    add(sim, "other0", "u", None, max_tokens=400)
    sim.run(2)
    steps = sorted({step for step, _, user, _ in sim.dispatched if user == "u"})
    assert steps[0] <= arrival + 2
    assert steps == list(range(steps[0], sim.step_index + 1)), "u samples every step"
    assert len(sim.scheduler.running) == 5, "the end user's streams stay resident"
    assert_within(times_of(sim, {f"e{i}" for i in range(4)}), 2, 3, at_least=False)


def test_the_engine_waits_while_every_end_user_is_out_of_quota(tiny_model: Path,
                                                               is_async: bool) -> None:
    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(1000, 2))
    add(sim, "r0", "t", "e", max_tokens=100)
    add(sim, "r1", "t", "e", max_tokens=100)
    waits = []
    for _ in range(60):
        sim.step()
        waits.append(sim.scheduler.idle_wait_seconds())
    assert max(waits) > 0.2, "2 tok/s: half a second between tokens, no busy loop"
    assert max(waits) <= 0.5 + 0.011


def test_a_trusted_gateway_sends_the_end_user_rate(tiny_model: Path, is_async: bool) -> None:
    sim = make_sim(tiny_model, is_async=is_async, pacing={"trusted_gateway": True})
    sim.add("r0", "t", max_tokens=1000, xargs={
        "output_rate_tokens_per_second": 50, "output_rate_end_user": "e",
        "output_rate_end_user_tokens_per_second": 4})
    sim.add("r1", "t", max_tokens=1000, xargs={"output_rate_end_user": "f"})
    sim.run(5)
    assert_within(times_of(sim, {"r0"}), 4, 5, at_least=True)
    assert_within(times_of(sim, {"r1"}), 4, 5, at_least=True)  # every end user of t
    sim.add("r2", "v", max_tokens=1000, xargs={"output_rate_tokens_per_second": 20,
                                                "output_rate_end_user": "e"})
    sim.run(5)  # v's end users have no rate: v's own alone
    r2 = [t for t in times_of(sim, {"r2"})]
    assert len(r2) >= 20 * 5 - 1
