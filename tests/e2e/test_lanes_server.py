"""Lanes on the real CPU engine: `tokenpace serve --scheduling-policy priority
--max-num-seqs 4` (4 requests run per step, 4 more places hold). Four low-priority requests
of 30,000 tokens fill the engine; a high-priority request of 16 tokens sent then finishes
while none of the four has ended. With vLLM's own priority scheduling it would wait for one
of them to end (30,000 steps; it needs about 20).

Measured at the source, the engine's event log (every user has a rate no request reaches,
so the log names them; nothing is throttled): the high request is sent once the log shows
all four low ones dispatching, and the assertion is on token counts, not time: at the high
request's last token each low request has fewer than its 30,000. A client-side signal
would not do: on a loaded machine the API server's streams lag the engine by seconds, and
4,000-token requests were over in the engine before their first chunks reached the client.
The low requests are long for that reason (the tiny model's positions are stretched for
them; its weights are random anyway) and not streamed (the API server has less to do).

Margin: the high request needs about 20 engine steps; each low one 30,000, two minutes and
more of the engine's time on this machine (its steps slow down as the contexts grow), so the
client and the API server may fall that far behind the engine before the test is void. It
passed 5 runs of 5 idle and 5 of 6 beside one or two busy processes (in the sixth they
starved the API server for minutes, two low requests never reached the engine, and the test
said so); with ``--no-lanes`` it fails on the token count (a low request had all its
tokens, after 265 s, before the high one's first).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from tests._engine_pool import ModuleEngines
from tests._servers import Server, free_port, tokenpace_serve_argv
from tests.e2e._engine_log import engine_requests, wait_for_engine_requests

pytestmark = pytest.mark.vllm

LOW_TOKENS = 30000  # engine steps a low request needs: a minute or more, whatever lags the test
MODEL_LEN = 32768  # the tiny model's positions (4096) stretched for them (its weights are random)
HIGH_TOKENS = 16
SLOTS = 4
NEVER_REACHED = 100000  # tokens per second: paced (so the event log names the user), never throttled


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    port = free_port()
    argv = tokenpace_serve_argv(
        tiny_model, port, "--scheduling-policy", "priority", "--max-num-seqs", str(SLOTS),
        "--default-user-output-tokens-per-second", str(NEVER_REACHED),
        "--output-rate-event-log", str(home / "events.jsonl"),
        "--hf-overrides", json.dumps({"max_position_embeddings": MODEL_LEN}),
        "--max-model-len", str(MODEL_LEN))
    return [Server(argv, port, home / "vllm.log")]


@pytest.fixture(scope="module")
def engine(module_engines: ModuleEngines) -> tuple[Server, Path]:
    [server] = module_engines.servers
    return server, module_engines.home / "events.jsonl"


def _body(tokens: int, priority: int, user: str) -> dict:
    return {"model": "tiny", "prompt": [17, 42, 99, 7, 256, 31, 64, 128], "max_tokens": tokens,
            "ignore_eos": True, "priority": priority,
            "vllm_xargs": {"output_rate_user": user}}


async def _lows_dispatching(events: Path, timeout_s: float) -> set[str]:
    """The low requests' ids once the event log shows all of them dispatching. Reads only
    what the engine appended since the last look: the log grows by thousands of lines a
    second, and parsing it whole at each look falls behind on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    offset = 0
    while len(seen) < SLOTS and time.monotonic() < deadline:
        if events.exists():
            with events.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk.rfind(b"\n") + 1
            offset += complete
            for line in chunk[:complete].splitlines():
                event = json.loads(line)
                if event["user"] == "low":
                    seen.add(event["request_id"])
        await asyncio.sleep(0.05)
    return seen


def _lane_series(page: str, name: str, priority: int) -> float:
    match = re.search(rf'^tokenpace_engine_{name}{{priority="{priority}"}} (\S+)$', page, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_high_priority_request_finishes_while_the_engine_stays_full(
        engine: tuple[Server, Path]) -> None:
    server, events = engine
    since = time.monotonic()

    async def main() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            url = f"{server.base_url}/v1/completions"
            lows = [asyncio.create_task(client.post(url, json=_body(LOW_TOKENS, 10, "low")))
                    for _ in range(SLOTS)]
            started = await _lows_dispatching(events, 300)
            assert len(started) == SLOTS, started  # all four run: the engine is full
            resp = await client.post(url, json=_body(HIGH_TOKENS, 0, "high"))
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == HIGH_TOKENS
            for task in lows:  # disconnecting aborts them in the engine
                task.cancel()
            await asyncio.gather(*lows, return_exceptions=True)

    asyncio.run(main())
    [high] = wait_for_engine_requests(events, ["high"], since, HIGH_TOKENS)
    assert len(high.times) == HIGH_TOKENS
    lows = engine_requests(events, ["low"], since)
    assert len(lows) == SLOTS
    for low in lows:
        # It did not wait for a low-priority request to end: none had all its tokens.
        done = sum(1 for t in low.times if t <= high.last)
        assert low.first < high.first and done < LOW_TOKENS, (low.request_id, done)
    page = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    assert _lane_series(page, "lane_admitted_total", 0) >= 1
    assert _lane_series(page, "lane_held_request_steps_total", 10) >= 1
    # Held for a slot is not throttled: a request counted throttled gives its slot away.
    assert re.search(r'^tokenpace_engine_throttled_request_steps_total\{user="low"\} 0\.0$',
                     page, re.M), page[-3000:]
