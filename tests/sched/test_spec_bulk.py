"""Bulk windows of speculative drafts, on vLLM's real scheduler and KV cache manager.

While every paced user has room for all it could take over the next steps, no stream asks
for its drafts; each user is charged what its requests delivered beyond the sure tokens
once per window, or when a request ends or is preempted (``pacing._drafts``, part 3). The
checks: a user's charged tokens equal its delivered tokens exactly (requests ending
inside windows, requests arriving and closing them, preemptions), the window bound of
docs/engine/modes.md holds for a user whose rate binds, and no window opens where output
lengths do not tell every delivered token.
"""

from __future__ import annotations

import pytest

from tests.sched._harness import NS, Sim, make_sim, max_in_window

BURST_S = 0.1
K = 4


def charged(sim: Sim, user: str) -> int:
    return sim.scheduler.planner.stats.of(user).tokens


def delivered(sim: Sim, user: str) -> int:
    """What ``user`` was delivered, plus the sure tokens of its steps that delivered
    nothing (dispatched while its request ended: charged at dispatch, as in any step)."""
    return (sum(n for rid, n in sim.tokens.items() if sim.users[rid] == user)
            + sim.undelivered[user])


MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


@pytest.mark.parametrize("is_async", MODES)
def test_ample_users_are_charged_exactly_what_they_were_delivered(tiny_model, is_async):
    """Three users far under their rates, requests of different lengths ending inside
    windows, and new ones arriving (each closes the open window): every user's charged
    tokens equal the tokens it was delivered, drafts included. Under async scheduling a
    request ends with the next step in flight (dispatched, delivering nothing)."""
    sim = make_sim(tiny_model, pacing={"default_user_output_tokens_per_second": 100000},
                   spec_tokens=K, max_model_len=4096, accept=0.6, is_async=is_async)
    lengths = (37, 101, 263)
    for i, n in enumerate(lengths):
        sim.add(f"r{i}", f"u{i}", max_tokens=n)
    for step in range(700):
        if step % 50 == 25 and step < 400:
            i = step // 50
            sim.add(f"late{i}", f"u{i % 3}", max_tokens=lengths[i % 3])
        sim.step()
    sim.drain()
    book = sim.scheduler._drafts
    assert book.windows > 10, "bulk windows must open for users far under their rates"
    assert sim.drafts_accepted > 300
    assert len(sim.finished) == 3 + 8, "every request ended (most inside a window)"
    for user in ("u0", "u1", "u2"):
        assert charged(sim, user) == delivered(sim, user), user


@pytest.mark.parametrize("is_async", MODES)
def test_a_preempted_request_is_counted_when_it_leaves_the_window(tiny_model, is_async):
    """KV blocks for about two of three long requests: vLLM preempts inside windows, the
    preempted request's delivered drafts are charged then (under async scheduling, when
    the results of its step in flight arrive: vLLM delivers them, stale), and its
    recomputed prompt charges nothing more."""
    sim = make_sim(tiny_model, pacing={"default_user_output_tokens_per_second": 100000},
                   spec_tokens=K, max_model_len=4096, accept=0.8, num_blocks=40,
                   is_async=is_async)
    for i in range(3):
        sim.add(f"r{i}", f"u{i}", prompt_len=64, max_tokens=240)
    for _ in range(600):
        sim.step()
    sim.drain()
    assert len(sim.finished) == 3
    assert sim.preempted, "the KV cache must run out"
    assert sim.scheduler._drafts.windows > 5
    for user in ("u0", "u1", "u2"):
        assert charged(sim, user) == delivered(sim, user), user


@pytest.mark.parametrize("is_async", MODES)
@pytest.mark.parametrize("streams", [1, 4])
def test_a_user_whose_rate_binds_keeps_its_bound_across_windows(tiny_model, streams, is_async):
    """At 300 tok/s with every draft accepted a stream could take 500 tok/s. Each phase
    starts after a quiet spell with a full burst's room, so windows open (a few steps
    long) and then the user's drafts are cut to its quota; over any window its delivered
    tokens stay within ``(W + 0.1) x R + 1 + k x n`` (docs/engine/modes.md), and what it
    was charged is what it was delivered."""
    rate, phases = 300, 5
    sim = make_sim(tiny_model, pacing={"default_user_output_tokens_per_second": rate},
                   spec_tokens=K, max_model_len=4096, accept=1.0, is_async=is_async)
    for phase in range(phases):
        for i in range(streams):
            sim.add(f"a{phase}-{i}", "a", max_tokens=90)
        sim.run(1.5)
    sim.drain()
    assert len(sim.finished) == phases * streams
    assert sim.scheduler._drafts.windows >= phases
    times = sim.delivered_times("a")
    assert len(times) == phases * streams * 90
    for window_s in (0.02, 0.05, 0.1, 0.2, 0.5, 1.0):
        bound = (window_s + BURST_S) * rate + 1 + K * streams
        got = max_in_window(times, int(window_s * NS))
        assert got <= bound, (window_s, got, bound)
    assert charged(sim, "a") == delivered(sim, "a")


@pytest.mark.parametrize("setting", ["event_log", "application"])
def test_no_window_opens_where_lengths_do_not_tell_every_token(tiny_model, tmp_path, setting):
    """An event log (it records each draft's charge at its step) and inner levels
    (charged per request at their own rates) keep the per-request grants."""
    pacing: dict = {"default_user_output_tokens_per_second": 100000, "trusted_gateway": True}
    xargs = None
    if setting == "event_log":
        pacing["event_log"] = str(tmp_path / "events.jsonl")
    if setting == "application":
        xargs = {"output_rate_application": "bot",
                 "output_rate_application_tokens_per_second": 100000}
    sim = make_sim(tiny_model, pacing=pacing, spec_tokens=K, max_model_len=4096, accept=0.6)
    for i in range(3):
        sim.add(f"r{i}", f"u{i}", max_tokens=5000, xargs=xargs)
    sim.run(1)
    sim.drain()
    sim.scheduler.shutdown()
    book = sim.scheduler._drafts
    assert book.windows == 0
    assert book.granted - book.returned == sim.drafts_accepted


@pytest.mark.parametrize("is_async", MODES)
def test_a_user_paced_in_the_middle_of_a_window_pays_from_then_on(tiny_model, is_async):
    """A gateway's rate-control call makes an unpaced user paced between two steps of a
    window: the tokens it was delivered before are free (it was not paced), and every
    token from the next step on is charged, once."""
    sim = make_sim(tiny_model, pacing={"user_output_tokens_per_second": {"p": 100000},
                                       "trusted_gateway": True},
                   spec_tokens=K, max_model_len=4096, accept=0.7, is_async=is_async)
    sim.add("u0", "u", max_tokens=1200)
    sim.add("p0", "p", max_tokens=1200)
    for _ in range(203):  # a window (16 steps at most) is open and part-way through
        sim.step()
    windows = sim.scheduler._drafts.windows
    assert windows > 5 and sim.scheduler._windows.open
    assert charged(sim, "u") == 0
    sim.scheduler.set_user_rates({"u": (100000.0, 1)})
    if is_async:  # the window step in flight was dispatched unpaced: its tokens are free
        sim.step()
    free = delivered(sim, "u")
    for _ in range(400):  # both end (inside a window): everything is counted
        sim.step()
    sim.drain()
    assert len(sim.finished) == 2
    assert sim.scheduler._drafts.windows > windows
    assert charged(sim, "u") == delivered(sim, "u") - free
    assert charged(sim, "p") == delivered(sim, "p")


@pytest.mark.parametrize("is_async", MODES)
def test_aborted_requests_are_charged_what_they_were_delivered(tiny_model, is_async):
    """Requests aborted inside windows: between steps, and (async) while a step is in
    flight and the next one just scheduled, so that two dispatched window steps deliver
    them nothing. Every user is charged exactly what it was delivered."""
    sim = make_sim(tiny_model, pacing={"default_user_output_tokens_per_second": 100000},
                   spec_tokens=K, max_model_len=4096, accept=0.7, is_async=is_async)
    for i in range(6):
        sim.add(f"r{i}", f"u{i % 3}", max_tokens=3000)
    aborts = {40: ("r0", False), 97: ("r1", True), 151: ("r2", True), 233: ("r3", False),
              301: ("r4", True)}
    for step in range(400):
        rid, in_flight = aborts.get(step, (None, False))
        if rid is not None and in_flight:
            sim.step(abort_in_flight=[rid])
            continue
        if rid is not None:
            sim.abort(rid)
        sim.step()
    assert sim.scheduler._drafts.windows > 10
    for i in range(6):
        sim.abort(f"r{i}")
    sim.drain()
    assert sim.tokens["r0"] < sim.tokens["r3"] < sim.tokens["r5"], "aborted part-way"
    for user in ("u0", "u1", "u2"):
        assert charged(sim, user) == delivered(sim, user), user


@pytest.mark.parametrize("is_async", MODES)
def test_long_prompts_and_a_cache_reset_inside_windows(tiny_model, is_async):
    """Prompts of 3,000 tokens, prefilled in chunks of at most 512 while windows may open
    (a chunk that does not end its prompt dispatches no sure token), and a prefix-cache
    reset that preempts every running request between two steps (vLLM drops their
    output in flight): every user is charged what it was delivered."""
    sim = make_sim(tiny_model, pacing={"default_user_output_tokens_per_second": 100000},
                   spec_tokens=K, max_model_len=4096, accept=0.7, is_async=is_async)
    for i in range(3):
        sim.add(f"r{i}", f"u{i}", max_tokens=600)
    for step in range(500):
        if step in (60, 200):
            sim.add(f"long{step}", f"u{step % 3}", prompt_len=3000, max_tokens=300)
        if step in (130, 290):
            assert sim.scheduler.reset_prefix_cache(reset_running_requests=True)
        sim.step()
    sim.drain()
    assert len(sim.finished) == 5
    assert sim.scheduler._drafts.windows > 10
    for user in ("u0", "u1", "u2"):
        assert charged(sim, user) == delivered(sim, user), user
