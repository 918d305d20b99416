"""Speculative decoding on real vLLM servers on the CPU, paced.

The tiny model drafts for itself (``--speculative-config`` with the same weights, 3 drafts
a step): with greedy sampling every draft is accepted, so an unpaced stream gets about
four tokens a step, and a paced user's drafts are what its quota allows. Rates are read
at the source (the engine's event log, net of rejected drafts). A second engine, under
async scheduling and without an event log, charges drafts in bulk windows; its metered
tokens are checked against what the clients received.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests._engine_pool import ModuleEngines
from tests._servers import (Server, engine_series, free_port, paced_vllm_server_argv,
                            tokenpace_serve_argv, vllm_counter)
from tests.e2e._engine_log import all_dispatches, paced_rate, wait_for_engine_requests
from tests.e2e._timing import expect
from tokenpace.engine import read_charges

pytestmark = pytest.mark.vllm

K = 3
MID_RATE = 150.0  # above one token per step here: reached only with drafts
SLOW_RATE = 20.0


def ENGINES(tiny_model: Path, logs: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    port = free_port()
    pacing = {
        "default_user_output_tokens_per_second": SLOW_RATE,
        "user_output_tokens_per_second": {"mid": MID_RATE, "free": 1e6},
        "event_log": str(logs / "events.jsonl"),
    }
    spec = {"model": str(tiny_model), "num_speculative_tokens": K}
    bulk_port = free_port()
    return [Server(paced_vllm_server_argv(tiny_model, port, pacing, "--speculative-config",
                                          json.dumps(spec)), port, logs / "vllm.log"),
            Server(tokenpace_serve_argv(
                tiny_model, bulk_port, "--default-user-output-tokens-per-second", "100000",
                "--speculative-config", json.dumps(spec), "--async-scheduling"),
                bulk_port, logs / "vllm-bulk.log")]


@pytest.fixture(scope="module")
def server(module_engines: ModuleEngines) -> Server:
    return module_engines.servers[0]


@pytest.fixture(scope="module")
def bulk_server(module_engines: ModuleEngines) -> Server:
    return module_engines.servers[1]


def _complete(server: Server, user: str, max_tokens: int) -> int:
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "Hello there", "max_tokens": max_tokens,
              "ignore_eos": True, "temperature": 0, "vllm_xargs": {"output_rate_user": user}},
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["completion_tokens"]


def _accepted_drafts(server: Server) -> float:
    return vllm_counter(server, "vllm:spec_decode_num_accepted_tokens_total")


def test_drafts_are_used_and_the_rate_holds(server: Server) -> None:
    """A 150 tok/s user (one stream, more than a token per step: only drafts get it
    there) and a 20 tok/s user with two streams, side by side. At the engine's event log:
    each user's paced rate (net of the engine's absences) within 3% below and 1% above
    its rate; over every window the 20 tok/s user within ``(W + 0.1) x R + 1 + k x 2``.
    vLLM's own counter shows drafts accepted in the run."""
    before = _accepted_drafts(server)
    since = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        mid = pool.submit(_complete, server, "mid", 450)
        slow = [pool.submit(_complete, server, "slow", 60) for _ in range(2)]
        assert mid.result() == 450 and [f.result() for f in slow] == [60, 60]
    events = server.log_path.parent / "events.jsonl"
    found = wait_for_engine_requests(events, {"mid", "slow"}, since, 570, exact=True)
    everyone = all_dispatches(events, since)
    logs = [server.log_path, events]
    accepted = _accepted_drafts(server) - before
    # How many depends on the machine's step rate (at 90 steps/s the 150 tok/s user needs
    # about 0.7 accepted drafts a step; a CI host once accepted 18); some must be.
    assert accepted > 0, f"only {accepted} drafts accepted: pacing kept them from running"
    for user, limit, tokens in (("mid", MID_RATE, 450), ("slow", SLOW_RATE, 120)):
        times = sorted(t for r in found if r.user == user for t in r.times)
        assert len(times) == tokens, (user, len(times), events)
        rate = paced_rate(times, limit, everyone)
        for bound, upper in ((0.97 * limit, False), (1.01 * limit, True)):
            expect("spec_decode_server", f"{user} paced rate ({limit} tok/s)",
                   rate.paced_rate, bound, upper=upper, logs=logs, accepted=accepted,
                   **rate.as_series())
    slow_times = sorted(t for r in found if r.user == "slow" for t in r.times)
    for window in (0.25, 0.5, 1.0, 2.0):
        most = max(sum(1 for u in slow_times if t <= u <= t + window) for t in slow_times)
        assert most <= (window + 0.1) * SLOW_RATE + 1 + K * 2, (window, most)


def test_an_unpaced_user_keeps_every_draft(server: Server) -> None:
    """A user far under its rate gets every draft: about 1 + k tokens per step, so a
    request's tokens come in far fewer distinct dispatch instants than tokens."""
    since_ns = time.monotonic_ns()
    before = _accepted_drafts(server)
    assert _complete(server, "free", 200) == 200
    events = server.log_path.parent / "events.jsonl"
    deadline = time.monotonic() + 10
    while True:
        charges = [t for (user, _), ts in read_charges(events, {"free"}).items() for t in ts
                   if t >= since_ns]
        # Exactly: a step's rejected drafts are logged after its charges (201 seen once
        # in CI when the log was read between the two); more after 10 s fails below.
        if len(charges) == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(charges) == 200
    steps = len(set(charges))
    assert steps <= 200 / (1 + K) + 5, f"{steps} steps for 200 tokens: drafts were cut"
    assert _accepted_drafts(server) - before >= 200 - steps - 1


def test_drafts_charged_in_bulk_windows_are_what_the_clients_received(
        bulk_server: Server) -> None:
    """Async scheduling, users far under their rates: drafts are charged once per window
    from output lengths (the engine says so at start-up). Four streams of two users, every
    draft accepted: each user's metered output tokens are what its clients received, plus
    at most one sure token per request for a step dispatched past its last token (under
    async scheduling a step is planned before the previous one's results are in)."""
    log = bulk_server.log_path.read_text(errors="replace")
    assert "PacedAsyncScheduler" in log and "(bulk windows)" in log, bulk_server.log_tail()
    before_tokens = engine_series(bulk_server)
    before = _accepted_drafts(bulk_server)
    jobs = [("bulk-a", 180), ("bulk-a", 97), ("bulk-b", 150), ("bulk-b", 61)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _complete(bulk_server, *job), jobs))
    assert got == [n for _, n in jobs]
    accepted = _accepted_drafts(bulk_server) - before
    assert accepted >= 0.5 * sum(got), f"only {accepted} drafts accepted"
    after = engine_series(bulk_server)
    for user in ("bulk-a", "bulk-b"):
        received = sum(n for u, n in jobs if u == user)
        key = ("tokenpace_engine_output_tokens_total", user)
        metered = after.get(key, 0.0) - before_tokens.get(key, 0.0)
        assert received <= metered <= received + 2, (user, received, metered)
