"""Applications paced inside their user, on vLLM's real scheduler.

A trusted gateway names a request's application in ``vllm_xargs.output_rate_application``
and sends its rate in ``output_rate_application_tokens_per_second``; a token is dispatched
only when the application's GCRA, its end user's (if it names one) and its user's all
allow it, and the one refund point returns all of them. Bounds are GCRA's: in any window of
W s at most ``(W + 0.1) x rate + 1``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.sched._harness import Sim, make_sim
from tests.sched.test_end_users import assert_within, times_of

pytestmark = pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])


def add(sim: Sim, rid: str, user: str, application: str | None, rate: float | None = None,
        end_user: str | None = None, **kw: object) -> None:
    xargs: dict[str, object] = {}
    if application is not None:
        xargs["output_rate_application"] = application
    if rate is not None:
        xargs["output_rate_application_tokens_per_second"] = rate
    if end_user is not None:
        xargs["output_rate_end_user"] = end_user
    sim.add(rid, user, xargs=xargs or None, **kw)  # type: ignore[arg-type]


def trusted(user_rate: float, **extra: object) -> dict:
    return {"trusted_gateway": True, "default_user_output_tokens_per_second": user_rate,
            **extra}


def test_an_application_at_its_rate_and_its_sibling_takes_the_rest(tiny_model: Path,
                                                                   is_async: bool) -> None:
    """User t at 30; application bot at 8 with 3 streams, app chat (no rate) with 2 and
    a stream of t's own: bot gets its 8, the others share the remaining 22."""
    sim = make_sim(tiny_model, is_async=is_async, pacing=trusted(30))
    for i in range(3):
        add(sim, f"bot{i}", "t", "bot", 8, max_tokens=1000)
    for i in range(2):
        add(sim, f"chat{i}", "t", "chat", max_tokens=1000)
    add(sim, "own", "t", None, max_tokens=1000)
    sim.run(10)
    bot = times_of(sim, {"bot0", "bot1", "bot2"})
    rest = times_of(sim, {"chat0", "chat1", "own"})
    assert_within(bot, 8, 10, at_least=True)
    assert_within(sorted(bot + rest), 30, 10, at_least=True)  # t gets all of its 30
    assert len(rest) >= 22 * 10 - 2, len(rest)


def test_three_levels_each_hold_its_bound(tiny_model: Path, is_async: bool) -> None:
    """User t at 20; application bot at 12; its end users at 5: alice (2 streams) and bob
    (2) and carol (2) want 15 together, bot caps them at 12; app chat's end user dave at
    5; t's 20 binds bot's 12 + dave's 5 = 17? No: 17 < 20, so each inner bound binds."""
    sim = make_sim(tiny_model, is_async=is_async,
                   pacing=trusted(20, end_user_output_tokens_per_second=5))
    for e in ("alice", "bob", "carol"):
        for i in range(2):
            add(sim, f"{e}{i}", "t", "bot", 12, end_user=e, max_tokens=1000)
    add(sim, "dave0", "t", "chat", end_user="dave", max_tokens=1000)
    sim.run(10)
    per_user = {e: times_of(sim, {f"{e}0", f"{e}1"}) for e in ("alice", "bob", "carol")}
    for times in per_user.values():
        assert_within(times, 5, 10, at_least=False)
    bot = sorted(t for times in per_user.values() for t in times)
    assert_within(bot, 12, 10, at_least=True)  # the application binds, not its end users
    assert_within(times_of(sim, {"dave0"}), 5, 10, at_least=True)
    counts = [len(t) for t in per_user.values()]
    assert max(counts) - min(counts) <= 0.1 * max(counts), counts


def test_the_user_binds_its_applications_together(tiny_model: Path, is_async: bool) -> None:
    """User t at 10; applications a and b at 8 each: together they want 16, t gives 10."""
    sim = make_sim(tiny_model, is_async=is_async, pacing=trusted(10))
    for app in ("a", "b"):
        for i in range(2):
            add(sim, f"{app}{i}", "t", app, 8, max_tokens=1000)
    sim.run(10)
    a, b = times_of(sim, {"a0", "a1"}), times_of(sim, {"b0", "b1"})
    assert_within(a, 8, 10, at_least=False)
    assert_within(b, 8, 10, at_least=False)
    assert_within(sorted(a + b), 10, 10, at_least=True)
    assert abs(len(a) - len(b)) <= 0.15 * len(a), (len(a), len(b))


def test_applications_are_namespaced_by_their_user(tiny_model: Path, is_async: bool) -> None:
    """Two users' applications of the same name are two quotas."""
    sim = make_sim(tiny_model, is_async=is_async, pacing=trusted(100))
    add(sim, "t0", "t", "bot", 5, max_tokens=1000)
    add(sim, "u0", "u", "bot", 5, max_tokens=1000)
    sim.run(8)
    assert_within(times_of(sim, {"t0"}), 5, 8, at_least=True)
    assert_within(times_of(sim, {"u0"}), 5, 8, at_least=True)


def test_a_refund_returns_every_level(tiny_model: Path, is_async: bool, tmp_path: Path) -> None:
    """Charges the scheduler does not dispatch (chunked last prefill chunks, KV pressure)
    come back to the user, the application and the end user: the event log's charges
    minus refunds equal what was dispatched, and the application gets all of its rate
    from the end of the prompts."""
    log = tmp_path / "events.jsonl"
    sim = make_sim(tiny_model, is_async=is_async, max_num_batched_tokens=64, num_blocks=60,
                   pacing=trusted(40, end_user_output_tokens_per_second=8,
                                  event_log=str(log)))
    for i in range(6):
        add(sim, f"r{i}", "t", "bot", 12, end_user=("e1", "e2")[i % 2],
            prompt_len=150, max_tokens=60)
    sim.run(6)
    sim.scheduler.shutdown()
    net: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        event = json.loads(line)
        net[event["request_id"]] += 1 if event["event"] == "charge" else -1
    assert +net == +Counter(rid for _, _, _, rid in sim.dispatched)
    bot = times_of(sim, {f"r{i}" for i in range(6)})
    assert_within(bot, 12, 6, at_least=False)
    # Backlogged from the end of the prompts (0.2 s): a charge not returned to the
    # application would cost it tokens for good.
    assert len(bot) >= 12 * 5.8 - 1, len(bot)
    for e, rids in (("e1", {"r0", "r2", "r4"}), ("e2", {"r1", "r3", "r5"})):
        assert_within(times_of(sim, rids), 8, 6, at_least=False)


def test_a_throttled_application_gives_its_active_slot_away(tiny_model: Path,
                                                            is_async: bool) -> None:
    """2 active slots of 16: an application at 2 tok/s with 4 streams resident does not
    keep another user's stream from sampling every step."""
    sim = make_sim(tiny_model, is_async=is_async, max_num_seqs=16, max_num_active_seqs=2,
                   pacing=trusted(1000))
    for i in range(4):
        add(sim, f"a{i}", "t", "bot", 2, max_tokens=400)
    sim.run(1)
    arrival = sim.step_index
    sim.add("other0", "u", max_tokens=400)
    sim.run(2)
    steps = sorted({step for step, _, user, _ in sim.dispatched if user == "u"})
    assert steps[0] <= arrival + 2
    assert steps == list(range(steps[0], sim.step_index + 1)), "u samples every step"
    assert len(sim.scheduler.running) == 5, "the application's streams stay resident"
    assert_within(times_of(sim, {f"a{i}" for i in range(4)}), 2, 3, at_least=False)


def test_the_engine_waits_while_the_application_is_out_of_quota(tiny_model: Path,
                                                                is_async: bool) -> None:
    sim = make_sim(tiny_model, is_async=is_async, pacing=trusted(1000))
    add(sim, "r0", "t", "bot", 2, max_tokens=100)
    add(sim, "r1", "t", "bot", max_tokens=100)
    waits = []
    for _ in range(60):
        sim.step()
        waits.append(sim.scheduler.idle_wait_seconds())
    assert max(waits) > 0.2, "2 tok/s: half a second between tokens, no busy loop"
    assert max(waits) <= 0.5 + 0.011


def test_an_application_rate_needs_a_trusted_gateway(tiny_model: Path, is_async: bool) -> None:
    """Without trusted_gateway the rate is ignored (logged): the user's rate alone."""
    sim = make_sim(tiny_model, is_async=is_async,
                   pacing={"default_user_output_tokens_per_second": 20})
    add(sim, "r0", "t", "bot", 2, max_tokens=1000)
    sim.run(5)
    assert len(times_of(sim, {"r0"})) >= 20 * 5 - 1


def test_an_application_is_paced_where_its_user_is_not(tiny_model: Path,
                                                       is_async: bool) -> None:
    """A tenant without output_tokens_per_second: its application's rate still holds."""
    sim = make_sim(tiny_model, is_async=is_async, pacing={"trusted_gateway": True})
    for i in range(2):
        add(sim, f"r{i}", "t", "bot", 6, max_tokens=1000)
    sim.run(5)
    assert_within(times_of(sim, {"r0", "r1"}), 6, 5, at_least=True)


def test_an_application_with_its_own_end_user_rate_has_its_own_end_users(
        tiny_model: Path, is_async: bool) -> None:
    """User t's end users at 6 (its end-user rate); application kiosk's own end users at 2:
    alice through kiosk is paced at 2, alice through t's other application at 6, and the
    two are separate quotas (kiosk's alice is kiosk's own)."""
    sim = make_sim(tiny_model, is_async=is_async,
                   pacing=trusted(100, end_user_output_tokens_per_second=6))
    sim.add("kiosk0", "t", max_tokens=1000, xargs={
        "output_rate_application": "kiosk", "output_rate_end_user": "alice",
        "output_rate_application_end_user_tokens_per_second": 2})
    sim.add("chat0", "t", max_tokens=1000, xargs={
        "output_rate_application": "chat", "output_rate_end_user": "alice"})
    sim.run(8)
    assert_within(times_of(sim, {"kiosk0"}), 2, 8, at_least=True)
    assert_within(times_of(sim, {"chat0"}), 6, 8, at_least=True)
