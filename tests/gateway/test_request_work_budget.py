"""How much work one request costs the gateway, counted, not timed.

Timings move 2-3x between days on a shared VM, so a feature that doubled the gateway's CPU
per request would pass any timed check; a count of the Python function calls one request
makes does not depend on the machine's speed. The gateway runs in process, driven through
its ASGI interface with nothing else on top (no HTTP client or server in the count), in
front of the canned fast upstream in its own process; requests go one at a time and the
calls made on the gateway's thread while they run are counted (``sys.setprofile``: Python
functions only; C functions are work too, but a Python caller is counted for each).

The budgets below are the counts of 2026-12-04 (printed by every run) with about 15% of
room for what varies between runs (event-loop turns while waiting on the upstream, a
background loop's turn: runs on this machine differed by up to 1.5%). A change that needs
more per request raises its budget here, in its own review, with the reason; one that needs
less lowers it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._servers import free_port
from tokenpace.gateway.config import parse_config
from tokenpace.gateway.server import Gateway

REQUESTS = 60  # per case, after a warm-up
# Per (tenant, streamed): Python function calls per request as measured on 2026-12-04 and
# their budget, then calls of C functions measured and budget (budget: measured x ~1.15).
# Raised on 2026-12-05 by the ledger's journal (an entry before dispatch and one at the end:
# a cleaned row, one json.dumps and one os.write each, what makes a request survive a
# SIGKILL of the gateway) and by asking the engine for cut requests' counts: +35 to +60 C
# calls, +30 to +40 Python calls per request.
BUDGETS: dict[tuple[str, bool], tuple[int, int, int, int]] = {
    ("plain", False): (383, 440, 344, 395),
    ("plain", True): (518, 595, 690, 795),
    ("full", False): (539, 620, 434, 500),
    ("full", True): (679, 780, 773, 890),
}
TOKENS = 16  # output tokens of each request (16 chunks when streamed)


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenpace.bench._fast_upstream", str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "fast upstream did not start"
        time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def config(upstream: str, ledger: Path) -> Any:
    return parse_config({
        "engines": [{"url": upstream, "models": ["tiny"], "max_inflight": 64}],
        "ledger": f"sqlite:///{ledger}",
        "tenants": [
            {"id": "plain", "api_keys": ["sk-plain"]},
            # Every per-request check a tenant can have: budgets, request limits, a
            # concurrency limit, a rate, end users; the key is an application's with its own.
            {"id": "full", "output_tokens_per_second": 1000,
             "end_user_output_tokens_per_second": 100, "max_concurrency": 8,
             "max_input_tokens": 4096, "max_output_tokens": 256,
             "budgets": [{"tokens": 10**9, "per": "10s"}, {"tokens": 10**12, "per": "1d"}],
             "max_requests": [{"requests": 10**6, "per": "1m"}],
             "applications": [{"id": "bot", "api_keys": ["sk-full-bot"],
                               "output_tokens_per_second": 500, "max_concurrency": 8,
                               "budgets": [{"tokens": 10**9, "per": "10s"}],
                               "max_requests": [{"requests": 10**6, "per": "1m"}]}]},
        ],
    })


KEYS = {"plain": b"sk-plain", "full": b"sk-full-bot"}


async def request(app: Any, key: bytes, stream: bool) -> int:
    """One completion through the app's ASGI interface; its status."""
    body = json.dumps({"model": "tiny", "prompt": "Hello there", "max_tokens": TOKENS,
                       "stream": stream, "user": "reader-1"}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"gw"), (b"content-type", b"application/json"),
                         (b"authorization", b"Bearer " + key),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    gone = asyncio.Event()  # the client never leaves

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    status = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


def count_calls(upstream: str, tmp_path: Path) -> tuple[dict[tuple[str, bool], float],
                                                         dict[tuple[str, bool], float]]:
    """Per case: Python function calls per request, and calls of C functions."""
    counts: dict[tuple[str, bool], float] = {}
    c_counts: dict[tuple[str, bool], float] = {}

    async def body() -> None:
        gateway = Gateway(config(upstream, tmp_path / "usage.db"))
        async with gateway._lifespan(None):  # type: ignore[arg-type]
            for case in BUDGETS:
                tenant, stream = case
                for _ in range(10):  # warm-up: bound children, caches, connections
                    assert await request(gateway, KEYS[tenant], stream) == 200
                calls = c_calls = 0

                def profile(frame: Any, event: str, arg: Any) -> None:
                    nonlocal calls, c_calls
                    if event == "call":
                        calls += 1
                    elif event == "c_call":
                        c_calls += 1

                sys.setprofile(profile)
                try:
                    for _ in range(REQUESTS):
                        status = await request(gateway, KEYS[tenant], stream)
                        assert status == 200
                finally:
                    sys.setprofile(None)
                counts[case] = calls / REQUESTS
                c_counts[case] = c_calls / REQUESTS

    asyncio.run(body())
    return counts, c_counts


def test_the_work_of_one_request_stays_within_its_budget(upstream: str, tmp_path: Path) -> None:
    counts, c_counts = count_calls(upstream, tmp_path)
    report = "\n".join(
        f"  {tenant:5} {'streamed' if stream else 'plain':8} "
        f"{counts[(tenant, stream)]:5.0f} Python calls (measured {py}, budget {py_budget}), "
        f"{c_counts[(tenant, stream)]:5.0f} C calls (measured {c}, budget {c_budget})"
        for (tenant, stream), (py, py_budget, c, c_budget) in BUDGETS.items())
    print("\nCalls per request:\n" + report)
    over = [case for case, (_, py_budget, _, c_budget) in BUDGETS.items()
            if counts[case] > py_budget or c_counts[case] > c_budget]
    assert not over, f"over budget: {over}\n{report}"
