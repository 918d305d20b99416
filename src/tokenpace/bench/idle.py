"""`tokenpace bench idle`: server CPU while every request is throttled.

Two paced servers run the same load, one with the idle wait (and the worker nap) and one
with ``idle_wait: false``, which leaves vLLM's engine loop re-running ``schedule()`` every
millisecond and its worker spinning. The load is 8 streams of one user limited to 1 tok/s:
all its requests are throttled almost all the time. CPU is the user + system time of the
whole server process tree (API server, engine core, worker) over a window, in cores.
A third number is the same tree with no requests at all, the floor.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from ._environment import environment
from ._load import run_streams
from ._server import Server, free_port, start_all, tokenpace_serve_argv

USER_RATE = 1.0
STREAMS = 8


async def _measure(server: Server, window_s: float) -> dict[str, float]:
    await asyncio.sleep(2.0)  # vLLM's worker spins for a second after the warm-up request
    idle0, t0 = server.cpu_seconds(), time.monotonic()
    await asyncio.sleep(window_s)
    no_requests = (server.cpu_seconds() - idle0) / (time.monotonic() - t0)
    load = asyncio.create_task(run_streams(server.base_url, [("throttled", STREAMS, 1000)]))
    await asyncio.sleep(3.0)  # admitted, burst spent
    if load.done():
        load.result()  # raises what went wrong
        raise RuntimeError("the throttled streams ended before the measurement")
    cpu0, t0 = server.cpu_seconds(), time.monotonic()
    await asyncio.sleep(window_s)
    throttled = (server.cpu_seconds() - cpu0) / (time.monotonic() - t0)
    load.cancel()
    try:
        await load
    except (asyncio.CancelledError, Exception):
        pass
    return {"no_requests_cores": round(no_requests, 4), "throttled_cores": round(throttled, 4)}


def run(model: Path, window_s: float, workdir: Path | None = None) -> dict[str, Any]:
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-idle-"))
    servers = {}
    for name, idle_wait in (("idle_wait", True), ("busy_loop", False)):
        section = {"default_user_output_tokens_per_second": USER_RATE, "idle_wait": idle_wait}
        port = free_port()
        argv = tokenpace_serve_argv(model, port, "--additional-config",
                                    json.dumps({"tokenpace": section}))
        servers[name] = Server(argv, port, home / f"vllm-{name}.log")
    start_all(list(servers.values()))
    cases = {}
    try:
        for name, server in servers.items():  # one at a time
            asyncio.run(run_streams(server.base_url, [("warm-up", 1, 8)]))
            cases[name] = asyncio.run(_measure(server, window_s))
            print(f"{name:9s}: {cases[name]['throttled_cores']:.3f} cores while throttled, "
                  f"{cases[name]['no_requests_cores']:.3f} with no requests", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    with_wait = cases["idle_wait"]["throttled_cores"]
    without = cases["busy_loop"]["throttled_cores"]
    return {
        "benchmark": "idle", "window_s": window_s, "streams": STREAMS,
        "user_rate": USER_RATE, "cases": cases,
        "ratio": round(with_wait / without, 4) if without else None,
        **environment(),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    from ._plots import pyplot, save

    plt = pyplot()
    names = ["idle_wait", "busy_loop"]
    labels = ["with idle wait", "without (vLLM's loop)"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    throttled = [result["cases"][n]["throttled_cores"] for n in names]
    floor = [result["cases"][n]["no_requests_cores"] for n in names]
    ax.bar([0, 1], throttled, 0.5, label="all requests throttled")
    ax.bar([0, 1], floor, 0.5, label="no requests", alpha=0.7)
    for x, v in enumerate(throttled):
        ax.annotate(f"{v:.3f}", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks([0, 1], labels)
    ax.set_ylabel("server CPU (cores)")
    ax.legend(fontsize=8)
    save(fig, path)
