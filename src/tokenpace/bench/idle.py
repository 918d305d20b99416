"""`tokenpace bench idle`: server CPU while every request is throttled.

Three paced servers run the same load: with the idle wait (and the worker's step hint) in
synchronous and in asynchronous scheduling, and, as the baseline, with ``idle_wait:
false``, which leaves vLLM's engine loop re-running ``schedule()`` every millisecond and
its worker spinning. The load is 8 streams of one user limited to 2 tok/s: all its
requests are throttled almost all the time. CPU is the user + system time of the whole
server process tree (API server, engine core, worker) over a window, in cores. Two more
numbers per server: the same tree with no requests at all (the floor), and the time to
first token of a fresh user (one-token requests, median of 5) before and during the
throttled load, which must not suffer from the naps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ._cli import add_common_args, bench_model, positive_float, write_outputs
from ._environment import environment
from ._load import async_client, run_streams, stream_completion
from .._process import Server, free_port, start_all, tokenpace_serve_argv

USER_RATE = 2.0
STREAMS = 8
PROBES = 5
CASES = (  # name, idle_wait, scheduling
    ("idle_wait", True, "--no-async-scheduling"),
    ("idle_wait_async", True, "--async-scheduling"),
    ("busy_loop", False, "--no-async-scheduling"),
)


async def _fresh_ttft_ms(base_url: str, tag: str) -> float:
    """Median time to first token of one-token requests, each from a new user."""
    async with async_client(timeout=120) as client:
        ttfts = [(await stream_completion(client, base_url, f"{tag}-{i}", 1)).ttft * 1000
                 for i in range(PROBES)]
    return statistics.median(ttfts)


async def measure(server: Server, window_s: float) -> dict[str, float]:
    """One server's case: its process tree's CPU (cores) over ``window_s`` with no requests
    and with ``STREAMS`` streams of one user throttled, and a fresh user's median time to
    first token before and during that load. About 2 x ``window_s`` + 5 s, plus the probes."""
    await asyncio.sleep(2.0)  # vLLM's worker spins for a second after the warm-up request
    idle0, t0 = server.cpu_seconds(), time.monotonic()
    await asyncio.sleep(window_s)
    no_requests = (server.cpu_seconds() - idle0) / (time.monotonic() - t0)
    ttft_before = await _fresh_ttft_ms(server.base_url, "before")
    load = asyncio.create_task(run_streams(server.base_url, [("throttled", STREAMS, 1000)]))
    await asyncio.sleep(3.0)  # admitted, burst spent
    if load.done():
        load.result()  # raises what went wrong
        raise RuntimeError("the throttled streams ended before the measurement")
    cpu0, t0 = server.cpu_seconds(), time.monotonic()
    await asyncio.sleep(window_s)
    throttled = (server.cpu_seconds() - cpu0) / (time.monotonic() - t0)
    ttft_during = await _fresh_ttft_ms(server.base_url, "during")
    load.cancel()
    try:
        await load
    except (asyncio.CancelledError, Exception):
        pass
    return {"no_requests_cores": round(no_requests, 4), "throttled_cores": round(throttled, 4),
            "fresh_ttft_ms_before": round(ttft_before, 1),
            "fresh_ttft_ms_during": round(ttft_during, 1)}


def run(model: Path, window_s: float, workdir: Path | None = None,
        names: tuple[str, ...] = tuple(name for name, _, _ in CASES),
        warmup_tokens: int = 8) -> dict[str, Any]:
    """``names``: the cases to run (``--quick`` leaves out the asynchronous one: a vLLM
    server fewer to start, and tests/e2e/test_serve.py checks the idle wait in both modes).
    ``warmup_tokens``: the one warm-up request's tokens, paced at ``USER_RATE`` like every
    user (8: about 3.5 s per server)."""
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-idle-"))
    servers = {}
    for name, idle_wait, scheduling in CASES:
        if name not in names:
            continue
        section = {"default_user_output_tokens_per_second": USER_RATE, "idle_wait": idle_wait}
        port = free_port()
        argv = tokenpace_serve_argv(model, port, "--additional-config",
                                    json.dumps({"tokenpace": section}), scheduling)
        servers[name] = Server(argv, port, home / f"vllm-{name}.log")
    start_all(list(servers.values()))
    cases = {}
    try:
        for name, server in servers.items():  # one at a time
            asyncio.run(run_streams(server.base_url, [("warm-up", 1, warmup_tokens)]))
            cases[name] = asyncio.run(measure(server, window_s))
            c = cases[name]
            print(f"{name:15s}: {c['throttled_cores']:.3f} cores while throttled, "
                  f"{c['no_requests_cores']:.3f} with no requests; fresh user's first token "
                  f"{c['fresh_ttft_ms_before']:.1f} ms before, {c['fresh_ttft_ms_during']:.1f} "
                  "ms during", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    without = cases["busy_loop"]["throttled_cores"]
    return {
        "benchmark": "idle", "window_s": window_s, "streams": STREAMS,
        "user_rate": USER_RATE, "cases": cases,
        "ratio": round(cases["idle_wait"]["throttled_cores"] / without, 4) if without else None,
        "ratio_async": (round(cases["idle_wait_async"]["throttled_cores"] / without, 4)
                        if without and "idle_wait_async" in cases else None),
        **environment(),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    from ._plots import pyplot, save

    plt = pyplot()
    titles = {"idle_wait": "idle wait, sync", "idle_wait_async": "idle wait, async",
              "busy_loop": "without (vLLM's loop)"}
    names = [name for name, _, _ in CASES if name in result["cases"]]
    labels = [titles[name] for name in names]
    xs = list(range(len(names)))
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    throttled = [result["cases"][n]["throttled_cores"] for n in names]
    floor = [result["cases"][n]["no_requests_cores"] for n in names]
    ax.bar(xs, throttled, 0.5, label="all requests throttled")
    ax.bar(xs, floor, 0.5, label="no requests", alpha=0.7)
    for x, v in zip(xs, throttled):
        ax.annotate(f"{v:.3f}", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("server CPU (cores)")
    ax.legend(fontsize=8)
    save(fig, path)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--window", type=positive_float, default=10.0,
                        help="measurement window in seconds (default 10)")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        result = run(bench_model(args), 2.0, names=("idle_wait", "busy_loop"), warmup_tokens=2)
    else:
        result = run(bench_model(args), args.window)
    return write_outputs(args, result, plot)
