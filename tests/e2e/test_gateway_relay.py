"""The gateway's relay and dispatch gate in front of a real vLLM engine on the tiny model.

- Streamed events reach the client byte for byte as the engine wrote them, also when the
  text carries U+0085, U+2028 or U+2029 (which a text line splitter cuts).
- A burst the engine can run is dispatched at once: its time to first token stays close to
  calling the engine directly. A burst larger than the engine's ``max_num_seqs`` waits in
  the gateway instead of inside the engine.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._engine_pool import ModuleEngines
from tests._servers import Server, free_port, tokenpace_serve_argv
from tests.gateway.conftest import GatewayProcess
from tokenpace.bench._load import stream_completion

pytestmark = pytest.mark.vllm

KEY = "sk-relay"
KEY_HUGE = "sk-huge"
MAX_NUM_SEQS = 32


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    port = free_port()
    # The engine's key is the tenant's key, so the direct calls below authenticate with the
    # same header as the calls through the gateway (which sends it as engines[].api_key).
    return [Server(tokenpace_serve_argv(tiny_model, port, "--trusted-gateway",
                                        "--max-num-seqs", str(MAX_NUM_SEQS)),
                   port, home / "vllm.log", env={"VLLM_API_KEY": KEY})]


@pytest.fixture(scope="module")
def engine(module_engines: ModuleEngines) -> Server:
    [srv] = module_engines.servers
    return srv


@pytest.fixture(scope="module")
def gateway(engine: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    home = tmp_path_factory.mktemp("relay-gateway")
    config: dict[str, Any] = {
        "engines": [{"url": engine.base_url, "api_key": KEY, "max_inflight": 128,
                     "max_num_seqs": MAX_NUM_SEQS,
                     # One tenant's bursts against the saturation gate alone: no slots
                     # kept for other tenants (tests/unit/test_reserved_slots.py).
                     "max_engine_waiting": 4, "reserved_slots": 0}],
        "ledger": f"sqlite:///{home / 'usage.db'}",
        "tenants": [{"id": "relay", "api_keys": [KEY]},
                    # Its bodies paced only far above what the test sends (it is about
                    # the size refusal, not max_body_bytes_per_second).
                    {"id": "huge", "api_keys": [KEY_HUGE], "max_input_tokens": 2048,
                     "max_body_bytes_per_second": 1 << 30}],
    }
    gw = GatewayProcess(home, config).start()
    try:
        yield gw
    finally:
        gw.stop()


def separator_token_ids(model: Path) -> list[int]:
    """The tiny model's tokens for the UTF-8 bytes of U+0085, U+2028 and U+2029."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    ids: set[int] = set()
    for ch in "\u0085\u2028\u2029":
        ids.update(tok.encode(ch, add_special_tokens=False))
    return sorted(ids)


def payloads(url: str, path: str, body: dict[str, Any]) -> list[bytes]:
    resp = httpx.post(url + path, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=120)
    assert resp.status_code == 200, resp.text
    return [line[6:] for line in resp.content.split(b"\n") if line.startswith(b"data: ")]


def text_of(events: list[bytes]) -> str:
    """The generated text; every event must parse (a split event would not)."""
    out = []
    for raw in events[:-1]:
        choice = json.loads(raw)["choices"][0]
        out.append((choice["delta"].get("content") or "") if "delta" in choice else choice["text"])
    return "".join(out)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_events_with_unicode_line_separators_pass_through_intact(
        kind: str, engine: Server, gateway: GatewayProcess, tiny_model: Path) -> None:
    """Sampling among the separators' byte tokens only, seeded: the same tokens both ways.

    How many tokens one event carries depends on timing inside vLLM, so the events are not
    compared one by one (tests/gateway/test_relay_http.py does that against a fake engine
    that writes the same bytes every time); here every event arrives whole, the text is the
    same, and each event is vLLM's own serialisation (non-ASCII raw), not a re-encoding.
    """
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 160, "stream": True, "seed": 7,
                            "allowed_token_ids": separator_token_ids(tiny_model),
                            "ignore_eos": True}
    if kind == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": "Hello"}]
    else:
        path = "/v1/completions"
        body["prompt"] = "Hello"
    direct = payloads(engine.base_url, path, body)
    through = payloads(gateway.url, path, body)
    text = text_of(direct)
    seps = [sep for sep in "\u0085\u2028\u2029" if sep in text]
    assert seps, "no separator generated"
    assert through[-1] == b"[DONE]" and text_of(through) == text
    for raw in through[:-1]:
        assert json.dumps(json.loads(raw), ensure_ascii=False, separators=(",", ":")).encode() == raw


async def burst_ttfts(url: str, n: int, tokens: int) -> list[float]:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits,
                                 headers={"authorization": f"Bearer {KEY}"}) as client:
        records = await asyncio.gather(*[stream_completion(client, url, None, tokens)
                                         for _ in range(n)])
    return [r.ttft for r in records]


def test_a_burst_that_fits_the_engine_is_dispatched_at_once(engine: Server, gateway: GatewayProcess) -> None:
    """32 simultaneous streams on an engine that runs 32: none waits in the gateway.

    Measured at the source: each request's queue time in the ledger (admission to
    dispatch). A burst held by a stale saturation reading waited for a later poll (25 ms
    at the soonest, 0.5 s before); dispatched at once it waits for nothing but the event
    loop (bounds at the assertion). Time to first
    token against direct calls (the issue's 1.2x) is printed, and measured by
    ``tokenpace bench gateway``: on a shared 2-core machine it is too noisy to assert.
    """
    asyncio.run(burst_ttfts(gateway.url, 8, 4))  # warm-up: connections on both hops
    asyncio.run(burst_ttfts(engine.base_url, 8, 4))
    medians: dict[str, list[float]] = {"direct": [], "gateway": []}
    t0 = time.time()
    for i in range(2):
        order = ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")
        for name in order:
            url = engine.base_url if name == "direct" else gateway.url
            medians[name].append(statistics.median(asyncio.run(burst_ttfts(url, 32, 64))))
            time.sleep(0.6)  # let the engine's gauges settle between bursts
    queue_ms = [r.queue_ms or 0.0 for r in gateway.rows_since(t0, 2 * 32)]
    direct, through = statistics.median(medians["direct"]), statistics.median(medians["gateway"])
    print(f"32-stream burst TTFT median: direct {direct * 1000:.1f} ms, gateway {through * 1000:.1f} "
          f"ms; gateway queue median {statistics.median(queue_ms):.1f} ms, max {max(queue_ms):.1f} ms")
    assert len(queue_ms) == 64
    # The defect holds most of a burst until a later poll. Dispatched at once, a request
    # waits for nothing but the event loop (median 0.02-0.04 ms in `bench gateway`), but a
    # reading taken mid-burst can still hold a few for one re-poll: up to 91 ms once in 24
    # quiet rounds of `bench gateway`, and a fresh-clone CI run failed a bound of 100 ms on
    # the longest wait. So: at most 6 of the 64 (about 10%) wait over 10 ms, none 1 s.
    held = [q for q in queue_ms if q > 10.0]
    assert len(held) <= 6 and max(queue_ms) < 1000.0, sorted(queue_ms)


def test_a_burst_larger_than_the_engine_waits_in_the_gateway(engine: Server, gateway: GatewayProcess) -> None:
    """96 streams on an engine that runs 32: at most 32 + max_engine_waiting (4) are in the
    engine at once; the rest wait in the gateway (queue time recorded in the ledger)."""
    t0 = time.time()
    highest = 0.0

    async def watch(stop: asyncio.Event) -> None:
        nonlocal highest
        async with httpx.AsyncClient(timeout=10,
                                     headers={"authorization": f"Bearer {KEY}"}) as client:
            while not stop.is_set():
                resp = await client.get(f"{engine.base_url}/metrics")
                assert resp.status_code == 200, resp.text  # (the engine's key: 401 without)
                text = resp.text
                running = waiting = 0.0
                for line in text.splitlines():
                    if line.startswith("vllm:num_requests_running{"):
                        running += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("vllm:num_requests_waiting{"):
                        waiting += float(line.rsplit(" ", 1)[1])
                highest = max(highest, running + waiting)
                await asyncio.sleep(0.05)

    async def main() -> None:
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        await burst_ttfts(gateway.url, 96, 64)
        stop.set()
        await watcher

    asyncio.run(main())
    rows = gateway.rows_since(t0, 96)
    assert len(rows) == 96
    # The engine's gauges, as sampled (under load the watcher, in the client's loop, may
    # get no sample in before the burst ends: the ledger check below carries the property).
    assert highest <= MAX_NUM_SEQS + 4
    # Measured at the source, the gateway's own ledger. No slot frees before the first
    # token of the burst (every request must first be prefilled, then decode 63 more
    # tokens before it ends), so: of the requests that arrived before that first token, at
    # most 36 may be dispatched before it; the others waited in the gateway. Counting the
    # requests that waited over 50 ms instead failed once in a fresh-clone CI run beside
    # other engines (under load the 96 streams arrive spread out), and so did taking the
    # first request's end as the reference (the engine ends requests a while before the
    # gateway has relayed their last byte, and the gate reads the engine's gauges).
    # Margin 24: a gauge reading taken while dispatches are still on their way to the
    # engine lets a few more through (quiet: 36 exactly; beside 2-3 busy loops on 2 cores:
    # 36-38), and on a loaded host the ledger's instants lag the engine's (57 once in a
    # clean-clone CI run here while the engine's own gauges never showed more than 36).
    # Without the gate all 96 go before the first token: still far past the bound.
    dispatched = {r.request_id: r.started_at + (r.queue_ms or 0.0) / 1000 for r in rows}
    first_token = min(r.started_at + r.ttft_ms / 1000 for r in rows if r.ttft_ms is not None)
    early = [r for r in rows if r.started_at < first_token]
    waited = [r for r in early if dispatched[r.request_id] >= first_token]
    print(f"engine held at most {highest:.0f} requests; {len(early)} of 96 arrived before the "
          f"first token, {len(waited)} of them were dispatched after it")
    assert len(early) - len(waited) <= MAX_NUM_SEQS + 4 + 24
    assert len(early) >= MAX_NUM_SEQS + 4 + 10  # the burst did overrun the engine


def test_huge_prompts_a_tenant_may_not_send_do_not_stall_others(engine: Server, gateway: GatewayProcess) -> None:
    """One tenant sends 4 MB prompts over its max_input_tokens, four at a time, while
    another tenant's small requests keep their latency: the gateway refuses the big ones
    from their size, without asking the engine's tokenizer (which took seconds per prompt
    and delayed everyone's requests behind them)."""
    import threading

    def small_latencies(count: int) -> list[float]:
        out = []
        with httpx.Client(timeout=60, headers={"authorization": f"Bearer {KEY}"}) as client:
            for _ in range(count):
                t = time.monotonic()
                resp = client.post(gateway.url + "/v1/completions",
                                   json={"model": "tiny", "prompt": "Hi", "max_tokens": 5})
                assert resp.status_code == 200
                out.append(time.monotonic() - t)
        return out

    small_latencies(3)  # warm-up
    alone = statistics.median(small_latencies(15))
    stop = threading.Event()
    refused: list[int] = []

    def flood() -> None:
        body = json.dumps({"model": "tiny", "prompt": "lorem ipsum " * 350_000, "max_tokens": 5})
        with httpx.Client(timeout=120, headers={"authorization": f"Bearer {KEY_HUGE}"}) as client:
            while not stop.is_set():
                refused.append(client.post(gateway.url + "/v1/completions", content=body).status_code)

    threads = [threading.Thread(target=flood) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        during = statistics.median(small_latencies(15))
    finally:
        stop.set()
        for t in threads:
            t.join()
    print(f"small request median latency alone {alone * 1000:.1f} ms, beside the 4 MB prompts "
          f"{during * 1000:.1f} ms; {len(refused)} big prompts refused")
    assert refused and set(refused) == {400}
    # Margin: reading and parsing a 4 MB body takes the gateway's event loop tens of ms
    # per big request; a stall behind the engine's tokenizer took seconds.
    assert during <= 3 * alone + 0.25


def test_the_engines_openapi_document_names_its_request_fields(engine: Server) -> None:
    """What the gateway reads from a real vLLM to trim a large body's ignored fields: the
    chat and completion routes resolve to their request models' fields, with what every
    client sends among them (a field missing here would be dropped from large bodies)."""
    from tokenpace.gateway.fleet import request_fields

    # The gateway asks with the engine's key (engines[].api_key), as here.
    resp = httpx.get(f"{engine.base_url}/openapi.json", timeout=60,
                     headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200
    fields = request_fields(resp.json())
    written = {"model", "max_tokens", "vllm_xargs", "priority", "stream", "stream_options",
               "cache_salt"}
    assert written | {"messages"} <= fields["/v1/chat/completions"]
    assert written | {"prompt"} <= fields["/v1/completions"]
    assert "pad" not in fields["/v1/chat/completions"]
