"""A real vLLM server on the CPU with the paced scheduler paces each user."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests._engine_pool import ModuleEngines
from tests._servers import Server, free_port, paced_vllm_server_argv
from tests.e2e._engine_log import all_dispatches, paced_rate, wait_for_engine_requests
from tests.e2e._timing import expect

pytestmark = pytest.mark.vllm


def ENGINES(tiny_model: Path, logs: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    port = free_port()
    pacing = {
        "default_user_output_tokens_per_second": 20,
        "user_output_tokens_per_second": {"fast": 100},
        "event_log": str(logs / "events.jsonl"),
    }
    return [Server(paced_vllm_server_argv(tiny_model, port, pacing), port, logs / "vllm.log")]


@pytest.fixture(scope="module")
def server(module_engines: ModuleEngines) -> Server:
    [srv] = module_engines.servers
    return srv


def _complete(server: Server, user: str, max_tokens: int) -> tuple[float, int]:
    start = time.monotonic()
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True,
              "vllm_xargs": {"output_rate_user": user}},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    return time.monotonic() - start, resp.json()["usage"]["completion_tokens"]


def test_each_user_at_its_rate_and_nothing_truncated(server: Server) -> None:
    """Every token delivered; each user's rate at the engine (event log).

    The rate is ``paced_rate``: net of GCRA's burst and of the time the engine was away
    (see tests/e2e/_engine_log.py). Whole-request durations, tried
    first, failed under load: a CPU-starved engine took 11 s for the
    slow user's 3 s. Bounds: GCRA makes the upper side exact (1% for rounding); 10% below
    is 0.29 s (slow, 60 tokens at 20 tok/s) or 0.14 s (fast, 150 at 100 tok/s) of lag that
    the limiter would have to cause while the engine runs. A limiter that did not pace
    exceeds the upper bound at once.
    """
    since = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        slow = [pool.submit(_complete, server, "slow", 30) for _ in range(2)]
        fast = pool.submit(_complete, server, "fast", 150)
        results = [f.result() for f in slow]
        fast_elapsed, fast_tokens = fast.result()
    assert [n for _, n in results] == [30, 30] and fast_tokens == 150
    events = server.log_path.parent / "events.jsonl"
    found = wait_for_engine_requests(events, {"slow", "fast"}, since, 210)
    everyone = all_dispatches(events, since)
    logs = [server.log_path, events]
    for user, limit, tokens in (("slow", 20, 60), ("fast", 100, 150)):
        times = [t for r in found if r.user == user for t in r.times]
        assert len(times) == tokens, (user, len(times), events)
        rate = paced_rate(times, limit, everyone)
        series = {**rate.as_series(), "slow_s": [t for t, _ in results], "fast_s": fast_elapsed}
        for bound, upper in ((0.9 * limit, False), (1.01 * limit, True)):
            expect("paced_server", f"{user} paced rate ({limit} tok/s)", rate.paced_rate, bound,
                   upper=upper, logs=logs, **series)


def test_plain_vllm_gets_the_scheduler_from_the_plugin_entry_point(server: Server) -> None:
    log = server.log_path.read_text(errors="replace")
    assert "tokenpace: pacing output tokens with PacedScheduler, sync scheduling" in log


def test_without_the_guard_a_malformed_identity_is_paced_not_fatal(server: Server) -> None:
    """Plain vLLM has no --middleware guard: the engine paces such a request as anonymous."""
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True,
              "vllm_xargs": {"output_rate_user": 42}},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
    assert "paced as __anonymous__" in server.log_path.read_text(errors="replace")
    assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
