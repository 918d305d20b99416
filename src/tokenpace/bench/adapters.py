"""`tokenpace bench fleet --workload adapters`: LoRA adapters over a pool of two engines, the
gateway's placement against two adapter-blind ways of spreading them.

Two engines of the tiny model with ``--enable-lora --max-loras 2 --max-cpu-loras 2``
(run-time loading allowed), six adapters the project writes (``write_tiny_adapter``).
Three tenants of equal weight each run ``streams`` closed-loop streams; every request
names an adapter drawn by Zipf popularity (exponent ``zipf``: the first adapter about 6
times as popular as the last). Three arms, each through a gateway of its own, in rounds
whose order changes (``pair_order``):

- ``any``: every adapter loaded on both engines before the arm (through vLLM's API), the
  gateway sending each request to the least loaded engine: adapter-blind balance, the
  engines' own LoRA caches (two places) swapping adapters in and out;
- ``pinned``: each adapter loaded on one engine only (``ad0``, ``ad2``, ``ad4`` on the
  first), its requests always there;
- ``placed``: nothing loaded before the arm; the gateway's ``adapters`` section with
  ``max_adapters: 2`` per engine: each request placed where its adapter is loaded within
  ``adapter_affinity``, else loaded where it costs least (``gateway.fleet.place_adapter``).

Per arm, over the arm less its first ``warmup_s``: output tokens/s and TTFT p50 (at the
client), each tenant's share of the output tokens, and for ``placed`` the share of its
requests sent where the adapter was loaded (the gateway's
``tokenpace_gateway_adapter_dispatches_total``) and its loads per minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from .._process import Server, free_port, start_all, tokenpace_serve_argv
from ..tiny_model import write_tiny_adapter
from ..up import CPU_BIND_ENV, cpu_binds
from ._environment import environment
from ._gateway_yaml import engine_entry, gateway_yaml, tenant_entry
from ._load import sse_payloads
from ._paired import pair_order, ratio_summary

ARMS = ("any", "pinned", "placed")
ADAPTERS = tuple(f"ad{i}" for i in range(6))
TENANTS = ("t0", "t1", "t2")
MAX_LORAS = 2
PROMPT = "the lamp in the window of the house by the river"


def zipf_weights(n: int, exponent: float) -> list[float]:
    """Popularity of ``n`` items by rank: 1/rank^exponent, normalised."""
    raw = [1.0 / (rank ** exponent) for rank in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def shares(tokens: dict[str, int]) -> dict[str, float]:
    total = sum(tokens.values())
    return {t: round(n / total, 4) if total else 0.0 for t, n in tokens.items()}


async def _stream(session: aiohttp.ClientSession, url: str, key: str, rng: random.Random,
                  weights: list[float], until: float, counted_from: float, max_tokens: int,
                  out: list[tuple[float, int]], errors: list[str]) -> None:
    """Requests one after the other until ``until``; each that started after
    ``counted_from`` appends (time to first token, output tokens)."""
    headers = {"authorization": f"Bearer {key}"}
    while time.monotonic() < until:
        adapter = rng.choices(ADAPTERS, weights)[0]
        start = time.monotonic()
        first: float | None = None
        tokens = 0
        try:
            async with session.post(f"{url}/v1/completions", headers=headers, json={
                    "model": adapter, "prompt": PROMPT, "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True}) as resp:
                if resp.status != 200:
                    errors.append(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
                    await asyncio.sleep(0.5)
                    continue
                async for data in sse_payloads(resp.content.iter_any()):
                    if data == b"[DONE]":
                        continue
                    for choice in json.loads(data).get("choices") or ():
                        if choice.get("text") is not None:
                            tokens += 1
                            if first is None:
                                first = time.monotonic()
        except aiohttp.ClientError as exc:
            errors.append(type(exc).__name__)
            await asyncio.sleep(0.5)
            continue
        if start >= counted_from and first is not None:
            out.append((first - start, tokens))


_DISPATCHES = re.compile(
    r'^tokenpace_gateway_adapter_dispatches_total\{adapter="[^"]*",loaded="(true|false)"\} (\S+)$',
    re.M)
_LOADS = re.compile(
    r'^tokenpace_gateway_adapter_loads_total\{engine="[^"]*",outcome="ok"\} (\S+)$', re.M)


def _gateway_counts(url: str) -> dict[str, float]:
    page = httpx.get(f"{url}/metrics", timeout=10).text
    counts = {"true": 0.0, "false": 0.0, "loads": 0.0}
    for loaded, value in _DISPATCHES.findall(page):
        counts[loaded] += float(value)
    counts["loads"] = sum(float(v) for v in _LOADS.findall(page))
    return counts


RATIOS = ("output_tokens_per_s", "ttft_p50_s", "ttft_mean_s", "ttft_p90_s")


def _set_adapters(engines: list[str], wanted: list[set[str]], home: Path) -> None:
    """Each engine holds exactly its set of ``wanted`` adapters (vLLM's load and unload
    API), then a pause for the gateways' next health checks to list them."""
    with httpx.Client(timeout=60) as http:
        for url, names in zip(engines, wanted):
            listed = {m["id"] for m in http.get(f"{url}/v1/models").json()["data"]
                      if m.get("parent")}
            for name in listed - names:
                http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
            for name in sorted(names - listed):
                resp = http.post(f"{url}/v1/load_lora_adapter",
                                 json={"lora_name": name, "lora_path": str(home / name)})
                resp.raise_for_status()
    time.sleep(5.0)  # two health intervals: every gateway lists what the engines hold now


async def _arm(url: str, duration: float, warmup: float, streams: int, max_tokens: int,
               weights: list[float], seed: int) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    out: dict[str, list[tuple[float, int]]] = {t: [] for t in TENANTS}
    errors: list[str] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        start = time.monotonic()
        await asyncio.gather(*(
            _stream(session, url, f"sk-{tenant}", random.Random(f"{seed}-{tenant}-{i}"),
                    weights, start + duration, start + warmup, max_tokens, out[tenant], errors)
            for tenant in TENANTS for i in range(streams)))
    counted = duration - warmup
    ttfts = sorted(t for rows in out.values() for t, _ in rows)
    tokens = {t: sum(n for _, n in rows) for t, rows in out.items()}
    return {
        "output_tokens_per_s": round(sum(tokens.values()) / counted, 1),
        "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else None,
        # The mean and p90 too: one queue per adapter (``pinned``) and one per base spread
        # the same waits differently (many short and a few long, or all alike).
        "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
        "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 4) if ttfts else None,
        "requests": len(ttfts),
        "shares": shares(tokens),
        "errors": errors[:5],
        "error_count": len(errors),
    }


def run(model: Path, duration: float = 30.0, warmup: float = 5.0, rounds: int = 2,
        streams: int = 8, max_inflight: int = 8, max_tokens: int = 32, zipf: float = 1.0,
        max_adapters: int = MAX_LORAS, cpu_loras: int = 3,
        workdir: Path | None = None) -> dict[str, Any]:
    if warmup >= duration:
        raise ValueError("the warm-up must be shorter than the run")
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-adapters-"))
    for i, name in enumerate(ADAPTERS):
        write_tiny_adapter(home / name, seed=i)
    ports = [free_port() for _ in range(2)]
    binds = cpu_binds(2, sorted(os.sched_getaffinity(0)), cpu_vllm=True, environ={})
    flags = ("--enable-lora", "--max-loras", str(MAX_LORAS), "--max-lora-rank", "8",
             "--max-cpu-loras", str(max(cpu_loras, MAX_LORAS)))
    engines = [Server(tokenpace_serve_argv(model, port, "--max-num-seqs", str(max_inflight),
                                           *flags),
                      port, home / f"engine-{port}.log",
                      env={CPU_BIND_ENV: bind or "", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
               for port, bind in zip(ports, binds)]
    urls = [e.base_url for e in engines]
    tenants = [tenant_entry(t, f"sk-{t}", queue_timeout="10m") for t in TENANTS]
    gateways: dict[str, Server] = {}
    for arm in ARMS:
        placed = arm == "placed"
        config = home / f"gateway-{arm}.yaml"
        config.write_text(gateway_yaml(
            [engine_entry(u, max_inflight, max_adapters=max_adapters if placed else None)
             for u in urls],
            tenants, home / f"usage-{arm}.db", metrics_cache=0,
            **({"adapters": [{"name": a, "base": "tiny", "path": str(home / a)}
                             for a in ADAPTERS]} if placed else {})))
        port = free_port()
        gateways[arm] = Server(
            [sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(config),
             "--port", str(port), "--log-level", "warning"], port, home / f"gateway-{arm}.log")
    weights = zipf_weights(len(ADAPTERS), zipf)
    holdings = {"any": [set(ADAPTERS), set(ADAPTERS)],
                "pinned": [set(ADAPTERS[0::2]), set(ADAPTERS[1::2])],
                "placed": [set(), set()]}
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    try:
        start_all([*engines, *gateways.values()])
        for i in range(rounds):
            for arm in pair_order(list(ARMS), i):
                _set_adapters(urls, holdings[arm], home)
                url = gateways[arm].base_url
                before = _gateway_counts(url)
                result = asyncio.run(_arm(url, duration, warmup, streams, max_tokens,
                                          weights, seed=i))
                after = _gateway_counts(url)
                if arm == "placed":
                    sent = (after["true"] - before["true"]) + (after["false"] - before["false"])
                    result["loaded_hit"] = (round((after["true"] - before["true"]) / sent, 4)
                                            if sent else None)
                    result["loads_per_minute"] = round(
                        (after["loads"] - before["loads"]) / (duration / 60), 2)
                runs[arm].append(result)
                print(f"round {i + 1} {arm}: {result}", flush=True)
    finally:
        for server in (*gateways.values(), *engines):
            server.stop()
    metric = {arm: {k: [r[k] for r in rs] for k in RATIOS} for arm, rs in runs.items()}
    placed_runs = runs["placed"]
    worst_share = max(abs(s - 1 / len(TENANTS)) for r in placed_runs
                      for s in r["shares"].values())
    out: dict[str, Any] = {
        "benchmark": "fleet-adapters",
        "parameters": {"duration_s": duration, "warmup_s": warmup, "rounds": rounds,
                       "streams_per_tenant": streams, "max_inflight_per_engine": max_inflight,
                       "max_tokens": max_tokens, "zipf": zipf,
                       "popularity": [round(w, 4) for w in weights],
                       "engines": f"2 x tiny, --max-loras {MAX_LORAS} --max-cpu-loras "
                                  f"{max(cpu_loras, MAX_LORAS)}",
                       "max_adapters": max_adapters,
                       "adapters": list(ADAPTERS), "tenants": list(TENANTS)},
        "arms": runs,
        "placed_over_pinned": {
            k: ratio_summary(metric["placed"][k], metric["pinned"][k]) for k in RATIOS},
        "placed_over_any": {
            k: ratio_summary(metric["placed"][k], metric["any"][k]) for k in RATIOS},
        "goals": {
            "loaded_hit_min": min(r["loaded_hit"] or 0.0 for r in placed_runs),
            "loaded_hit_met": all((r["loaded_hit"] or 0.0) >= 0.95 for r in placed_runs),
            "throughput_placed_over_pinned_met":
                statistics.median(metric["placed"]["output_tokens_per_s"])
                >= statistics.median(metric["pinned"]["output_tokens_per_s"]),
            "worst_share_error": round(worst_share, 4),
            "shares_met": worst_share <= 0.05,
        },
        **environment(),
    }
    _print(out)
    return out


def _print(result: dict[str, Any]) -> None:
    for arm, rs in result["arms"].items():
        print(f"{arm:>7}: output tok/s {[r['output_tokens_per_s'] for r in rs]}, "
              f"TTFT p50 {[r['ttft_p50_s'] for r in rs]} s, mean "
              f"{[r['ttft_mean_s'] for r in rs]} s, shares {[r['shares'] for r in rs]}"
              + (f", loaded hit {[r['loaded_hit'] for r in rs]}, loads/min "
                 f"{[r['loads_per_minute'] for r in rs]}" if arm == "placed" else ""))
    for name in ("placed_over_pinned", "placed_over_any"):
        for metric, summary in result[name].items():
            print(f"{name} {metric}: {summary['median']} {summary['interval95']}")
    print(f"goals: {result['goals']}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, metric in zip(axes, ("output_tokens_per_s", "ttft_p50_s")):
        values = [statistics.median(r[metric] for r in result["arms"][a]) for a in ARMS]
        ax.bar(ARMS, values)
        ax.set_title(metric)
    fig.suptitle("bench fleet --workload adapters")
    fig.tight_layout()
    fig.savefig(path)


def main(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """The run ``tokenpace bench fleet --workload adapters`` asks for (``--quick``: one
    short round)."""
    if args.quick:
        return run(model, duration=10.0, warmup=2.0, rounds=1, streams=4,
                   max_inflight=args.max_inflight, max_adapters=args.max_adapters)
    if args.warmup >= args.duration:
        raise SystemExit("tokenpace bench fleet: error: --warmup must be below --duration")
    return run(model, args.duration, args.warmup, args.rounds, args.streams // 2 or 1,
               args.max_inflight, max_adapters=args.max_adapters)
