"""`tokenpace bench gateway`: what the gateway adds, measured against the engine direct.

One engine (``tokenpace serve --trusted-gateway``, nobody paced) and one gateway in front of
it. Latency: sequential streamed completions, alternating direct and through the gateway,
time to first token and to the last token at the client; the gateway's share is the
difference of the two distributions (the gateway also counts the prompt with the engine's
``/tokenize`` before dispatch, which is part of what it adds). Throughput: many concurrent
streams, direct and through the gateway in alternating rounds, output tokens per second;
plus the gateway process's CPU time per request.
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
from ._server import Server, free_port, start_all, tokenpace_serve_argv

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


async def _concurrent(url: str, streams: int, tokens: int) -> float:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=600, limits=limits,
                                 headers={"authorization": f"Bearer {KEY}"}) as client:
        t0 = time.monotonic()
        records = await asyncio.gather(*[stream_completion(client, url, None, tokens)
                                         for _ in range(streams)])
        elapsed = time.monotonic() - t0
    return sum(len(r.token_times) for r in records) / elapsed


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
    engine = Server(tokenpace_serve_argv(model, engine_port, "--trusted-gateway",
                                         "--allow-unauthenticated-trusted-gateway"), engine_port,
                    home / "engine.log")
    config = home / "gateway.yaml"
    config.write_text(_gateway_config(engine.base_url, home / "usage.db"))
    gateway = Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(config),
                      "--port", str(gateway_port), "--log-level", "warning"],
                     gateway_port, home / "gateway.log")
    start_all([engine, gateway])
    urls = {"direct": engine.base_url, "gateway": gateway.base_url}
    try:
        asyncio.run(_sequential(urls, 4, tokens))  # warm-up: connections, compiled paths
        cpu0 = gateway.cpu_seconds()
        seq = asyncio.run(_sequential(urls, requests, tokens))
        gateway_cpu_ms = (gateway.cpu_seconds() - cpu0) * 1000 / requests
        rates: dict[str, list[float]] = {"direct": [], "gateway": []}
        for i in range(rounds):
            for name in (("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")):
                rates[name].append(asyncio.run(_concurrent(urls[name], streams, stream_tokens)))
                print(f"round {i + 1} {name:7s}: {rates[name][-1]:.0f} tok/s", flush=True)
    finally:
        gateway.stop()
        engine.stop()
    latency = {name: _summary(records) for name, records in seq.items()}
    added = {
        key: round(latency["gateway"][key] - latency["direct"][key], 3)
        for key in latency["direct"]
    }
    ratios = [g / d for g, d in zip(rates["gateway"], rates["direct"])]
    result = {
        "benchmark": "gateway",
        "parameters": {"requests": requests, "tokens": tokens, "streams": streams,
                       "stream_tokens": stream_tokens, "rounds": rounds},
        "latency": latency,
        "added_ms": added,
        "gateway_cpu_ms_per_request": round(gateway_cpu_ms, 3),
        "throughput_tok_s": {k: [round(v, 1) for v in vals] for k, vals in rates.items()},
        "throughput_ratio_median": round(statistics.median(ratios), 4),
        "throughput_ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
        "ttft_ms": {name: [round(r.ttft * 1000, 3) for r in records] for name, records in seq.items()},
        **environment(),
    }
    print(f"added by the gateway: TTFT median {added['ttft_ms_median']:+.2f} ms, p99 "
          f"{added['ttft_ms_p99']:+.2f} ms; whole stream median {added['total_ms_median']:+.2f} ms; "
          f"throughput gateway/direct {result['throughput_ratio_median']:.3f}; gateway CPU "
          f"{gateway_cpu_ms:.2f} ms per request", flush=True)
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
