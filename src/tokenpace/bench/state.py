"""`tokenpace bench state`: what shared state costs a request, Redis against in process.

One request's state work as the gateway does it, one call per stage: admission (reserve
the budget, take a queued place, lift the tenant's fair-queue counter), dispatch (trade
the queued place for the running slots: tenant concurrency and engine ``max_inflight``;
count the lane's dispatched cost), the output's charges (collected in process, not a
round trip), settlement (release, settle). Three round trips with Redis. Measured on the same machine as a ``redis-server`` started for the run (or
``--redis URL``), alternating the in-process store and the Redis store over repeats:

- latency: one request at a time, the wall time of its state work (median and p99);
- throughput: ``concurrency`` requests at once, requests per second through one process
  and that process's CPU time per request (the gateway's own cost; Redis's is separate).

Ratios are against the in-process store measured in the same run.

A second measurement runs the gateway's dispatcher itself, as a request meets it: wait for
the slot (``Lease.acquire``), a charge, release. In process (one replica: no store call at
all) against the shared dispatcher on Redis, uncontended (the slot is free: one round trip
to take it, one in the background to give it back) and contended (``max_inflight`` is half
the concurrency: the waiting half also takes a queued place and trades it, two more).
Budgets are not part of it (their reserve and settle are one script each, above). The
``conversations`` pair runs the same over a pool of two engines, every request a turn of a
conversation (``locality: conversation``): with Redis, each turn reads its conversation's
home first (one round trip more) and a new home goes with the store's flush.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ..fairness import BudgetSpec
from ..gateway.state import (
    Admission,
    LocalStore,
    StateStore,
    StoreLease,
    engine_slot,
    queued_slot,
    running_slot,
)
from ._cli import add_common_args, positive_int, write_outputs
from ._environment import environment
from ._load import percentile
from ._redis_server import SETUP, RedisServer
from .overhead import median_interval

BUDGET = BudgetSpec(1e15, 86400)
TENANTS = [f"tenant-{i}" for i in range(8)]
ROUND_TRIPS = 3


async def _one(store: StateStore, tenant: str) -> None:
    admitted = await store.admit(tenant, [BUDGET], 300.0, queued_slot(tenant, 10_000),
                                 "default")
    assert isinstance(admitted, Admission)
    running = await store.dispatch(
        [running_slot(tenant, 10_000), engine_slot("http://e1", 10_000)], admitted.queued,
        "default", 300.0)
    assert isinstance(running, StoreLease)
    store.charge("default", tenant, 200.0)
    await store.finish(running, admitted.reservation, 250.0)


async def _latency(store: StateStore, requests: int) -> list[float]:
    out = []
    for i in range(requests):
        t0 = time.perf_counter()
        await _one(store, TENANTS[i % len(TENANTS)])
        out.append(time.perf_counter() - t0)
    return out


async def _throughput(store: StateStore, requests: int, concurrency: int) -> tuple[float, float]:
    """(requests per second, CPU seconds of this process per request)."""
    queue = list(range(requests))

    async def worker() -> None:
        while queue:
            i = queue.pop()
            await _one(store, TENANTS[i % len(TENANTS)])

    c0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return requests / elapsed, cpu / requests


async def _dispatch_path(url: str | None, requests: int, concurrency: int,
                         max_inflight: int, conversations: bool = False
                         ) -> tuple[float, float, float]:
    """(median wait for the slot in s one at a time, CPU s per request at ``concurrency``,
    requests per second) through the real dispatcher; ``url`` None: in process.
    ``conversations``: a pool of two engines and every request a turn of one of 1,000
    conversations (``locality: conversation``: with Redis, the home's read per turn)."""
    from ..gateway import parse_config
    from ..gateway.dispatch import make_dispatcher
    from ..gateway.state import RedisStore
    from ..gateway.tenants import Tenants

    engines = ["http://bench-engine", "http://bench-engine-2"] if conversations \
        else ["http://bench-engine"]
    config = parse_config({
        "engines": [{"url": u, "max_inflight": max_inflight, "models": ["bench"]}
                    for u in engines],
        "tenants": [{"id": t, "api_keys": [f"k-{t}"], "max_concurrency": 10_000}
                    for t in TENANTS],
        "ledger": "sqlite:///unused.db",
    })
    clock = asyncio.get_running_loop().time
    store = None if url is None else RedisStore(url, timeout_s=5.0, prefix="tokenpace-bench:")
    if store is not None:
        await store.start()
    dispatcher = make_dispatcher(config, clock, store)
    tenants = Tenants(config, clock)
    pool = dispatcher.pools["bench"]
    background: set[asyncio.Task[Any]] = getattr(dispatcher, "_background", set())

    keys = [hashlib.blake2b(b"conversation %d" % i, digest_size=16).digest()
            for i in range(1000)] if conversations else [None]

    async def one(i: int) -> float:
        lease = dispatcher.lease(tenants.get(TENANTS[i % len(TENANTS)]),  # type: ignore[arg-type]
                                 pool, 60.0, 64.0, 300.0, affinity=keys[i % len(keys)])
        t0 = time.perf_counter()
        await lease.acquire()
        waited = time.perf_counter() - t0
        lease.charge(200.0)
        await asyncio.sleep(0)  # the request's time on the engine: let the others run
        lease.release()
        return waited

    async def drain() -> None:
        while background:
            await asyncio.gather(*list(background), return_exceptions=True)

    try:
        for i in range(50):  # warm-up
            await one(i)
        await drain()
        waits = []
        for i in range(requests):
            waits.append(await one(i))
            await drain()  # one at a time: the release lands before the next request
        queue = list(range(requests))

        async def worker() -> None:
            while queue:
                await one(queue.pop())

        c0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await drain()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        await dispatcher.close()
        if store is not None:
            await store.close()
    return statistics.median(waits), cpu / requests, requests / elapsed


async def _measure_dispatch(url: str, requests: int, concurrency: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, store_url, limit, turns in (
            ("memory", None, 10_000, False), ("redis", url, 10_000, False),
            ("memory_contended", None, max(1, concurrency // 2), False),
            ("redis_contended", url, max(1, concurrency // 2), False),
            ("memory_conversations", None, 10_000, True),
            ("redis_conversations", url, 10_000, True)):
        wait, cpu, rps = await _dispatch_path(store_url, requests, concurrency, limit, turns)
        out[name] = {"slot_wait_median_us": wait * 1e6, "cpu_us_per_request": cpu * 1e6,
                     "requests_per_s": rps, "max_inflight": limit}
    return out


async def _measure(url: str, requests: int, concurrency: int, repeats: int) -> dict[str, Any]:
    from ..gateway.state import RedisStore

    # A generous timeout: this measures cost, and a stalled shared machine must not abort it.
    redis = RedisStore(url, timeout_s=5.0, prefix="tokenpace-bench:")
    memory = LocalStore()
    stores: dict[str, StateStore] = {"memory": memory, "redis": redis}
    runs: dict[str, dict[str, list[float]]] = {
        name: {"median_s": [], "p99_s": [], "rps": [], "cpu_s": []} for name in stores}
    try:
        await redis.start()
        for store in stores.values():
            await _latency(store, 50)  # warm-up: connections, script loading
        for i in range(repeats):
            names = list(stores) if i % 2 == 0 else list(stores)[::-1]
            for name in names:
                lat = await _latency(stores[name], requests)
                rps, cpu = await _throughput(stores[name], requests, concurrency)
                runs[name]["median_s"].append(statistics.median(lat))
                runs[name]["p99_s"].append(percentile(lat, 99))
                runs[name]["rps"].append(rps)
                runs[name]["cpu_s"].append(cpu)
    finally:
        await redis.close()
    summary: dict[str, Any] = {}
    for name, r in runs.items():
        summary[name] = {
            "latency_median_us": statistics.median(r["median_s"]) * 1e6,
            "latency_median_us_interval": [x * 1e6 for x in median_interval(r["median_s"])],
            "latency_p99_us": statistics.median(r["p99_s"]) * 1e6,
            "requests_per_s": statistics.median(r["rps"]),
            "cpu_us_per_request": statistics.median(r["cpu_s"]) * 1e6,
            "runs": r,
        }
    ratios = [b / a for a, b in zip(runs["memory"]["cpu_s"], runs["redis"]["cpu_s"])]
    summary["redis_over_memory_cpu"] = {"median": statistics.median(ratios),
                                        "interval": list(median_interval(ratios))}
    return summary


def run(requests: int, concurrency: int, repeats: int, redis_url: str | None = None) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="tokenpace-bench-state-"))
    server = (RedisServer.given(redis_url, "tokenpace bench state") if redis_url is not None
              else RedisServer.start(home, "tokenpace bench state", "this benchmark"))
    try:
        result = asyncio.run(_measure(server.url, requests, concurrency, repeats))
        result["dispatcher"] = asyncio.run(_measure_dispatch(server.url, requests, concurrency))
    finally:
        server.stop()
    result.update({
        "benchmark": "state", "requests": requests, "concurrency": concurrency,
        "repeats": repeats, "round_trips_per_request": ROUND_TRIPS,
        "redis_server": SETUP if server.proc is not None else "given",
        "environment": environment(),
    })
    _print(result)
    return result


def _print(result: dict[str, Any]) -> None:
    print(f"state work of one request ({result['round_trips_per_request']} round trips with "
          f"Redis), {result['repeats']} repeats of {result['requests']} requests:")
    for name in ("memory", "redis"):
        r = result[name]
        lo, hi = r["latency_median_us_interval"]
        print(f"  {name:6s} latency median {r['latency_median_us']:8.0f} us "
              f"(95% {lo:.0f}-{hi:.0f}), p99 {r['latency_p99_us']:8.0f} us; "
              f"{r['requests_per_s']:8.0f} req/s at concurrency {result['concurrency']}, "
              f"CPU {r['cpu_us_per_request']:6.0f} us/request")
    ratio = result["redis_over_memory_cpu"]
    print(f"  gateway CPU per request, redis / memory: {ratio['median']:.1f}x "
          f"(95% {ratio['interval'][0]:.1f}-{ratio['interval'][1]:.1f})")
    print(f"the dispatcher's slot (acquire, charge, release), concurrency {result['concurrency']}:")
    for name, r in result.get("dispatcher", {}).items():
        print(f"  {name:20s} (max_inflight {r['max_inflight']:5d}) slot wait median "
              f"{r['slot_wait_median_us']:7.0f} us alone; {r['requests_per_s']:7.0f} req/s, "
              f"CPU {r['cpu_us_per_request']:5.0f} us/request")


def plot(result: dict[str, Any], path: Path) -> None:
    from ._plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = ["memory", "redis"]
    ax.bar(names, [result[n]["latency_median_us"] for n in names], label="median")
    ax.bar(names, [result[n]["latency_p99_us"] - result[n]["latency_median_us"] for n in names],
           bottom=[result[n]["latency_median_us"] for n in names], alpha=0.4, label="to p99")
    ax.set_yscale("log")  # in process and Redis differ by more than 10x
    ax.set_ylabel("state work per request (us, log scale)")
    ax.set_title("Gateway state: in process vs Redis")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--requests", type=positive_int, default=2000,
                        help="requests per measurement (default 2000)")
    parser.add_argument("--concurrency", type=positive_int, default=32,
                        help="requests at once in the throughput measurement (default 32)")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="alternating repeats per store (default 5)")
    parser.add_argument("--redis", metavar="URL", default=None,
                        help="an existing Redis (default: start a redis-server for the run)")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.requests, args.repeats = 200, 2
    result = run(args.requests, args.concurrency, args.repeats, args.redis)
    return write_outputs(args, result, plot)
