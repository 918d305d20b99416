"""`tokenpace bench overhead`: what pacing costs when it never throttles.

Two servers on the same model: stock vLLM (tokenpace installed, no ``tokenpace`` section,
so the plugin does nothing) and ``tokenpace serve`` with a default rate far above what the
engine can produce. The same workload (N concurrent streams, one user each, M tokens each,
``ignore_eos``) runs on each in turn, alternating, R times; output tokens per second is
total tokens over the wall time from the first request to the last token. The ratio is
paced / stock per adjacent pair, reported as median with min and max.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ._cli import add_common_args, bench_model, positive_int, write_outputs
from ._environment import environment
from ._load import run_streams
from .._process import Server, free_port, start_all, tokenpace_serve_argv, vllm_server_argv

NEVER_THROTTLED = 1_000_000


def _throughput(server: Server, streams: int, tokens: int) -> float:
    plan = [(f"user-{i}", 1, tokens) for i in range(streams)]
    start = time.monotonic()
    records = asyncio.run(run_streams(server.base_url, plan))
    elapsed = max(r.last for r in records) - start
    total = sum(r.completion_tokens or 0 for r in records)
    if total != streams * tokens:
        raise RuntimeError(f"expected {streams * tokens} tokens, got {total}")
    return total / elapsed


QUIET_CORES = 0.1
"""Between runs, wait until both servers together use less CPU than this."""


def _settle(servers: list[Server], timeout_s: float = 10.0) -> None:
    """Wait until the servers are quiet (at most ``timeout_s``).

    After its last step vLLM's worker spins on its input queue for a second (a paced
    worker naps after 10 ms), and a run that starts during another server's spin shares
    the two cores with it. Without this wait, 12 alternating pairs gave paced / stock
    0.82 (median); with it 0.97, on the same machine and build.
    """
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        before = sum(s.cpu_seconds() for s in servers)
        time.sleep(0.25)
        if (sum(s.cpu_seconds() for s in servers) - before) / 0.25 < QUIET_CORES:
            return


def median_interval(values: list[float], resamples: int = 10_000,
                    seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median: how far the reported median could move if the
    runs were repeated, which says whether a difference of a few percent is resolved."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def run(model: Path, streams: int, tokens: int, repeats: int,
        workdir: Path | None = None) -> dict[str, Any]:
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-overhead-"))
    common = ["--max-num-seqs", str(max(streams, 16))]
    stock_port, paced_port = free_port(), free_port()
    stock = Server(vllm_server_argv(model, stock_port, *common), stock_port,
                   home / "vllm-stock.log")
    paced = Server(
        tokenpace_serve_argv(model, paced_port, "--default-user-output-tokens-per-second",
                             str(NEVER_THROTTLED), *common),
        paced_port, home / "vllm-paced.log",
    )
    start_all([stock, paced])
    stock_tps: list[float] = []
    paced_tps: list[float] = []
    try:
        for server in (stock, paced):
            _throughput(server, streams, min(tokens, 32))  # warm-up
        for i in range(repeats):
            order = [(stock, stock_tps), (paced, paced_tps)]
            if i % 2:
                order.reverse()  # neither always runs first
            for server, sink in order:
                _settle([stock, paced])
                sink.append(_throughput(server, streams, tokens))
            print(f"run {i + 1}/{repeats}: stock {stock_tps[-1]:8.1f} tok/s, "
                  f"paced {paced_tps[-1]:8.1f} tok/s, ratio {paced_tps[-1] / stock_tps[-1]:.3f}",
                  flush=True)
    finally:
        stock.stop()
        paced.stop()
    ratios = [p / s for p, s in zip(paced_tps, stock_tps)]
    low, high = median_interval(ratios)
    return {
        "benchmark": "overhead", "streams": streams, "tokens_per_stream": tokens,
        "repeats": repeats,
        "stock_tokens_per_s": [round(x, 1) for x in stock_tps],
        "paced_tokens_per_s": [round(x, 1) for x in paced_tps],
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_min": round(min(ratios), 4),
        "ratio_max": round(max(ratios), 4),
        "ratio_median_ci95": [round(low, 4), round(high, 4)],
        **environment(),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    from ._plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    runs = range(1, len(result["stock_tokens_per_s"]) + 1)
    ax.plot(runs, result["stock_tokens_per_s"], marker="o", label="stock vLLM")
    ax.plot(runs, result["paced_tokens_per_s"], marker="s", label="tokenpace serve")
    ax.set_xlabel("run (alternating)")
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(bottom=0)
    interval = result.get("ratio_median_ci95")
    ci = f", 95% CI {interval[0]:.2f}-{interval[1]:.2f}" if interval else ""
    ax.set_title(f"paced / stock: median x{result['ratio_median']:.3f}{ci} "
                 f"(min {result['ratio_min']:.3f}, max {result['ratio_max']:.3f})", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, path)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--streams", type=positive_int, default=32, help="concurrent streams")
    parser.add_argument("--tokens", type=positive_int, default=256, help="tokens per stream")
    parser.add_argument("--repeats", type=positive_int, default=6, help="alternating runs")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.streams, args.tokens, args.repeats = 8, 64, 1
    result = run(bench_model(args), args.streams, args.tokens, args.repeats)
    return write_outputs(args, result, plot)
