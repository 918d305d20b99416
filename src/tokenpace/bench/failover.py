"""`tokenpace bench failover`: one engine of a pool killed under load and started again.

Two engines on the tiny model serve ``tiny`` in one pool (``max_inflight`` each) behind one
gateway; one tenant with a budget runs ``streams`` clients that stream ``max_tokens``-token
completions without pause. After ``kill_after`` seconds engine B's process group gets
SIGKILL (what an OOM kill or a node loss does); ``down_for`` seconds later it is started
again on the same port, and the load goes on until ``after_back`` seconds after B took
traffic again (or ``restart_timeout`` passed).

Reported, against its goals:

- requests failed by class, from the gateway's ledger: *in flight on the dead engine*
  (``upstream_error``: they had reached it; these must fail) and *never reached it*
  (``rejected:*``, refused by the gateway: the goal is 0), and what the clients saw;
- the time from the kill until the gateway took B out of dispatch (its ``/health``), and
  the dispatches B still got meanwhile are the requests in flight there;
- the time from B answering its own ``/health`` again to the gateway taking it back, and to
  its first request in flight there (goal: within one health interval, 2 s);
- tokens B generated in the ``after_back`` seconds after it answered (its own
  ``vllm:generation_tokens_total``);
- the ledger's completion tokens against what the clients received.

The gateway's ``/health`` and B's are polled every ``POLL_S`` by the bench itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from .._process import (
    PROMPT_TOKENS_DETAILS,
    Server,
    free_port,
    start_all,
    tokenpace_serve_argv,
)
from ..gateway.ledger import open_ledger
from ..up import CPU_BIND_ENV, cpu_binds
from ._cli import add_common_args, bench_model, positive_float, positive_int, write_outputs
from ._environment import environment
from ._gateway_yaml import engine_entry, gateway_yaml, tenant_entry
from ._load import sse_payloads

ENGINE_KEY = "sk-bench-failover-engine"
TENANT_KEY = "sk-bench-failover"
ADMIN_KEY = "sk-bench-admin"  # /health's engine view needs an admin or metrics key
POLL_S = 0.02
HEALTH_INTERVAL_S = 2.0  # the gateway's (tokenpace.gateway.fleet.HEALTH_INTERVAL_S)
PROMPT = "Tell me about the sea"


@dataclass
class Request:
    start: float
    end: float = 0.0
    status: int = 0
    tokens: int = 0
    error: str | None = None  # an error event, a broken stream, a refused connection


@dataclass
class Timeline:
    """What the pollers saw, as monotonic instants."""

    kill: float = 0.0
    restart: float = 0.0
    b_out: float | None = None  # the gateway's /health first shows B not healthy
    b_answering: float | None = None  # B's own /health first answers 200 after the restart
    b_back: float | None = None  # the gateway's /health first shows B healthy again
    b_traffic: float | None = None  # first request in flight on B after it was back
    done: threading.Event = field(default_factory=threading.Event)


def _gateway_config(urls: list[str], ledger: Path, max_inflight: int) -> str:
    return gateway_yaml(
        [engine_entry(u, max_inflight, models=["tiny"], api_key=ENGINE_KEY) for u in urls],
        [tenant_entry("fleet", TENANT_KEY, queue_timeout="10m",
                budgets=[{"tokens": 100_000_000, "per": "1h"}])],
        ledger,
        admin_api_keys=[ADMIN_KEY],
    )


async def _client(session: aiohttp.ClientSession, url: str, stop: asyncio.Event,
                  max_tokens: int, records: list[Request]) -> None:
    # Usage in every chunk: what the client was told it received, token by token (a
    # token's text may be empty, so counting texts would undercount).
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    while not stop.is_set():
        record = Request(start=time.monotonic())
        records.append(record)
        try:
            async with session.post(f"{url}/v1/completions", json=body,
                                    headers={"authorization": f"Bearer {TENANT_KEY}"}) as resp:
                record.status = resp.status
                if resp.status != 200:
                    record.error = (await resp.read())[:200].decode(errors="replace")
                else:
                    async for data in sse_payloads(resp.content.iter_any()):
                        if data == b"[DONE]":
                            continue
                        event = json.loads(data)
                        if "error" in event:
                            record.error = str(event["error"].get("message"))
                        elif event.get("usage"):
                            record.tokens = int(event["usage"]["completion_tokens"])
        except (aiohttp.ClientError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.end = time.monotonic()
        if record.status != 200:
            await asyncio.sleep(0.05)  # a refused client backs off a little, as SDKs do


def _poll(gateway: str, engine_b: str, timeline: Timeline) -> None:
    """The gateway's view of B and B's own health, every ``POLL_S`` (in a thread)."""
    with httpx.Client(timeout=2.0) as http:
        while not timeline.done.is_set():
            now = time.monotonic()
            try:
                view = {e["url"]: e for e in http.get(f"{gateway}/health", headers={
                    "authorization": f"Bearer {ADMIN_KEY}"}).json()["engines"]}
            except (httpx.HTTPError, ValueError, KeyError):
                view = {}
            b = view.get(engine_b)
            if b is not None and timeline.kill:
                if timeline.b_out is None and not b["healthy"]:
                    timeline.b_out = now
                if timeline.restart and timeline.b_answering is not None:
                    if timeline.b_back is None and b["healthy"]:
                        timeline.b_back = now
                    if timeline.b_back is not None and timeline.b_traffic is None \
                            and b["inflight"] > 0:
                        timeline.b_traffic = now
            if timeline.restart and timeline.b_answering is None:
                try:
                    if http.get(f"{engine_b}/health").status_code == 200:
                        timeline.b_answering = time.monotonic()
                except httpx.HTTPError:
                    pass
            time.sleep(POLL_S)


def _generated(engine: str) -> float | None:
    """The engine's ``vllm:generation_tokens_total``."""
    try:
        text = httpx.get(f"{engine}/metrics", timeout=5.0,
                         headers={"authorization": f"Bearer {ENGINE_KEY}"}).text
    except httpx.HTTPError:
        return None
    values = [float(m.group(1)) for m in re.finditer(
        r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M)]
    return sum(values) if values else None


def _ledger(path: Path, since_wall: float) -> list[tuple[str, int]]:
    ledger = open_ledger(f"sqlite:///{path}")
    try:
        return [(r.finish_reason, r.completion_tokens) for r in ledger.rows()
                if r.started_at >= since_wall]
    finally:
        ledger.close()


def run(model: Path, kill_after: float = 10.0, down_for: float = 10.0,
        after_back: float = 15.0, streams: int = 8, max_tokens: int = 24,
        max_inflight: int = 4, restart_timeout: float = 600.0,
        workdir: Path | None = None) -> dict[str, Any]:
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-failover-"))
    ports = [free_port(), free_port()]
    binds = cpu_binds(2, sorted(os.sched_getaffinity(0)), cpu_vllm=True, environ={})

    def engine(port: int, bind: str | None, start: int) -> Server:
        return Server(tokenpace_serve_argv(model, port, "--trusted-gateway",
                                           "--max-num-seqs", str(2 * max_inflight),
                                           PROMPT_TOKENS_DETAILS),
                      port, home / f"engine-{port}-{start}.log",
                      env={CPU_BIND_ENV: bind or "", "VLLM_API_KEY": ENGINE_KEY})

    engines = [engine(port, bind, 1) for port, bind in zip(ports, binds)]
    urls = [e.base_url for e in engines]
    ledger = home / "usage.db"
    config = home / "gateway.yaml"
    config.write_text(_gateway_config(urls, ledger, max_inflight))
    gw_port = free_port()
    gateway = Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(config),
                      "--port", str(gw_port), "--log-level", "warning"], gw_port,
                     home / "gateway.log")
    servers = [*engines, gateway]
    timeline = Timeline()
    records: list[Request] = []
    generated_after: float | None = None
    try:
        start_all(servers)
        poller = threading.Thread(target=_poll, args=(gateway.base_url, urls[1], timeline),
                                  daemon=True)
        poller.start()
        since_wall = time.time()

        async def load() -> None:
            nonlocal generated_after
            stop = asyncio.Event()
            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                clients = [asyncio.create_task(_client(session, gateway.base_url, stop,
                                                       max_tokens, records))
                           for _ in range(streams)]
                await asyncio.sleep(kill_after)
                os.killpg(engines[1].proc.pid, signal.SIGKILL)
                timeline.kill = time.monotonic()
                await asyncio.sleep(down_for)
                await asyncio.to_thread(engines[1].stop)  # reap the killed group
                engines[1] = engine(ports[1], binds[1], 2)
                servers[1] = engines[1]
                timeline.restart = time.monotonic()
                deadline = timeline.restart + restart_timeout
                while timeline.b_answering is None and time.monotonic() < deadline:
                    if engines[1].exited():
                        raise RuntimeError(f"engine B did not restart:\n{engines[1].log_tail()}")
                    await asyncio.sleep(0.1)
                if timeline.b_answering is not None:
                    await asyncio.sleep(max(0.0, timeline.b_answering + after_back
                                            - time.monotonic()))
                    generated_after = await asyncio.to_thread(_generated, urls[1])
                stop.set()
                await asyncio.gather(*clients)

        asyncio.run(load())
        time.sleep(1.5)  # the ledger's writer flushes once a second
        rows = _ledger(ledger, since_wall)
    finally:
        timeline.done.set()
        for server in reversed(servers):
            server.stop()
    result = _figures(timeline, records, rows, generated_after)
    result["parameters"] = {"kill_after_s": kill_after, "down_for_s": down_for,
                            "after_back_s": after_back, "streams": streams,
                            "max_tokens": max_tokens, "max_inflight_per_engine": max_inflight,
                            "engines": "2 x tiny, one pool"}
    result.update(environment())
    _print(result)
    return result


def _since(t: float | None, origin: float) -> float | None:
    return None if t is None or not origin else round(t - origin, 3)


def _figures(timeline: Timeline, records: list[Request], rows: list[tuple[str, int]],
             generated_after: float | None) -> dict[str, Any]:
    by_reason: dict[str, int] = {}
    for reason, _ in rows:
        key = "rejected" if reason.startswith("rejected:") else reason
        by_reason[key] = by_reason.get(key, 0) + 1
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    return {
        "requests": len(records),
        "client_status": statuses,
        "client_errors": sum(r.error is not None for r in records),
        "failed_in_flight_on_dead_engine": by_reason.get("upstream_error", 0),
        "failed_never_reached_dead_engine": by_reason.get("rejected", 0),
        "ledger_rows": len(rows),
        "ledger_by_finish_reason": by_reason,
        "ledger_completion_tokens": sum(t for _, t in rows),
        "client_tokens": sum(r.tokens for r in records),
        "seconds_kill_to_out_of_dispatch": _since(timeline.b_out, timeline.kill),
        "seconds_restart_to_answering": _since(timeline.b_answering, timeline.restart),
        "seconds_answering_to_back_in_dispatch": _since(timeline.b_back, timeline.b_answering),
        "seconds_answering_to_first_request": _since(timeline.b_traffic, timeline.b_answering),
        "restarted_engine_generated_tokens": generated_after,
    }


def _print(result: dict[str, Any]) -> None:
    p = result["parameters"]
    print(f"failover: {result['requests']} requests from {p['streams']} streams; client "
          f"status {result['client_status']}, {result['client_errors']} with an error")
    print(f"  failed: {result['failed_in_flight_on_dead_engine']} in flight on the dead engine, "
          f"{result['failed_never_reached_dead_engine']} that never reached it (goal 0)")
    print(f"  out of dispatch {result['seconds_kill_to_out_of_dispatch']} s after the kill; "
          f"back {result['seconds_answering_to_back_in_dispatch']} s after it answered again "
          f"(restart took {result['seconds_restart_to_answering']} s), first request there "
          f"{result['seconds_answering_to_first_request']} s after (goal within "
          f"{HEALTH_INTERVAL_S:g} s); it generated {result['restarted_engine_generated_tokens']} "
          f"tokens in {p['after_back_s']:g} s after answering")
    print(f"  ledger: {result['ledger_rows']} rows {result['ledger_by_finish_reason']}, "
          f"{result['ledger_completion_tokens']} completion tokens; clients received "
          f"{result['client_tokens']}")



def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Two engines on the tiny model in one pool behind the gateway, clients streaming "
        "without pause; one engine's process group gets SIGKILL, then it is started again on "
        "its port. Reports the requests failed (in flight on the dead engine, or never "
        "reached it), how long the gateway kept dispatching to it, how soon the restarted "
        "engine took traffic, and the ledger against what the clients received.")
    add_common_args(parser)
    parser.add_argument("--kill-after", type=positive_float, default=10.0,
                        help="seconds of load before the kill (default 10)")
    parser.add_argument("--down-for", type=positive_float, default=10.0,
                        help="seconds between the kill and the restart (default 10)")
    parser.add_argument("--after-back", type=positive_float, default=15.0,
                        help="seconds of load after the restarted engine answers (default 15)")
    parser.add_argument("--streams", type=positive_int, default=8,
                        help="clients streaming without pause (default 8)")
    parser.add_argument("--tokens", type=positive_int, default=24,
                        help="output tokens per request (default 24)")
    parser.add_argument("--max-inflight", type=positive_int, default=4,
                        help="requests the gateway keeps on each engine (default 4)")
    parser.add_argument("--restart-timeout", type=positive_float, default=600.0,
                        help="seconds to wait for the restarted engine (default 600)")


def main(args: argparse.Namespace) -> int:
    if args.plot:
        raise SystemExit("tokenpace bench failover: error: --plot is not supported (use --json)")
    if args.quick:
        args.kill_after, args.down_for, args.after_back = 5.0, 3.0, 5.0
    result = run(bench_model(args), args.kill_after, args.down_for, args.after_back,
                 args.streams, args.tokens, args.max_inflight, args.restart_timeout)
    return write_outputs(args, result)
