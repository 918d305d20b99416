"""`tokenpace bench gateway`: what the gateway adds, measured against the engine direct.

One engine (``tokenpace serve --trusted-gateway``, nobody paced) and one gateway in front of
it, all figures from one run. Both paths send the engine the same work: the same body
(prompt, ``temperature`` 0, the tenant's identity as the gateway writes it, usage in every
chunk, which is what the gateway asks the engine for anyway), a salt of the same length
(the gateway's per-tenant ``cache_salt``, a fixed one direct) and a prompt of their own per
pair, so neither call finds the other's prefix in the engine's cache. Greedy decoding
makes the two answers of a pair identical; the run counts the pairs where they are.
Time to first token is the same on both paths: from just before the request is sent to
the first chunk that carries a generated token id.

- latency: sequential streamed completions in pairs (direct and gateway, the order
  alternating from pair to pair); what the gateway adds is the per-pair difference, its
  median and 99th percentile with bootstrap intervals over pairs (``_paired``): the
  engine's own latency moves in phases on a busy machine, which independent medians of
  the two paths would measure instead of the gateway;
- burst and throughput: ``streams`` streams sent at once, direct and through the gateway
  in alternating pairs of rounds with the same prompts; per pair the ratio gateway/direct
  of the median time to first token and of the output tokens per second; reported as
  the median ratio over pairs with its bootstrap interval; and the gateway's own view of
  its rounds from its ledger (how long it held each request before dispatch, and its TTFT
  from arrival), which tells a burst held in the gateway from a slow engine;
- gateway CPU per request (sequential non-streamed 1-token requests through the gateway
  alone; this includes the background health and gauge polls that run meanwhile, so it is
  also given against the fast upstream below, where they are negligible) and per streamed
  chunk (the gateway's CPU during its own burst rounds over the chunks it relayed:
  gross, and net of the requests' share): process CPU time of the gateway only, in phases
  where only the gateway is called;
- requests per second at 100% of one core: a second gateway in front of an upstream that
  answers from canned bytes (``_fast_upstream``, its own process), so the gateway is the
  limit; requests per gateway CPU-second;
- with ``control="byte-proxy"``, a third path in every pair and burst pair: the engine
  behind a byte relay in its own process (``_control``), which tells what any second
  process on the path costs this machine from what the gateway's own work costs.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from . import _control
from ._environment import environment
from ._load import StreamRecord, percentile, stream_aiohttp
from ._paired import difference_summary, pair_order, ratio_summary, run_pairs
from .._process import Server, free_port, start_all, tokenpace_serve_argv
from .overhead import median_interval

KEY = "sk-bench"
TENANT = "bench"
DIRECT_SALT = hashlib.sha256(b"tokenpace-bench-direct").hexdigest()
"""The direct path's ``cache_salt``: as long as the gateway's per-tenant salt (64 hex
digits), and different from it, so the engine hashes the same amount and neither path
reuses the other's cached prefix."""
CPU_ROUNDS = 3
_WORDS = ("river", "stone", "lamp", "orbit", "maple", "quartz", "harbor", "cedar", "ember",
          "violet", "tundra", "signal", "meadow", "copper", "lantern", "glacier")


def _gateway_config(engine_url: str, ledger: Path) -> str:
    return (
        f'engines: [{{url: "{engine_url}", max_inflight: 256}}]\n'
        f'ledger: "sqlite:///{ledger}"\n'
        f'tenants: [{{id: {TENANT}, api_keys: ["{KEY}"]}}]\n'
    )


def prompt_for(nonce: str, index: int, words: int = 24) -> str:
    """A prompt of its own for each pair (or stream): its first words differ from every
    other's, so no prompt finds another's prefix in the engine's cache."""
    rng = random.Random(f"{nonce}/{index}")
    return f"{nonce} {index}: " + " ".join(rng.choice(_WORDS) for _ in range(words))


def work(path: str) -> dict[str, object]:
    """The fields that make a plain streamed completion the gateway's work, for ``path``.

    The gateway overwrites identity and priority with the same values and adds its
    tenant's salt; the direct call carries them itself, so the engine gets the same work.
    """
    fields: dict[str, object] = {
        "temperature": 0, "priority": 0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if path == "direct":
        fields["cache_salt"] = DIRECT_SALT
    elif path == _control.PATH:
        fields["cache_salt"] = _control.SALT
    return fields


def body(path: str, prompt: str, tokens: int) -> dict[str, object]:
    """One streamed completion of ``tokens`` tokens for ``path``: the same on both paths
    but the salt (``work``)."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "return_token_ids": True,
            "vllm_xargs": {"output_rate_user": TENANT}, **work(path)}


def _session(connections: int) -> aiohttp.ClientSession:
    """The load generator's client: keep-alive connections for both paths (the gateway
    keeps its own to the engine), created once and warmed up before anything is timed."""
    return aiohttp.ClientSession(
        # Idle connections are dropped after 4 s, before vLLM's server closes them (5 s):
        # a connection reused just as the engine closes it fails its request (a byte
        # proxy's arm met this once in a burst round on a loaded machine).
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=connections,
                                       keepalive_timeout=4),
        timeout=aiohttp.ClientTimeout(total=600), headers={"authorization": f"Bearer {KEY}"})


async def _sequential(urls: dict[str, str], pairs: int, tokens: int,
                      nonce: str) -> dict[str, list[StreamRecord]]:
    """Pairs of sequential streamed completions, one prompt per pair, after 4 warm-up pairs."""
    async with _session(4) as session:
        def call(path: str, tag: str) -> Callable[[int], Awaitable[StreamRecord]]:
            async def one(i: int) -> StreamRecord:
                return await stream_aiohttp(session, urls[path],
                                            body(path, prompt_for(tag, i), tokens))
            return one

        await run_pairs({path: call(path, f"{nonce}w") for path in urls}, 4)
        return await run_pairs({path: call(path, nonce) for path in urls}, pairs)


async def _burst(session: aiohttp.ClientSession, url: str, path: str, streams: int, tokens: int,
                 nonce: str) -> tuple[float, list[StreamRecord]]:
    """Output tokens per second of ``streams`` streams sent at once, and their records."""
    t0 = time.monotonic()
    records = await asyncio.gather(*[
        stream_aiohttp(session, url, body(path, prompt_for(nonce, j), tokens))
        for j in range(streams)])
    elapsed = time.monotonic() - t0
    return sum(len(r.token_times) for r in records) / elapsed, list(records)


@dataclass
class _Bursts:
    rates: dict[str, list[float]] = field(default_factory=dict)  # per path, per round
    ttft: dict[str, list[float]] = field(default_factory=dict)
    cpu_gross: list[tuple[float, int]] = field(default_factory=list)
    """Gateway CPU seconds and chunks relayed, per gateway round."""
    windows: list[tuple[float, float]] = field(default_factory=list)
    """Wall-clock span of each gateway round (to find its requests in the ledger)."""
    client_cpu: list[float] = field(default_factory=list)
    """The load generator's own CPU seconds per round (both paths, in round order)."""
    control_cpu: list[float] = field(default_factory=list)
    """The control's (byte proxy's) CPU seconds per control round."""


async def _bursts(urls: dict[str, str], gateway: Server, rounds: int, streams: int, tokens: int,
                  nonce: str, control: Server | None = None) -> _Bursts:
    """``rounds`` pairs of burst rounds, the order alternating, the same prompts in both
    rounds of a pair; one warm-up round per path first opens the connections."""
    out = _Bursts(rates={p: [] for p in urls}, ttft={p: [] for p in urls})
    async with _session(streams) as session:
        for path in urls:
            await _burst(session, urls[path], path, streams, 8, f"{nonce}w")
        for i in range(rounds):
            for path in pair_order(list(urls), i):
                cpu0, wall0, own0 = gateway.cpu_seconds(), time.time(), time.process_time()
                control0 = control.cpu_seconds() if control is not None else 0.0
                rate, records = await _burst(session, urls[path], path, streams, tokens,
                                             f"{nonce}b{i}")
                out.client_cpu.append(time.process_time() - own0)
                out.rates[path].append(rate)
                out.ttft[path].append(statistics.median(r.ttft for r in records))
                if control is not None and path == _control.PATH:
                    out.control_cpu.append(control.cpu_seconds() - control0)
                if path == "gateway":
                    out.windows.append((wall0, time.time()))
                    out.cpu_gross.append((gateway.cpu_seconds() - cpu0,
                                          sum(len(r.token_times) for r in records)))
                print(f"burst pair {i + 1} {path:10s}: {rate:.0f} tok/s, TTFT median "
                      f"{out.ttft[path][-1] * 1000:.0f} ms", flush=True)
    return out


async def _plain(url: str, requests: int, concurrency: int, tokens: int = 1) -> float:
    """``requests`` non-streamed completions, ``concurrency`` at a time; seconds taken."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": tokens, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120, limits=limits,
                                 headers={"authorization": f"Bearer {KEY}"}) as client:
        left = iter(range(requests))

        async def worker() -> None:
            for _ in left:
                resp = await client.post(f"{url}/v1/completions", json=body)
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")

        t0 = time.monotonic()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return time.monotonic() - t0


def _interval(values: list[float], digits: int = 3) -> dict[str, Any]:
    low, high = median_interval(values) if len(values) > 1 else (values[0], values[0])
    return {"median": round(statistics.median(values), digits),
            "interval95": [round(low, digits), round(high, digits)],
            "values": [round(v, digits) for v in values]}


def _summary(records: list[StreamRecord]) -> dict[str, float]:
    ttft = [r.ttft * 1000 for r in records]
    total = [(r.last - r.start) * 1000 for r in records]
    return {
        "ttft_ms_median": round(statistics.median(ttft), 3),
        "ttft_ms_p99": round(percentile(ttft, 99), 3),
        "total_ms_median": round(statistics.median(total), 3),
        "total_ms_p99": round(percentile(total, 99), 3),
    }


def _ledger_rounds(ledger: Path, windows: list[tuple[float, float]]) -> dict[str, Any]:
    """The gateway's own view of its burst rounds, from its ledger (read after it stopped).

    ``queue_ms`` is how long the gateway held a request before dispatching it (the gate,
    the fair queue); ``ttft_ms`` runs from the request's arrival at the gateway to its
    first token there. A burst that waits in the gateway shows in the first; what the
    engine takes, in the second, which the client's TTFT exceeds by the hop to the client.
    """
    with closing(sqlite3.connect(ledger)) as db:
        rows = db.execute("SELECT started_at, queue_ms, ttft_ms FROM requests").fetchall()
    queue_max, queue_p50, ttft_p50 = [], [], []
    for start, end in windows:
        burst = [r for r in rows if start <= r[0] <= end]
        queue = [r[1] or 0.0 for r in burst]
        ttft = [r[2] for r in burst if r[2] is not None]
        queue_max.append(round(max(queue, default=0.0), 2))
        queue_p50.append(round(statistics.median(queue) if queue else 0.0, 3))
        ttft_p50.append(round(statistics.median(ttft), 1) if ttft else None)
    return {"queue_ms_max": queue_max, "queue_ms_median": queue_p50, "ttft_ms_median": ttft_p50}


def run(model: Path, requests: int = 200, tokens: int = 16, streams: int = 32,
        stream_tokens: int = 128, rounds: int = 24, workdir: Path | None = None,
        control: str | None = None) -> dict[str, Any]:
    """``control``: None, or one of ``_control.CONTROLS`` for a control arm in every pair."""
    if control is not None and control not in _control.CONTROLS:
        raise ValueError(f"unknown control {control!r}; known: {', '.join(_control.CONTROLS)}")
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-gateway-"))
    nonce = f"{random.getrandbits(32):08x}"
    engine_port, gateway_port = free_port(), free_port()
    fast_port, fast_gateway_port = free_port(), free_port()
    engine = Server(tokenpace_serve_argv(model, engine_port, "--trusted-gateway",
                                         "--allow-unauthenticated-trusted-gateway"), engine_port,
                    home / "engine.log")
    fast = Server([sys.executable, "-m", "tokenpace.bench._fast_upstream", str(fast_port)],
                  fast_port, home / "fast-upstream.log")
    servers = [engine, fast]
    for port, upstream, name in ((gateway_port, engine.base_url, "gateway"),
                                 (fast_gateway_port, fast.base_url, "fast-gateway")):
        config = home / f"{name}.yaml"
        config.write_text(_gateway_config(upstream, home / f"{name}.db"))
        servers.append(Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config",
                               str(config), "--port", str(port), "--log-level", "warning"],
                              port, home / f"{name}.log"))
    gateway, fast_gateway = servers[2], servers[3]
    relay = _control.server(engine, home) if control is not None else None
    start_all(servers + ([relay] if relay is not None else []))
    urls = {"direct": engine.base_url, "gateway": gateway.base_url}
    if relay is not None:
        servers.append(relay)
        urls[_control.PATH] = relay.base_url
    cpu_per_request: list[float] = []
    per_core: list[float] = []
    try:
        seq = asyncio.run(_sequential(urls, requests, tokens, nonce))
        bursts = asyncio.run(_bursts(urls, gateway, rounds, streams, stream_tokens, nonce, relay))
        for i in range(CPU_ROUNDS):
            cpu0 = gateway.cpu_seconds()
            asyncio.run(_plain(gateway.base_url, requests, 1))
            cpu_per_request.append((gateway.cpu_seconds() - cpu0) / requests)
            asyncio.run(_plain(fast_gateway.base_url, 50, 16))  # warm-up
            cpu0, t0 = fast_gateway.cpu_seconds(), time.monotonic()
            n = 20 * requests
            asyncio.run(_plain(fast_gateway.base_url, n, 16))
            cpu = fast_gateway.cpu_seconds() - cpu0
            per_core.append(n / cpu)
            print(f"round {i + 1} fast upstream: {n / (time.monotonic() - t0):.0f} req/s at "
                  f"{cpu / (time.monotonic() - t0) * 100:.0f}% of a core: {n / cpu:.0f} "
                  "requests per gateway CPU-second", flush=True)
    finally:
        for srv in reversed(servers):
            srv.stop()
    in_gateway = _ledger_rounds(home / "gateway.db", bursts.windows)
    rates, burst, cpu_gross = bursts.rates, bursts.ttft, bursts.cpu_gross
    request_cpu = statistics.median(cpu_per_request)
    cpu_per_chunk = [max(0.0, gross - streams * request_cpu) / chunks for gross, chunks in cpu_gross]
    cpu_per_chunk_gross = [gross / chunks for gross, chunks in cpu_gross]
    latency = {name: _summary(records) for name, records in seq.items()}
    ttft = {name: [r.ttft * 1000 for r in records] for name, records in seq.items()}
    total = {name: [(r.last - r.start) * 1000 for r in records] for name, records in seq.items()}
    same = sum(d.token_ids == g.token_ids for d, g in zip(seq["direct"], seq["gateway"]))
    result = {
        "benchmark": "gateway",
        "parameters": {"requests": requests, "tokens": tokens, "streams": streams,
                       "stream_tokens": stream_tokens, "rounds": rounds},
        "latency": latency,
        "added_ttft_ms": difference_summary(ttft["gateway"], ttft["direct"]),
        "added_total_ms": difference_summary(total["gateway"], total["direct"]),
        "same_output_pairs": same,
        "gateway_cpu_ms_per_request": _interval([v * 1000 for v in cpu_per_request]),
        "gateway_cpu_us_per_chunk": _interval([v * 1e6 for v in cpu_per_chunk], 1),
        "gateway_cpu_us_per_chunk_gross": _interval([v * 1e6 for v in cpu_per_chunk_gross], 1),
        "gateway_cpu_ms_per_request_fast_upstream": _interval([1000 / v for v in per_core]),
        "throughput_tok_s": {k: [round(v, 1) for v in vals] for k, vals in rates.items()},
        "throughput_ratio": ratio_summary(rates["gateway"], rates["direct"], 4),
        "burst_ttft_ms_median": {k: [round(v * 1000, 1) for v in vals] for k, vals in burst.items()},
        "burst_ttft_ratio": ratio_summary(burst["gateway"], burst["direct"]),
        "burst_in_gateway": in_gateway,
        "load_generator_cpu_s_per_round": _interval(bursts.client_cpu),
        "requests_per_gateway_cpu_second": _interval(per_core, 0),
        "ttft_ms": {name: [round(v, 3) for v in values] for name, values in ttft.items()},
        **environment(),
    }
    if relay is not None:
        result["parameters"]["control"] = control
        result["control"] = _control.summary(ttft, total, seq, rates, burst, bursts.control_cpu)
    added = result["added_ttft_ms"]
    print(f"added by the gateway (paired, {requests} pairs, {same} with identical output): "
          f"TTFT p50 {added['p50']['value']:+.2f} ms {added['p50']['interval95']}, p99 "
          f"{added['p99']['value']:+.2f} ms {added['p99']['interval95']} (p1 {added['p1']:+.2f}),"
          f" p99 shift {added['p99_shift']['value']:+.2f} ms {added['p99_shift']['interval95']};"
          f" throughput gateway/direct {result['throughput_ratio']['median']:.3f} "
          f"{result['throughput_ratio']['interval95']}; burst TTFT gateway/direct "
          f"{result['burst_ttft_ratio']['median']:.2f} {result['burst_ttft_ratio']['interval95']}"
          f" ({rounds} pairs; held in the gateway at most "
          f"{max(in_gateway['queue_ms_max'], default=0.0):.1f} ms); gateway CPU "
          f"{result['gateway_cpu_ms_per_request']['median']:.3f} ms per request, "
          f"{result['gateway_cpu_us_per_chunk']['median']:.1f} us per chunk net, "
          f"{result['gateway_cpu_us_per_chunk_gross']['median']:.1f} us gross; "
          f"{result['requests_per_gateway_cpu_second']['median']:.0f} requests per gateway "
          "CPU-second against a fast upstream", flush=True)
    if relay is not None:
        print(_control.line(result["control"]), flush=True)
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    from ._plots import pyplot, save

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in result["ttft_ms"].items():
        left.plot(range(len(values)), values, ".", markersize=3, label=name)
    left.set_xlabel("pair (direct and gateway, one after the other)")
    left.set_ylabel("time to first token at the client (ms)")
    left.set_yscale("log")
    added = result["added_ttft_ms"]
    left.set_title(f"Sequential streamed requests: added p50 {added['p50']['value']:+.2f} ms")
    left.legend()
    arms = [("gateway", result, "o-")]
    if "control" in result:  # the byte proxy's ratios against direct, dashed
        arms.append(("byte proxy", result["control"], "s--"))
    for arm, figures, style in arms:
        for key, label in (("throughput_ratio", "output tok/s"), ("burst_ttft_ratio", "median TTFT")):
            values = figures[key]["values"]
            right.plot(range(1, len(values) + 1), values, style, label=f"{arm}: {label}, median "
                       f"{figures[key]['median']:.2f} {figures[key]['interval95']}")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xlabel("burst pair")
    right.set_ylabel("path / direct, same pair")
    right.set_title(f"{result['parameters']['streams']} streams sent at once")
    right.legend()
    save(fig, path)
