"""`tokenpace bench pacing`: the pacing experiment on a real server with the tiny model.

A 20 tok/s user with 1 and then with 4 streams runs next to a 100 tok/s user, 200 tokens
per stream, ``ignore_eos``, under synchronous and asynchronous scheduling. Each user's
rate is measured twice: at the engine (its event log: charges net of refunds) and at the
client (token arrival times). Rates are net of the GCRA burst allowance: ``N`` tokens at
``r`` tok/s span at least ``(N - 1 - 0.1 r) / r`` seconds, so the reported rate is
``(N - 1 - 0.1 r) / span``. Token gaps are measured over all of a user's streams merged,
and compared with ``1 / limit``.

Then end users: a 20 tok/s user ("readers") with two end users paced at 4 tok/s
each (reading speed), one stream each, beside a stream of the same user that names no end
user: each end user at 4 at the client, the user's total at 20 at the engine (the stream
without an end user takes the other 12; unpaced end users would get a third of 20 each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from ._cli import add_common_args, bench_model, positive_int, write_outputs
from ._environment import environment
from ._load import StreamRecord, async_client, percentile, run_streams, stream_completion
from .._process import Server, free_port, start_all, tokenpace_serve_argv
from ..engine import read_charges

SLOW_RATE = 20.0
FAST_RATE = 100.0
END_USER_RATE = 4.0
END_USERS = ("reader-1", "reader-2")
BURST_S = 0.1
WARMUP_USER = "warm-up"


def _net_rate(times: list[float], limit: float) -> float:
    span = max(times) - min(times)
    return (len(times) - 1 - BURST_S * limit) / span if span > 0 else float("nan")


def _gaps(times: list[float]) -> list[float]:
    ordered = sorted(times)
    return [b - a for a, b in zip(ordered, ordered[1:])]


def _engine_times(event_log: Path, users: set[str]) -> dict[str, list[float]]:
    """Per user, the instants of charges that were not refunded (seconds)."""
    out: dict[str, list[float]] = {}
    for (user, _), stamps in read_charges(event_log, users).items():
        out.setdefault(user, []).extend(t / 1e9 for t in stamps)
    return out


def _user_summary(user: str, limit: float, records: list[StreamRecord],
                  engine: list[float]) -> dict[str, Any]:
    client_times = [t for r in records for t in r.token_times]
    gaps = _gaps(client_times)
    engine_gaps = _gaps(engine)
    return {
        "user": user,
        "limit": limit,
        "streams": len(records),
        "tokens": sum(r.completion_tokens or 0 for r in records),
        "client_rate": round(_net_rate(client_times, limit), 3),
        "engine_rate": round(_net_rate(engine, limit), 3),
        "client_gap_p50_s": round(percentile(gaps, 50), 4),
        "client_gap_p99_s": round(percentile(gaps, 99), 4),
        "engine_gap_p50_s": round(percentile(engine_gaps, 50), 4),
        "engine_gap_p99_s": round(percentile(engine_gaps, 99), 4),
        "ideal_gap_s": round(1 / limit, 4),
        "stream_finish_spread_s": round(
            max(r.last for r in records) - min(r.last for r in records), 3
        ),
    }


def _scenario(server: Server, event_log: Path, streams: int, tokens: int) -> dict[str, Any]:
    slow, fast = f"slow-{streams}", f"fast-{streams}"
    records = asyncio.run(run_streams(server.base_url, [(slow, streams, tokens), (fast, 1, tokens)]))
    origin = min(r.start for r in records)
    engine = wait_for_engine_log(event_log, {slow, fast}, streams * tokens + tokens)
    engine_origin = min(min(v) for v in engine.values())
    users = {
        slow: (SLOW_RATE, [r for r in records if r.user == slow]),
        fast: (FAST_RATE, [r for r in records if r.user == fast]),
    }
    return {
        "slow_streams": streams,
        "tokens_per_stream": tokens,
        "users": [_user_summary(u, lim, recs, engine.get(u, [])) for u, (lim, recs) in users.items()],
        "series": {  # cumulative tokens over time, for the plot
            u: {
                "client_s": [round(t - origin, 4) for t in sorted(x for r in recs for x in r.token_times)],
                "engine_s": [round(t - engine_origin, 4) for t in sorted(engine.get(u, []))],
            }
            for u, (_, recs) in users.items()
        },
    }


def _end_user_scenario(server: Server, event_log: Path, tokens: int) -> dict[str, Any]:
    """Three end users of "readers" at END_USER_RATE, one stream each, and a stream of
    "readers" without an end user: per end user its rate at the client, the user's total
    at the engine (its limit, SLOW_RATE)."""
    user = "readers"

    async def streams() -> list[StreamRecord]:
        async with async_client(timeout=900) as client:
            jobs = [stream_completion(client, server.base_url, None, tokens, extra={
                "vllm_xargs": {"output_rate_user": user, "output_rate_end_user": e}})
                for e in END_USERS]
            jobs.append(stream_completion(client, server.base_url, user, tokens))
            return list(await asyncio.gather(*jobs))

    records = asyncio.run(streams())
    engine = wait_for_engine_log(event_log, {user}, tokens * (len(END_USERS) + 1))
    total = engine.get(user, [])
    rows = []
    for name, record in zip([*END_USERS, "(no end user)"], records):
        times = record.token_times
        rows.append({"end_user": name, "tokens": record.completion_tokens,
                     "client_rate": round(_net_rate(times, END_USER_RATE), 3),
                     "client_gap_p50_s": round(percentile(_gaps(times), 50), 4)})
    # The user's total while all four streams ran (until the first of them ended).
    until = min(max(r.token_times) for r in records)
    engine_until = min(total) + (until - min(min(r.token_times) for r in records))
    busy = [t for t in total if t <= engine_until]
    return {"user": user, "user_limit": SLOW_RATE, "end_user_limit": END_USER_RATE,
            "tokens_per_stream": tokens, "streams": rows,
            "user_engine_rate_all_streams": round(_net_rate(busy, SLOW_RATE), 3)}


def wait_for_engine_log(event_log: Path, users: set[str], expected: int) -> dict[str, list[float]]:
    """The event log is written by a background thread: wait until it has every token."""
    deadline = time.monotonic() + 10
    while True:
        times = _engine_times(event_log, users)
        if sum(len(v) for v in times.values()) >= expected or time.monotonic() > deadline:
            return times
        time.sleep(0.2)


def run(model: Path, modes: list[str], tokens: int, stream_counts: list[int],
        workdir: Path | None = None, serve_flags: list[str] | None = None,
        warmup_rate: float | None = None) -> dict[str, Any]:
    """``warmup_rate``: the warm-up user's output tokens/s (None: the default rate, as the
    slow users', so its 256 tokens take about 13 s per mode; ``--quick`` runs it unpaced)."""
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-pacing-"))
    servers: dict[str, tuple[Server, Path]] = {}
    for mode in modes:
        port = free_port()
        events = home / f"events-{mode}.jsonl"
        overrides = {f"fast-{n}": FAST_RATE for n in stream_counts}
        if warmup_rate is not None:
            overrides[WARMUP_USER] = warmup_rate
        argv = tokenpace_serve_argv(
            model, port,
            "--default-user-output-tokens-per-second", str(SLOW_RATE),
            "--user-output-tokens-per-second", json.dumps(overrides),
            "--output-rate-event-log", str(events),
            "--end-user-output-tokens-per-second", str(END_USER_RATE),
            "--async-scheduling" if mode == "async" else "--no-async-scheduling",
            *(serve_flags or ()),
        )
        servers[mode] = (Server(argv, port, home / f"vllm-{mode}.log"), events)
    start_all([s for s, _ in servers.values()])
    results = []
    end_users: list[dict[str, Any]] = []
    try:
        for mode, (server, events) in servers.items():
            asyncio.run(run_streams(server.base_url, [(WARMUP_USER, 8, 32)]))
            for n in stream_counts:  # one server busy at a time: 2 cores are easily disturbed
                result = {"mode": mode, **_scenario(server, events, n, tokens)}
                results.append(result)
                for u in result["users"]:
                    print(f"{mode:5s} slow streams={n} {u['user']:8s} limit={u['limit']:5.0f} "
                          f"client={u['client_rate']:7.2f} engine={u['engine_rate']:7.2f} tok/s "
                          f"gap p50={u['client_gap_p50_s'] * 1000:6.1f} ms "
                          f"p99={u['client_gap_p99_s'] * 1000:6.1f} ms "
                          f"(ideal {u['ideal_gap_s'] * 1000:.0f} ms)", flush=True)
            eu = {"mode": mode, **_end_user_scenario(server, events, tokens)}
            end_users.append(eu)
            for row in eu["streams"]:
                print(f"{mode:5s} readers end user {row['end_user']:14s} "
                      f"client={row['client_rate']:6.2f} tok/s (limit {END_USER_RATE:.0f})",
                      flush=True)
            print(f"{mode:5s} readers total at the engine "
                  f"{eu['user_engine_rate_all_streams']:6.2f} tok/s (limit {SLOW_RATE:.0f})",
                  flush=True)
    finally:
        for server, _ in servers.values():
            server.stop()
    return {"benchmark": "pacing", "tokens_per_stream": tokens, "serve_flags": serve_flags or [],
            "scenarios": results,
            "end_users": end_users, **environment()}


def plot(result: dict[str, Any], path: Path) -> None:
    """Cumulative tokens per user over time, one panel per mode and scenario."""
    from ._plots import pyplot, save

    plt = pyplot()
    scenarios = result["scenarios"]
    cols = min(2, len(scenarios))
    rows = -(-len(scenarios) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, sc in zip(axes.flat, scenarios):
        for user, series in sc["series"].items():
            limit = SLOW_RATE if user.startswith("slow") else FAST_RATE
            xs = series["client_s"]
            ax.step(xs, range(1, len(xs) + 1), where="post", label=f"{user} (client)")
            ex = series["engine_s"]
            ax.plot(ex, range(1, len(ex) + 1), linestyle=":", label=f"{user} (engine)")
            if xs:
                ax.plot([xs[0], xs[-1]], [1, 1 + limit * (xs[-1] - xs[0])], color="grey",
                        linewidth=0.6)
        ax.set_title(f"{sc['mode']}: 20 tok/s user x{sc['slow_streams']} + 100 tok/s user",
                     fontsize=9)
        ax.set_xlabel("seconds")
        ax.set_ylabel("cumulative output tokens")
        ax.legend(fontsize=7)
    save(fig, path)


def _modes(value: str) -> list[str]:
    modes = value.split(",")
    if not modes or any(m not in ("sync", "async") for m in modes):
        raise argparse.ArgumentTypeError(f"expected sync, async or sync,async; got {value!r}")
    return modes


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = ("A 20 tok/s user with 1 and with 4 streams next to a 100 tok/s user "
                          "on tokenpace serve with the tiny model; rates at the engine and "
                          "the client.")
    add_common_args(parser)
    parser.add_argument("--tokens", type=positive_int, default=200, help="tokens per stream")
    parser.add_argument("--modes", type=_modes, default=["sync", "async"],
                        help="scheduling modes (default sync,async)")
    parser.add_argument("--serve-flags", default="", metavar="FLAGS",
                        help="more vllm serve flags for the engines, as one string (e.g. "
                        "--serve-flags \"--speculative-config '{...}'\"): the experiment in "
                        "another engine mode")


def main(args: argparse.Namespace) -> int:
    tokens = 40 if args.quick else args.tokens
    modes = ["sync"] if args.quick else args.modes
    # --quick: the warm-up unpaced (it warms the engine, it measures nothing)
    result = run(bench_model(args), modes, tokens, [1, 4],
                 serve_flags=shlex.split(args.serve_flags),
                 warmup_rate=1_000_000.0 if args.quick else None)
    return write_outputs(args, result, plot)
