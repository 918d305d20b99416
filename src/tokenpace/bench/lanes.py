"""`tokenpace bench lanes`: better-priority requests straight at a full engine.

One engine at a time (``tokenpace serve`` on the tiny model, ``--scheduling-policy
priority --max-num-seqs slots``), in two arms:

- ``lanes``: tokenpace's lanes (``slots`` requests run per step, ``slots`` more places
  hold lower-priority requests);
- ``stock``: ``--no-lanes``, vLLM's own priority scheduling (a better arrival waits for a
  running request to end).

Each arm runs, in rounds (the order alternating), two phases of ``duration`` seconds:

- ``idle``: high-priority requests (``priority`` 0, an 8-token prompt, ``high_tokens``
  output tokens, streamed) arriving as a Poisson process at ``rate`` per second, alone;
- ``full``: the same arrivals (same seed) while ``slots`` closed-loop clients keep the
  engine full of low-priority requests (``priority`` 10, ``low_tokens`` output tokens).

Reported per arm and phase: the high requests' time to first token (p50, p90, p99) and
end to end (p50) of those sent after ``warmup``; in ``full`` also the low requests'
output tokens per second (what the lanes leave the lower lane). The ratios full / idle
are per round, summarised as medians with a 95% bootstrap interval (``ratio_summary``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from .._process import Server, free_port, start_all, tokenpace_serve_argv
from ._cli import add_common_args, bench_model, positive_float, positive_int, write_outputs
from ._environment import environment
from ._load import StreamRecord, percentile, stream_aiohttp
from ._paired import pair_order, ratio_summary

ARMS = ("lanes", "stock")
PHASES = ("idle", "full")
PROMPT = [17, 42, 99, 7, 256, 31, 64, 128]
HIGH, LOW = 0, 10
SEED = 1234


def _arrivals(rate: float, duration: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _phase(url: str, phase: str, p: dict[str, Any], seed: int) -> dict[str, Any]:
    """One phase: the high arrivals, with the engine kept full of low requests in ``full``."""
    high = {"model": "tiny", "prompt": PROMPT, "max_tokens": p["high_tokens"], "stream": True,
            "ignore_eos": True, "return_token_ids": True, "priority": HIGH}
    low = {"model": "tiny", "prompt": PROMPT, "max_tokens": p["low_tokens"],
           "ignore_eos": True, "priority": LOW}
    duration, warmup = p["duration_s"], p["warmup_s"]
    records: list[StreamRecord] = []
    low_ends: list[tuple[float, int]] = []
    errors: list[str] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        stop = time.monotonic() + duration + (2.0 if phase == "full" else 0.0)

        async def low_client() -> None:
            while time.monotonic() < stop:
                async with session.post(f"{url}/v1/completions", json=low) as resp:
                    if resp.status != 200:
                        errors.append(f"low: HTTP {resp.status}")
                        return
                    answer = await resp.json()
                low_ends.append((time.monotonic(), int(answer["usage"]["completion_tokens"])))

        lows = [asyncio.create_task(low_client()) for _ in range(p["slots"])] \
            if phase == "full" else []
        if lows:
            await asyncio.sleep(2.0)  # the engine is full before the first high arrival
        t0 = time.monotonic()

        async def one(offset: float) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            try:
                records.append(await stream_aiohttp(session, url, high, "high"))
            except Exception as exc:  # counted and reported
                errors.append(f"high: {type(exc).__name__}: {exc}"[:200])

        await asyncio.gather(*(one(a) for a in _arrivals(p["rate"], duration, seed)))
        for task in lows:
            task.cancel()
        await asyncio.gather(*lows, return_exceptions=True)
    counted = [r for r in records if r.start >= t0 + warmup and r.token_times]
    ttfts = [r.ttft for r in counted]
    e2e = [r.last - r.start for r in counted]
    low_tokens = sum(n for t, n in low_ends if t0 + warmup <= t < t0 + duration)
    return {
        "ttft_p50_s": round(percentile(ttfts, 50), 4) if ttfts else None,
        "ttft_p90_s": round(percentile(ttfts, 90), 4) if ttfts else None,
        "ttft_p99_s": round(percentile(ttfts, 99), 4) if ttfts else None,
        "e2e_p50_s": round(percentile(e2e, 50), 4) if e2e else None,
        "high_requests": len(counted),
        "low_output_tokens_per_s": round(low_tokens / (duration - warmup), 1) if lows else None,
        "errors": len(errors), "error_examples": errors[:3]}


def run(model: Path, duration: float = 15.0, warmup: float = 3.0, rounds: int = 3,
        rate: float = 2.0, high_tokens: int = 32, low_tokens: int = 256, slots: int = 16,
        workdir: Path | None = None) -> dict[str, Any]:
    if not 0 < warmup < duration:
        raise ValueError("warmup must be above 0 and below duration")
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-lanes-"))
    params: dict[str, Any] = {
        "duration_s": duration, "warmup_s": warmup, "rounds": rounds, "rate": rate,
        "high_tokens": high_tokens, "low_tokens": low_tokens, "slots": slots,
        "priorities": {"high": HIGH, "low": LOW}, "prompt_tokens": len(PROMPT)}
    started = time.monotonic()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for arm in ARMS:
        port = free_port()
        engine = Server(tokenpace_serve_argv(
            model, port, "--max-num-seqs", str(slots), "--scheduling-policy", "priority",
            *(() if arm == "lanes" else ("--no-lanes",))), port, home / f"engine-{arm}.log")
        runs[arm] = {name: [] for name in PHASES}
        try:
            start_all([engine])
            asyncio.run(_phase(engine.base_url, "idle", {**params, "duration_s": 3.0,
                                                         "warmup_s": 1.0}, 0))  # warm-up
            for i in range(rounds):
                for name in pair_order(list(PHASES), i):
                    runs[arm][name].append(asyncio.run(
                        _phase(engine.base_url, name, params, SEED + i)))
                    print(f"{arm} round {i + 1} {name}: {runs[arm][name][-1]}", flush=True)
        finally:
            engine.stop()
    result = {"benchmark": "lanes", "parameters": params, "runs": runs,
              "summary": summarize(runs), "wall_s": round(time.monotonic() - started, 1),
              **environment()}
    _print(result)
    print(f"logs in {home}")
    return result


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per arm: full / idle ratios of the high requests' TTFT (p50, p90) and end to end,
    per round; and the low lane's output tokens/s with lanes against stock."""
    out: dict[str, Any] = {}
    for arm, phases in runs.items():
        entry: dict[str, Any] = {}
        for key in ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s"):
            full = [r[key] for r in phases["full"]]
            idle = [r[key] for r in phases["idle"]]
            if all(v is not None for v in full + idle) and full:
                entry[key.removesuffix("_s") + "_full_over_idle"] = ratio_summary(full, idle)
        entry["low_output_tokens_per_s"] = [r["low_output_tokens_per_s"] for r in phases["full"]]
        out[arm] = entry
    if all(arm in runs for arm in ARMS):
        lanes = [r["low_output_tokens_per_s"] or 0.0 for r in runs["lanes"]["full"]]
        stock = [r["low_output_tokens_per_s"] or 0.0 for r in runs["stock"]["full"]]
        if all(stock):
            out["low_lane_lanes_over_stock"] = ratio_summary(lanes, stock)
    return out


def _print(result: dict[str, Any]) -> None:
    for arm, entry in result["summary"].items():
        print(f"{arm}: {entry}")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Better-priority requests straight at a full engine (tiny model, --scheduling-policy "
        "priority, --max-num-seqs 16), with tokenpace's lanes and with vLLM's own priority "
        "scheduling (--no-lanes): their time to first token with 16 low-priority request "
        "loops keeping the engine full, against the engine idle; and what the low lane keeps.")
    add_common_args(parser)
    parser.add_argument("--duration", type=positive_float, default=15.0,
                        help="seconds per phase and round (default 15)")
    parser.add_argument("--warmup", type=positive_float, default=3.0,
                        help="first seconds of a phase left uncounted (default 3)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds (default 3)")
    parser.add_argument("--rate", type=positive_float, default=2.0,
                        help="high-priority arrivals per second (default 2)")
    parser.add_argument("--low-tokens", type=positive_int, default=256,
                        help="output tokens of each low-priority request (default 256)")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        result = run(bench_model(args), duration=5.0, warmup=1.0, rounds=1, rate=args.rate,
                     low_tokens=args.low_tokens)
    else:
        if args.warmup >= args.duration:
            raise SystemExit("tokenpace bench lanes: error: --warmup must be below --duration")
        result = run(bench_model(args), args.duration, args.warmup, args.rounds, args.rate,
                     low_tokens=args.low_tokens)
    return write_outputs(args, result, None)
