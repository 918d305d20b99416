"""`tokenpace bench gateway`: what the gateway adds, measured against the engine direct.

One engine (``tokenpace serve --trusted-gateway``, nobody paced) and one gateway in front of
it, all figures from one run:

- latency: sequential streamed completions, alternating direct and through the gateway;
  time to first token and to the last token at the client, the gateway's share being the
  difference of the two distributions;
- gateway CPU per request (sequential non-streamed 1-token requests through the gateway
  alone; this includes the background health and gauge polls that run meanwhile, so it is
  also given against the fast upstream below, where they are negligible) and per streamed
  chunk (the gateway's CPU during its own throughput rounds over the chunks it relayed:
  gross, and net of the requests' share): process CPU time of the gateway only, in phases
  where only the gateway is called;
- throughput: many concurrent streams, direct and through the gateway in alternating
  rounds, output tokens per second;
- burst: the same number of streams sent at once, time to first token per round;
- requests per second at 100% of one core: a second gateway in front of an upstream that
  answers from canned bytes (``_fast_upstream``, its own process), so the gateway is the
  limit; requests per gateway CPU-second.

Each figure comes with a 95% bootstrap interval of its median over the rounds.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from ._environment import environment
from ._load import StreamRecord, percentile, stream_completion
from .._process import Server, free_port, start_all, tokenpace_serve_argv
from .overhead import median_interval

KEY = "sk-bench"


def _gateway_config(engine_url: str, ledger: Path) -> str:
    return (
        f'engines: [{{url: "{engine_url}", max_inflight: 256}}]\n'
        f'ledger: "sqlite:///{ledger}"\n'
        f'tenants: [{{id: bench, api_keys: ["{KEY}"]}}]\n'
    )


async def _sequential(urls: dict[str, str], requests: int, tokens: int) -> dict[str, list[StreamRecord]]:
    out: dict[str, list[StreamRecord]] = {name: [] for name in urls}
    async with httpx.AsyncClient(timeout=120, headers={"authorization": f"Bearer {KEY}"}) as client:
        names = list(urls)
        for i in range(requests):
            order = names if i % 2 == 0 else names[::-1]
            for name in order:
                out[name].append(await stream_completion(client, urls[name], None, tokens))
    return out


async def _concurrent(url: str, streams: int, tokens: int) -> tuple[float, list[StreamRecord]]:
    """Output tokens per second of ``streams`` streams sent at once, and their records."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=600, limits=limits,
                                 headers={"authorization": f"Bearer {KEY}"}) as client:
        t0 = time.monotonic()
        records = await asyncio.gather(*[stream_completion(client, url, None, tokens)
                                         for _ in range(streams)])
        elapsed = time.monotonic() - t0
    return sum(len(r.token_times) for r in records) / elapsed, list(records)


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


def run(model: Path, requests: int = 200, tokens: int = 16, streams: int = 32,
        stream_tokens: int = 128, rounds: int = 3, workdir: Path | None = None) -> dict[str, Any]:
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-gateway-"))
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
    start_all(servers)
    urls = {"direct": engine.base_url, "gateway": gateway.base_url}
    cpu_per_request: list[float] = []
    cpu_per_chunk: list[float] = []
    cpu_per_chunk_gross: list[float] = []
    rates: dict[str, list[float]] = {"direct": [], "gateway": []}
    burst: dict[str, list[float]] = {"direct": [], "gateway": []}
    per_core: list[float] = []
    try:
        asyncio.run(_sequential(urls, 4, tokens))  # warm-up: connections, compiled paths
        seq = asyncio.run(_sequential(urls, requests, tokens))
        for i in range(rounds):
            cpu0 = gateway.cpu_seconds()
            asyncio.run(_plain(gateway.base_url, requests, 1))
            cpu_per_request.append((gateway.cpu_seconds() - cpu0) / requests)
            for name in (("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")):
                cpu0 = gateway.cpu_seconds()
                rate, records = asyncio.run(_concurrent(urls[name], streams, stream_tokens))
                rates[name].append(rate)
                burst[name].append(statistics.median(r.ttft for r in records))
                if name == "gateway":
                    chunks = sum(len(r.token_times) for r in records)
                    gross = gateway.cpu_seconds() - cpu0
                    cpu_per_chunk_gross.append(gross / chunks)
                    cpu_per_chunk.append(max(0.0, gross - streams * cpu_per_request[-1]) / chunks)
                print(f"round {i + 1} {name:7s}: {rate:.0f} tok/s, burst TTFT median "
                      f"{burst[name][-1] * 1000:.0f} ms", flush=True)
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
    latency = {name: _summary(records) for name, records in seq.items()}
    added = {
        key: round(latency["gateway"][key] - latency["direct"][key], 3)
        for key in latency["direct"]
    }
    ratios = [g / d for g, d in zip(rates["gateway"], rates["direct"])]
    burst_ratios = [g / d for g, d in zip(burst["gateway"], burst["direct"])]
    result = {
        "benchmark": "gateway",
        "parameters": {"requests": requests, "tokens": tokens, "streams": streams,
                       "stream_tokens": stream_tokens, "rounds": rounds},
        "latency": latency,
        "added_ms": added,
        "gateway_cpu_ms_per_request": _interval([v * 1000 for v in cpu_per_request]),
        "gateway_cpu_us_per_chunk": _interval([v * 1e6 for v in cpu_per_chunk], 1),
        "gateway_cpu_us_per_chunk_gross": _interval([v * 1e6 for v in cpu_per_chunk_gross], 1),
        "gateway_cpu_ms_per_request_fast_upstream": _interval([1000 / v for v in per_core]),
        "throughput_tok_s": {k: [round(v, 1) for v in vals] for k, vals in rates.items()},
        "throughput_ratio": _interval(ratios, 4),
        "burst_ttft_ms_median": {k: [round(v * 1000, 1) for v in vals] for k, vals in burst.items()},
        "burst_ttft_ratio": _interval(burst_ratios, 3),
        "requests_per_gateway_cpu_second": _interval(per_core, 0),
        "ttft_ms": {name: [round(r.ttft * 1000, 3) for r in records] for name, records in seq.items()},
        **environment(),
    }
    print(f"added by the gateway: TTFT median {added['ttft_ms_median']:+.2f} ms, p99 "
          f"{added['ttft_ms_p99']:+.2f} ms; throughput gateway/direct "
          f"{result['throughput_ratio']['median']:.3f} {result['throughput_ratio']['interval95']}; "
          f"burst TTFT gateway/direct {result['burst_ttft_ratio']['median']:.2f} "
          f"{result['burst_ttft_ratio']['interval95']}; gateway CPU "
          f"{result['gateway_cpu_ms_per_request']['median']:.3f} ms per request, "
          f"{result['gateway_cpu_us_per_chunk']['median']:.1f} us per chunk net, "
          f"{result['gateway_cpu_us_per_chunk_gross']['median']:.1f} us gross; "
          f"{result['requests_per_gateway_cpu_second']['median']:.0f} requests per gateway "
          "CPU-second against a fast upstream", flush=True)
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    from ._plots import pyplot, save

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in result["ttft_ms"].items():
        ordered = sorted(values)
        left.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=name)
    left.set_xlabel("time to first token at the client (ms)")
    left.set_ylabel("fraction of requests")
    left.set_title("Sequential streamed requests")
    left.legend()
    names = list(result["throughput_tok_s"])
    for i, name in enumerate(names):
        values = result["throughput_tok_s"][name]
        right.scatter([i] * len(values), values, label=name)
    right.set_xticks(range(len(names)), names)
    right.set_ylabel("output tokens per second")
    right.set_title(f"{result['parameters']['streams']} concurrent streams")
    save(fig, path)
