"""`tokenpace bench fleet --workload conversations`: multi-turn conversations over a pool of
two engines, where the engine a turn goes to decides whether its prompt is cached there.

Two engines serve ``tiny`` with prefix caching and little KV cache each (``kv_bytes``,
8 MiB by default: a few hundred thousand tokens of the tiny model, so engines that cache
every conversation evict). One tenant runs ``conversations`` closed-loop conversations: an
opening of ``opening_words`` words (about 600 tokens of the tiny model), then turns that send the whole conversation so
far (the engine's last answer and a short new user message appended), ``pause_s`` between
turns, a fresh conversation after ``turns`` turns. Measured three ways, in rounds whose
order changes (``pair_order``), each run with conversations of its own (nothing cached by
an earlier run helps a later one; the engines' prefix caches are also reset between runs):

- ``direct``: each conversation sent straight to one engine (half the conversations each):
  what a prefix-aware router achieves, the ideal;
- ``tenant``: through a gateway with ``locality: tenant`` (the tenant's engine while it is
  at most ``pool_affinity`` ahead, else the least loaded);
- ``conversation``: through a gateway with ``locality: conversation`` (each conversation
  on the engine that served its last turn, else the one its opening hashes to, within the
  same load bound).

For each: the engines' prefix-cache hit rate (their ``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries`` during the run), time to first token (p50, p99) and turns
per second, counted after ``warmup_s``. Then two tenants of equal weight, each with more
conversations than the pool has slots at the gateway, through the ``conversation``
gateway: each tenant's share of the output tokens (the fair queue decides them as
before). And, without engines, what the choice costs per request: the conversation key of
an opening of this size and the engine choice, on 2 and 8 engines.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import aiohttp

from .._process import Server, free_port, start_all, tokenpace_serve_argv
from ..up import CPU_BIND_ENV, cpu_binds
from ._environment import environment
from ._gateway_yaml import engine_entry, gateway_yaml, tenant_entry
from ._load import sse_payloads
from ._paired import pair_order, ratio_summary

PATHS = ("direct", "tenant", "conversation")
WORDS = ("river", "stone", "cloud", "amber", "quiet", "signal", "orbit", "lantern", "maple",
         "harbor", "copper", "meadow", "vector", "falcon", "ember", "tundra", "cipher", "willow")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _turn(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                prompt: str, max_tokens: int) -> tuple[float, str]:
    """One streamed turn: (time to first token, the answer's text)."""
    start = time.monotonic()
    first: float | None = None
    text: list[str] = []
    async with session.post(f"{url}/v1/completions", headers=headers, json={
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
        async for data in sse_payloads(resp.content.iter_any()):
            if data == b"[DONE]":
                continue
            for choice in json.loads(data).get("choices") or ():
                if choice.get("text"):
                    if first is None:
                        first = time.monotonic()
                    text.append(choice["text"])
    return (first if first is not None else time.monotonic()) - start, "".join(text)


async def _conversation_slot(session: aiohttp.ClientSession, url: str, key: str | None,
                             rng: random.Random, until: float, counted_from: float,
                             shape: dict[str, Any], out: list[tuple[float, int]]) -> None:
    """Conversations one after the other until ``until``; each turn counted after
    ``counted_from`` appends (ttft, output tokens)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    while time.monotonic() < until:
        prompt = _words(rng, shape["opening_words"])
        for _ in range(shape["turns"]):
            if time.monotonic() >= until:
                return
            ttft, answer = await _turn(session, url, headers, prompt, shape["max_tokens"])
            if time.monotonic() >= counted_from:
                out.append((ttft, shape["max_tokens"]))
            prompt = f"{prompt}{answer}\n{_words(rng, shape['turn_words'])}\n"
            await asyncio.sleep(shape["pause_s"])


_COUNTER = re.compile(r"^(vllm:prefix_cache_(?:hits|queries))(?:_total)?\{[^}]*\} (\S+)$", re.M)


async def _cache_counters(session: aiohttp.ClientSession, engines: list[str]) -> dict[str, float]:
    totals = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    for url in engines:
        async with session.get(f"{url}/metrics") as resp:
            for name, value in _COUNTER.findall(await resp.text()):
                totals[name] += float(value)
    return totals


async def _run(engines: list[str], targets: list[tuple[str, str | None]], seed: int,
               duration: float, warmup: float, shape: dict[str, Any]) -> dict[str, Any]:
    """One run: a conversation slot per target (url, tenant key); hit rate, TTFT, turns/s."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        for url in engines:  # nothing an earlier run cached helps this one
            async with session.post(f"{url}/reset_prefix_cache") as resp:
                await resp.read()
        before = await _cache_counters(session, engines)
        start = time.monotonic()
        turns: dict[int, list[tuple[float, int]]] = {i: [] for i in range(len(targets))}
        await asyncio.gather(*(
            _conversation_slot(session, url, key, random.Random(f"{seed}-{i}"),
                               start + duration, start + warmup, shape, turns[i])
            for i, (url, key) in enumerate(targets)))
        after = await _cache_counters(session, engines)
    hits = after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"]
    queries = after["vllm:prefix_cache_queries"] - before["vllm:prefix_cache_queries"]
    ttfts = sorted(t for ts in turns.values() for t, _ in ts)
    counted = duration - warmup
    return {
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "turns_per_s": round(len(ttfts) / counted, 3),
        "ttft_p50_s": round(_percentile(ttfts, 50), 4),
        "ttft_p99_s": round(_percentile(ttfts, 99), 4),
        "turns": len(ttfts),
        "tokens_by_target": [sum(n for _, n in turns[i]) for i in range(len(targets))],
    }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


def _gateway_config(engines: list[str], locality: str, ledger: Path, slots: int) -> str:
    return gateway_yaml(
        [engine_entry(url, slots, models=["tiny"]) for url in engines],
        [tenant_entry(t, f"sk-{t}", queue_timeout="10m") for t in ("solo", "t1", "t2")],
        ledger,
        locality=locality,
        metrics_cache=0,  # counters read after the run: never a cached page
    )


def choice_cost(opening_words: int, engines: int) -> float:
    """Microseconds of CPU per request for the conversation key of such an opening, the
    engine choice among ``engines`` for a conversation with a home, and remembering it (the
    real functions, in process; a new conversation adds a BLAKE2b per engine)."""
    from ..gateway import parse_config
    from ..gateway.dispatch import Dispatcher
    from ..gateway.wire import conversation_key, parse_request

    config = parse_config({"engines": [{"url": f"http://10.0.0.{i}:8000", "models": ["tiny"]}
                                       for i in range(engines)],
                           "ledger": "sqlite:///unused.db",
                           "tenants": [{"id": "t", "api_keys": ["k"]}]})
    dispatcher = Dispatcher(config, time.monotonic)
    pool = dispatcher.pools["tiny"]
    req = parse_request("completion", {"model": "tiny",
                                       "prompt": _words(random.Random(0), opening_words)})

    def once() -> None:
        key = conversation_key(req, "t")
        assert key is not None
        engine = dispatcher._conversation_engine("t", pool, key)
        assert engine is not None
        dispatcher._remember_home("t", key, engine)

    runs = 2000
    return min(timeit.repeat(once, number=runs, repeat=5)) / runs * 1e6


def run(model: Path, duration: float = 40.0, warmup: float = 5.0, rounds: int = 3,
        conversations: int = 12, slots: int = 16, opening_words: int = 128, turns: int = 8,
        turn_words: int = 10, max_tokens: int = 16, pause_s: float = 0.2,
        kv_bytes: int = 8 * 1024 * 1024, workdir: Path | None = None) -> dict[str, Any]:
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-conversations-"))
    ports = [free_port() for _ in range(2)]
    binds = cpu_binds(2, sorted(os.sched_getaffinity(0)), cpu_vllm=True, environ={})
    engines = [Server(tokenpace_serve_argv(model, port, "--max-num-seqs", str(slots),
                                           "--kv-cache-memory-bytes", str(kv_bytes),
                                           "--enable-prefix-caching"),
                      port, home / f"engine-{port}.log",
                      env={CPU_BIND_ENV: bind or "", "VLLM_SERVER_DEV_MODE": "1"})
               for port, bind in zip(ports, binds)]
    urls = [e.base_url for e in engines]
    gateways: dict[str, Server] = {}
    for locality in ("tenant", "conversation"):
        config = home / f"gateway-{locality}.yaml"
        config.write_text(_gateway_config(urls, locality, home / f"usage-{locality}.db", slots))
        port = free_port()
        gateways[locality] = Server(
            [sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(config),
             "--port", str(port), "--log-level", "warning"], port, home / f"gateway-{locality}.log")
    shape = {"opening_words": opening_words, "turns": turns, "turn_words": turn_words,
             "max_tokens": max_tokens, "pause_s": pause_s}
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
    shares: list[dict[str, Any]] = []
    try:
        start_all([*engines, *gateways.values()])
        for i in range(rounds):
            for path in pair_order(list(PATHS), i):
                if path == "direct":
                    targets = [(urls[c % 2], None) for c in range(conversations)]
                else:
                    targets = [(gateways[path].base_url, "sk-solo")] * conversations
                runs[path].append(asyncio.run(_run(urls, targets, hash((path, i)) & 0xFFFF,
                                                   duration, warmup, shape)))
                print(f"round {i + 1} {path}: {runs[path][-1]}", flush=True)
            # Two tenants, each with more conversations than the gateway's slots.
            url = gateways["conversation"].base_url
            targets = [(url, "sk-t1")] * slots + [(url, "sk-t2")] * slots
            both = asyncio.run(_run(urls, targets, 1000 + i, duration, warmup,
                                    {**shape, "pause_s": 0.0}))
            t1 = sum(both["tokens_by_target"][:slots])
            total = sum(both["tokens_by_target"]) or 1
            shares.append({"t1": round(t1 / total, 4), "t2": round(1 - t1 / total, 4),
                           "hit_rate": both["hit_rate"], "turns_per_s": both["turns_per_s"]})
            print(f"round {i + 1} two tenants: {shares[-1]}", flush=True)
    finally:
        for server in (*gateways.values(), *engines):
            server.stop()
    metric = {p: {k: [r[k] for r in rs] for k in ("hit_rate", "turns_per_s", "ttft_p50_s",
                                                  "ttft_p99_s")} for p, rs in runs.items()}
    result: dict[str, Any] = {
        "benchmark": "fleet-conversations",
        "parameters": {"duration_s": duration, "warmup_s": warmup, "rounds": rounds,
                       "conversations": conversations, "slots_per_engine": slots,
                       "opening_words": opening_words, "turns": turns,
                       "turn_words": turn_words, "max_tokens": max_tokens, "pause_s": pause_s,
                       "kv_cache_bytes": kv_bytes, "engines": "2 x tiny"},
        "paths": metric,
        "conversation_over_direct": {
            "hit_rate": ratio_summary(metric["conversation"]["hit_rate"],
                                      metric["direct"]["hit_rate"]),
            "turns_per_s": ratio_summary(metric["conversation"]["turns_per_s"],
                                         metric["direct"]["turns_per_s"])},
        "conversation_over_tenant": {
            "hit_rate": ratio_summary(metric["conversation"]["hit_rate"],
                                      metric["tenant"]["hit_rate"]),
            "turns_per_s": ratio_summary(metric["conversation"]["turns_per_s"],
                                         metric["tenant"]["turns_per_s"]),
            "ttft_p50_s": ratio_summary(metric["conversation"]["ttft_p50_s"],
                                        metric["tenant"]["ttft_p50_s"])},
        "two_tenants": {"runs": shares,
                        "t1_share_median": round(statistics.median(s["t1"] for s in shares), 4)},
        "choice_cost_us": {f"{n}_engines": round(choice_cost(opening_words, n), 2)
                           for n in (2, 8)},
        **environment(),
    }
    _print(result)
    return result


def _print(result: dict[str, Any]) -> None:
    for path, values in result["paths"].items():
        print(f"{path:>13}: hit rate {values['hit_rate']}, turns/s {values['turns_per_s']}, "
              f"TTFT p50 {values['ttft_p50_s']} s, p99 {values['ttft_p99_s']} s")
    for name in ("conversation_over_direct", "conversation_over_tenant"):
        for metric, summary in result[name].items():
            print(f"{name} {metric}: {summary['median']} {summary['interval95']}")
    print(f"two tenants, t1's share: {result['two_tenants']['t1_share_median']} "
          f"({[s['t1'] for s in result['two_tenants']['runs']]})")
    print(f"choice cost per request (us): {result['choice_cost_us']}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, metric in zip(axes, ("hit_rate", "turns_per_s", "ttft_p50_s")):
        values = [statistics.median(result["paths"][p][metric]) for p in PATHS]
        ax.bar(PATHS, values)
        ax.set_title(metric)
    fig.tight_layout()
    fig.savefig(path)
