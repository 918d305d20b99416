"""Fair dispatch end to end: a real gateway in front of two real ``tokenpace serve`` engines
(and, last, a conversation's turns kept on the engine that caches it).

One tenant floods its engine with long generations while another tenant, pinned to the
same engine, sends short requests: none of them waits in the gateway for a slot (the
ledger's queue time), and the short tenant's p95 time to first token with the flood
present stays within 2x of its p95 alone. Every tenant's tokens are produced by the
engine it is pinned to and by no other (read from each engine's event log, which names
the user of every charged token).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._engine_pool import ModuleEngines
from tests._servers import Server, free_port, tokenpace_serve_argv, vllm_counter
from tests.e2e._timing import expect
from tests.gateway.conftest import GatewayProcess, pinned_engine
from tokenpace.bench._load import percentile, stream_completion

pytestmark = pytest.mark.vllm

FAST = 100000  # a rate no tenant reaches: paced (so the event log names it), never throttled
FLOOD_RATE = 20  # the flood tenant's output tokens per second, shared by its streams
SAMPLES = 50


def pinned(tenant: str, urls: list[str]) -> str:
    return urls[pinned_engine(urls, tenant)]


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    engines = []
    for i in range(2):
        port = free_port()
        argv = tokenpace_serve_argv(tiny_model, port, "--trusted-gateway",
                                    "--allow-unauthenticated-trusted-gateway",
                                    "--output-rate-event-log", str(home / f"events-{i}.jsonl"),
                                    "--max-num-seqs", "16", "--enable-prompt-tokens-details")
        engines.append(Server(argv, port, home / f"vllm-{i}.log"))
    return engines


@pytest.fixture(scope="module")
def setup(module_engines: ModuleEngines) -> Iterator[dict[str, Any]]:
    engines, home = module_engines.servers, module_engines.home
    urls = [e.base_url for e in engines]
    flood_engine = pinned("flood", urls)
    short = next(f"short-{i}" for i in range(100) if pinned(f"short-{i}", urls) == flood_engine)
    other = next(f"other-{i}" for i in range(100) if pinned(f"other-{i}", urls) != flood_engine)
    config = {
        "engines": [{"url": url, "max_inflight": 8} for url in urls],
        "ledger": f"sqlite:///{home / 'usage.db'}",
        "tenants": [
            {"id": "flood", "api_keys": ["sk-flood"], "output_tokens_per_second": FLOOD_RATE,
             "max_concurrency": 6, "max_queued": 100},
            {"id": short, "api_keys": ["sk-short"], "output_tokens_per_second": FAST},
            {"id": other, "api_keys": ["sk-other"], "output_tokens_per_second": FAST},
            {"id": "chat", "api_keys": ["sk-chat"]},  # unpaced: its conversations choose
        ],
    }
    gateway = GatewayProcess(home, config)
    try:
        gateway.start()
        yield {"gateway": gateway, "engines": engines, "home": home, "short": short,
               "other": other, "urls": urls, "flood_engine": flood_engine}
    finally:
        gateway.stop()


async def ttfts(url: str, key: str, count: int) -> list[float]:
    async with httpx.AsyncClient(timeout=120, headers={"authorization": f"Bearer {key}"}) as c:
        out = []
        for _ in range(count):
            record = await stream_completion(c, url, None, 8)
            out.append(record.ttft)
            await asyncio.sleep(0.05)
        return out


def flood(url: str, stop: threading.Event) -> None:
    async def worker(c: httpx.AsyncClient) -> None:
        while not stop.is_set():
            await stream_completion(c, url, None, 300)

    async def main() -> None:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=600, limits=limits,
                                     headers={"authorization": "Bearer sk-flood"}) as c:
            workers = asyncio.gather(*[worker(c) for _ in range(12)])
            while not stop.is_set() and not workers.done():
                await asyncio.sleep(0.1)
            workers.cancel()  # the paced streams would run for another minute
            await asyncio.gather(workers, return_exceptions=True)

    asyncio.run(main())


def _rows_of(gw: GatewayProcess, tenant: str, since: float, count: int) -> list[Any]:
    """The ledger rows of ``tenant``'s requests started at or after ``since`` (wall clock),
    once ``count`` are written (the gateway batches its writes)."""
    deadline = time.monotonic() + 30
    while True:
        rows = [r for r in gw.rows_since(since, 0, timeout_s=0) if r.tenant == tenant]
        if len(rows) >= count or time.monotonic() > deadline:
            assert len(rows) == count, (tenant, len(rows), gw.server.log_path)
            return rows
        time.sleep(0.2)


def test_short_tenant_keeps_its_ttft_next_to_a_flood_and_tenants_stay_pinned(setup: dict[str, Any]) -> None:
    gw: GatewayProcess = setup["gateway"]
    # The third tenant's requests go first: this 2-core machine runs two engines, and an
    # engine left idle while the other is loaded answers slowly.
    asyncio.run(ttfts(gw.url, "sk-other", 5))
    asyncio.run(ttfts(gw.url, "sk-short", 5))  # warm-up
    alone = asyncio.run(ttfts(gw.url, "sk-short", SAMPLES))
    stop = threading.Event()
    flooding = threading.Thread(target=flood, args=(gw.url, stop), daemon=True)
    flooding.start()
    try:
        # The flood's 12 streams of 300 tokens: 6 run (max_concurrency), paced in the
        # engine at FLOOD_RATE together, and 6 wait in the gateway; the short tenant's
        # requests pass the waiting ones (its counter is lower) and find engine capacity
        # the paced flood leaves free.
        most_queued = 0.0
        for _ in range(10):  # the flood fills its concurrency and queues the rest
            time.sleep(0.3)
            most_queued = max(most_queued, gw.metric("tokenpace_gateway_queued_requests",
                                                     tenant="flood") or 0.0)
        assert most_queued >= 4
        crowded_since = time.time()
        crowded = asyncio.run(ttfts(gw.url, "sk-short", SAMPLES))
    finally:
        stop.set()
        flooding.join(timeout=30)
    p95_alone, p95_crowded = percentile(alone, 95), percentile(crowded, 95)
    print(f"short tenant TTFT p95 alone {p95_alone * 1000:.1f} ms, with the flood "
          f"{p95_crowded * 1000:.1f} ms (median {statistics.median(alone) * 1000:.1f} -> "
          f"{statistics.median(crowded) * 1000:.1f} ms)")
    logs = [setup["gateway"].server.log_path, *(e.log_path for e in setup["engines"])]
    # Held in the gateway, at the source: each short request's wait for a slot (the ledger's
    # queue_ms, admission to dispatch, measured inside the gateway process). A request
    # that finds room is dispatched in the same synchronous call: microseconds, whatever
    # the machine's load; 50 ms is room for a descheduled gateway process. The defect: a
    # short request held behind the flood (a flood that takes every engine slot, which
    # the flood's max_concurrency prevents, holds one for a 300-token stream: tens of
    # seconds; a stale saturation gate holds one until its next poll). The p95 below does
    # not see it: one request held 57 s among 50 left the p95 at 37 ms (checked with the
    # concurrency limit switched off).
    short_rows = _rows_of(gw, setup["short"], crowded_since, SAMPLES)
    queue_s = [(r.queue_ms or 0.0) / 1000 for r in short_rows]
    expect("fair_dispatch", "short tenant's longest wait for a slot with the flood (s)",
           max(queue_s), 0.050, logs=logs, queue_s=queue_s)
    # In the engine: TTFT is send to first byte at the client, one request's whole wait,
    # not a gap between chunks that a client's read bursts could shrink. The paced flood
    # must not slow the short tenant's first tokens: 2x the p95 alone leaves room for the
    # engine steps the flood's tokens take; the 0.25 s beyond it absorbs the CPU stalls of
    # a loaded 2-core machine running two engines, the gateway and this client (at load
    # 19-40 the p95 ratio alone reached 4.3 with a p95 alone of ~40 ms; 10 runs at load
    # 7-9: p95 crowded 39-62 ms against a bound of 0.37-0.41 s).
    expect("fair_dispatch", "short tenant's TTFT p95 with the flood (s)", p95_crowded,
           2.0 * p95_alone + 0.25, logs=logs, alone_s=alone, crowded_s=crowded)

    users: dict[str, set[str]] = {}
    for i, url in enumerate(setup["urls"]):
        log = setup["home"] / f"events-{i}.jsonl"
        users[url] = {json.loads(line)["user"] for line in log.read_text().splitlines() if line}
    on_flood_engine = users[setup["flood_engine"]]
    other_engine = next(u for u in setup["urls"] if u != setup["flood_engine"])
    assert on_flood_engine == {"flood", setup["short"]}
    assert users[other_engine] == {setup["other"]}


def test_a_conversations_turns_stay_on_the_engine_that_caches_it(setup: dict[str, Any]) -> None:
    """An unpaced tenant's multi-turn conversations through the gateway (the
    whole conversation sent every turn, engines with room): every turn of a conversation
    lands on one engine (read from which engine's prefix-cache query counter moved), and
    from the second turn on that engine serves the earlier turns' prompt from its cache
    (its hit counter moves by at least the last prompt less one block: 128 tokens on the
    CPU). The ledger row of each such turn holds the cached tokens the engine reported, and
    the tenant is charged for them at ``cost.cached_prompt`` (the default: the prompt's)."""
    gw: GatewayProcess = setup["gateway"]
    since = time.time()
    expected_cached: list[int] = []
    engines: list[Server] = setup["engines"]
    rng = random.Random(41)
    words = ("river", "stone", "cloud", "amber", "quiet", "signal", "orbit", "maple")
    where: dict[int, set[int]] = {}
    for conversation in range(6):
        prompt = " ".join(rng.choice(words) for _ in range(128))
        last_prompt_tokens = 0
        for turn in range(4):
            queries = [vllm_counter(e, "vllm:prefix_cache_queries_total") for e in engines]
            hits = [vllm_counter(e, "vllm:prefix_cache_hits_total") for e in engines]
            resp = httpx.post(f"{gw.url}/v1/completions", timeout=120,
                              headers={"authorization": "Bearer sk-chat"},
                              json={"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                    "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            moved = [i for i, e in enumerate(engines)
                     if vllm_counter(e, "vllm:prefix_cache_queries_total") > queries[i]]
            assert len(moved) == 1, moved
            engine = moved[0]
            where.setdefault(conversation, set()).add(engine)
            if turn:
                cached = vllm_counter(engines[engine], "vllm:prefix_cache_hits_total") \
                    - hits[engine]
                assert cached >= last_prompt_tokens - 128, (conversation, turn, cached,
                                                          last_prompt_tokens)
            body = resp.json()
            reported = body["usage"].get("prompt_tokens_details") or {}
            expected_cached.append(int(reported.get("cached_tokens") or 0))
            if turn:
                assert expected_cached[-1] >= last_prompt_tokens - 128, body["usage"]
            last_prompt_tokens = body["usage"]["prompt_tokens"]
            prompt += body["choices"][0]["text"] + " " + " ".join(
                rng.choice(words) for _ in range(10))
    assert all(len(engines_used) == 1 for engines_used in where.values()), where
    rows = sorted(_rows_of(gw, "chat", since, len(expected_cached)), key=lambda r: r.started_at)
    assert [r.cached_prompt_tokens for r in rows] == expected_cached
