"""A real vLLM server on the CPU with the paced scheduler paces each user."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests._servers import Server, free_port, paced_vllm_server_argv
from tests.e2e._timing import expect

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    logs = tmp_path_factory.mktemp("paced")
    pacing = {
        "default_user_output_tokens_per_second": 20,
        "user_output_tokens_per_second": {"fast": 100},
        "event_log": str(logs / "events.jsonl"),
    }
    srv = Server(paced_vllm_server_argv(tiny_model, port, pacing), port, logs / "vllm.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


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
    """Whole requests, send to last byte: client read bursts cannot shrink that interval.

    Lower bounds are GCRA's own (the burst netted out, 3% for clock granularity); the
    upper ones leave 1.6 s (slow) and 1 s (fast) of lag for a loaded 2-core machine,
    while a limiter that did not pace at all would finish both in well under a second.
    """
    with ThreadPoolExecutor(4) as pool:
        slow = [pool.submit(_complete, server, "slow", 30) for _ in range(2)]
        fast = pool.submit(_complete, server, "fast", 150)
        results = [f.result() for f in slow]
        fast_elapsed, fast_tokens = fast.result()
    assert [n for _, n in results] == [30, 30] and fast_tokens == 150
    slow_elapsed = max(t for t, _ in results)
    series = {"slow_s": [t for t, _ in results], "fast_s": fast_elapsed}
    logs = [server.log_path]
    # 60 tokens at 20 tok/s, of which 3 may come in the first 100 ms burst.
    expect("paced_server", "slow user's 2 x 30 tokens (s)", slow_elapsed,
           (60 - 3) / 20 * 0.97, upper=False, logs=logs, **series)
    expect("paced_server", "slow user's 2 x 30 tokens (s)", slow_elapsed, (60 / 20) * 1.5,
           logs=logs, **series)
    expect("paced_server", "fast user's 150 tokens (s)", fast_elapsed,
           (150 - 11) / 100 * 0.97, upper=False, logs=logs, **series)
    expect("paced_server", "fast user's 150 tokens (s)", fast_elapsed, (150 / 100) * 1.6,
           logs=logs, **series)


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
