"""Speculative decoding under pacing, on vLLM's real scheduler and KV cache manager.

A step verifies ``k`` drafts besides its sure token and delivers 1 to ``k + 1`` tokens.
The drafts are granted from the quota before the step, cut to it, and the rejected ones
go back when the results arrive (``pacing._drafts``). Bound, counting each delivered token
at its step's dispatch instant: ``(W + 0.1) x R + 1 + k x n`` over any window, ``n`` the
user's streams (docs/engine/modes.md, "Speculative decoding").
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.sched._harness import NS, Sim, make_sim, max_in_window
from tokenpace.engine import read_charges

pytestmark = pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])

BURST_S = 0.1
K = 4


def paced(default: float | None = None, **overrides: float) -> dict:
    cfg: dict = {}
    if default is not None:
        cfg["default_user_output_tokens_per_second"] = default
    if overrides:
        cfg["user_output_tokens_per_second"] = overrides
    return cfg


def assert_bound(sim: Sim, user: str, rate: float, seconds: float, streams: int) -> None:
    times = sim.delivered_times(user)
    assert len(times) >= rate * seconds * 0.97, (user, len(times))
    for window_s in (0.05, 0.2, 0.5, 1.0, seconds):
        bound = (window_s + BURST_S) * rate + 1 + K * streams
        got = max_in_window(times, int(window_s * NS))
        assert got <= bound, (user, window_s, got, bound)


@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("rate", [50, 250])
def test_a_paced_user_with_drafts_gets_its_rate_and_no_more(tiny_model, is_async, streams,
                                                             rate):
    """At 100 steps/s, 50 tok/s needs no drafts (a sure token every other step) and 250
    tok/s needs them (2.5 tokens per step for one stream)."""
    sim = make_sim(tiny_model, is_async=is_async, pacing=paced(rate), spec_tokens=K, max_model_len=4096,
                   accept=0.7)
    for i in range(streams):
        sim.add(f"a{i}", "a", max_tokens=5000)
    sim.run(10)
    sim.drain()
    if rate > 100 * streams:
        assert sim.drafts_accepted > 500, "drafts must be verified and accepted"
    assert_bound(sim, "a", rate, 10, streams)


def test_an_unthrottled_user_keeps_every_draft(tiny_model, is_async):
    """Pacing that never binds changes nothing: every proposed draft is verified."""
    runs = {}
    for paced_class in (False, True):
        sim = make_sim(tiny_model, is_async=is_async, pacing=paced(100000),
                       paced_class=paced_class, spec_tokens=K, max_model_len=4096, accept=0.6)
        for i in range(3):
            sim.add(f"r{i}", f"u{i}", max_tokens=400)
        sim.run(1)
        sim.drain()
        runs[paced_class] = (sim.drafts_scheduled, dict(sim.tokens))
    assert runs[True] == runs[False]


def test_a_throttled_users_drafts_are_cut_to_its_quota(tiny_model, is_async):
    """At 20 tok/s with 10 ms steps a user has a token every 5 steps: it must not be
    sent 4 drafts per step that would be delivered over its rate, nor verified for
    nothing. Another user beside it keeps all its drafts."""
    sim = make_sim(tiny_model, is_async=is_async, pacing={**paced(None, slow=20), "trusted_gateway": True},
                   spec_tokens=K, max_model_len=4096, accept=1.0)
    sim.add("s", "slow", max_tokens=5000)
    sim.add("f", "fast", max_tokens=5000)
    sim.run(5)
    sim.drain()
    drafts = Counter()
    for out in sim.outputs:
        for rid, spec in out.scheduled_spec_decode_tokens.items():
            drafts[rid] += len(spec)
    slow = len(sim.delivered_times("slow"))
    # Every scheduled draft of the slow user was accepted (accept=1.0), so verifying
    # more than its quota would show as tokens over its rate.
    assert slow <= (5 + BURST_S) * 20 + 1 + K, slow
    assert slow >= 5 * 20 * 0.97
    assert drafts["s"] <= slow, "drafts verified beyond what the user could be delivered"
    assert sim.tokens["f"] >= 5 * 100 * 4, "the unpaced user keeps its drafts"


def test_rejected_drafts_go_back(tiny_model, is_async, tmp_path):
    """With half the drafts rejected the user still gets its rate in delivered tokens
    (300 tok/s over two streams at 100 steps/s needs drafts), and the event log's net
    charges per request equal the tokens delivered."""
    log = tmp_path / "events.jsonl"
    sim = make_sim(tiny_model, is_async=is_async, pacing={**paced(300), "event_log": str(log)},
                   spec_tokens=K, max_model_len=4096, accept=0.5)
    sim.add("a0", "a", max_tokens=5000)
    sim.add("a1", "a", max_tokens=5000)
    sim.run(8)
    sim.drain()
    sim.scheduler.shutdown()
    assert sim.drafts_scheduled > sim.drafts_accepted > 50
    assert_bound(sim, "a", 300, 8, 2)
    net = {rid: len(stamps) for (_, rid), stamps in read_charges(log).items()}
    assert net == dict(sim.tokens)
    book = sim.scheduler._drafts
    assert book.granted - book.returned == sim.drafts_accepted
    events = Counter(json.loads(line)["event"] for line in log.read_text().splitlines())
    assert events["reject"] > 0


def test_drafts_of_an_application_are_cut_at_its_level(tiny_model, is_async):
    """Inner levels take the drafts too: an application at 10 tok/s inside an unpaced
    user gets 10 tok/s, drafts included."""
    sim = make_sim(tiny_model, is_async=is_async,
                   pacing={"trusted_gateway": True}, spec_tokens=K, max_model_len=4096, accept=1.0)
    xargs = {"output_rate_application": "bot",
             "output_rate_application_tokens_per_second": 10}
    sim.add("b0", "t", max_tokens=5000, xargs=xargs)
    sim.add("b1", "t", max_tokens=5000, xargs=xargs)
    sim.run(6)
    sim.drain()
    got = sim.tokens["b0"] + sim.tokens["b1"]
    assert 6 * 10 * 0.97 <= got <= (6 + BURST_S) * 10 + 1 + 2 * K
