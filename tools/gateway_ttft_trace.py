"""Where the gateway's added time to first token goes: timestamps on one clock, per request.

    PYTHONPATH=src .venv/bin/python tools/gateway_ttft_trace.py --model MODEL --pairs 200

Starts the engine (``tokenpace serve --trusted-gateway``), a gateway whose process is
instrumented (below) and the byte relay of ``bench gateway --control byte-proxy``, then
sends the bench's sequential streamed requests (``bench.gateway.body``: the same work on
every path) in triples (direct, gateway, byte proxy; the order cycling through all six).
CLOCK_MONOTONIC is one clock for every process of the machine, so the client's and the
gateway's timestamps subtract. For each gateway request, in order along its path:

- ``client_to_gateway``: from just before the client sends to the gateway's first read of
  the request (the read in which uvicorn's parser finds its headers);
- ``uvicorn_to_handler``: from that read to the gateway's handler starting (HTTP parsing,
  the request's task);
- ``handler_to_post``: admission and dispatch, to the engine call being started;
- ``engine_from_gateway``: from the engine call being started to the first generated
  token read by the gateway (the upstream client's send, the engine, the hop back);
- ``relay_to_client``: from that read to the client's arrival of the chunk (the relay's
  work on it, the write, the hop to the client, the client's wake-up).

Also reported: the gateway's cyclic-GC pauses (``gc.callbacks``) and, per request, the
CPU time and run-queue wait of the gateway's and the relay's processes (``schedstat``;
on a machine shared with other work the waits include theirs: read with care).

Their sum is the client's TTFT through the gateway; the direct call of the same triple
gives the engine alone.

With ``--bursts ROUNDS``, rounds of ``--streams`` (32) streams sent at once instead,
direct and through the gateway in turn (the order alternating): the same parts, as
medians per round, and where the median request was held between its handler and its
engine call, the saturation gate's readings and closings around it (also written to
``--out``). This found the gate closed on a reading taken during the previous direct
burst, holding a whole gateway burst until the next reading. Instrumentation costs a few ``time.monotonic`` calls and one
dictionary write per request, and a line written after the request ended.
Loaded-machine figures are indicative.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any


def _gateway_child(argv: list[str]) -> int:
    """Run ``tokenpace gateway`` with timestamps (``--child CONFIG PORT OUT``)."""
    config, port, out = argv
    from uvicorn.protocols.http import httptools_impl

    from tokenpace.gateway.server import _app
    from tokenpace.gateway.server import _main
    from tokenpace.gateway.exchange import _exchange as _settle
    from tokenpace.gateway.engines import _upstream

    sink = open(out, "a", buffering=1)
    import gc

    gc_time = {"start": 0.0, "total": 0.0, "count": 0, "max": 0.0, "gen2": 0}

    def on_gc(phase: str, info: dict) -> None:  # the cyclic collector's pauses
        if phase == "start":
            gc_time["start"] = time.monotonic()
        else:
            pause = time.monotonic() - gc_time["start"]
            gc_time["total"] += pause
            gc_time["count"] += 1
            gc_time["max"] = max(gc_time["max"], pause)
            gc_time["gen2"] += info["generation"] == 2

    gc.callbacks.append(on_gc)
    stamps: dict[str, dict[str, float]] = {}
    proto = httptools_impl.HttpToolsProtocol
    data_received, on_headers_complete = proto.data_received, proto.on_headers_complete

    def traced_data_received(self, data: bytes) -> None:  # type: ignore[no-untyped-def]
        self._tp_read = time.monotonic()
        data_received(self, data)

    def traced_headers(self) -> None:  # type: ignore[no-untyped-def]
        on_headers_complete(self)
        self.scope["tp_read"] = self._tp_read

    proto.data_received, proto.on_headers_complete = traced_data_received, traced_headers
    handle = _app.handle

    async def traced_handle(rt, kind, scope, receive):  # type: ignore[no-untyped-def]
        begun = time.monotonic()
        response = await handle(rt, kind, scope, receive)
        ex = getattr(response, "ex", None)
        if ex is not None:
            stamps.setdefault(ex.id, {}).update(read=scope["tp_read"], handler=begun)
        return response

    _app.handle = traced_handle
    post = _upstream.Upstream.post

    async def traced_post(self, path, body, headers):  # type: ignore[no-untyped-def]
        stamps.setdefault(headers["x-request-id"], {})["post"] = time.monotonic()
        return await post(self, path, body, headers)

    _upstream.Upstream.post = traced_post
    finish = _settle.Exchange.finish

    def traced_finish(self, outcome, detail=None):  # type: ignore[no-untyped-def]
        if not self.finished and self.ttft_s is not None:
            row = stamps.pop(self.id, {})
            row.update(id=self.id, arrived=self.arrived, first_read=self.arrived + self.ttft_s,
                       gc_total=gc_time["total"], gc_count=gc_time["count"],
                       gc_max=gc_time["max"], gc_gen2=gc_time["gen2"])
            sink.write(json.dumps(row) + "\n")
        finish(self, outcome, detail)

    _settle.Exchange.finish = traced_finish
    _trace_gate(sink)
    return _main.main(["--config", config, "--port", port, "--log-level", "warning"])


def _trace_gate(sink: Any) -> None:
    """Rows ``{"gate": "reading" | "held", ...}``: each reading of the engine's gauges and
    each time the saturation gate starts holding requests."""
    from tokenpace.gateway.dispatch import Dispatcher
    from tokenpace.gateway.fleet import EngineSlots

    record_reading, pump = EngineSlots.record_reading, Dispatcher._pump

    def traced_reading(self, running, waiting, kv_usage):  # type: ignore[no-untyped-def]
        sink.write(json.dumps({"gate": "reading", "t": time.monotonic(), "running": running,
                               "waiting": waiting, "inflight": self.inflight}) + "\n")
        record_reading(self, running, waiting, kv_usage)

    def traced_pump(self, engine):  # type: ignore[no-untyped-def]
        was = engine.held.is_set()
        pump(self, engine)
        if engine.held.is_set() and not was:
            sink.write(json.dumps({"gate": "held", "t": time.monotonic(), "queued": len(engine.queue),
                                   "inflight": engine.inflight,
                                   "engine_waiting": engine.engine_waiting}) + "\n")

    EngineSlots.record_reading = traced_reading  # type: ignore[method-assign]
    Dispatcher._pump = traced_pump  # type: ignore[method-assign]


async def _one_stream(session: Any, url: str, path: str, prompt: str, tokens: int) -> dict:
    """One streamed completion of the bench's body: the gateway's request id, when it was
    sent and when its first token arrived."""
    from tokenpace.bench import StreamRecord, record_chunk, sse_payloads
    from tokenpace.bench.gateway import body

    record = StreamRecord(user="", start=time.monotonic())
    async with session.post(f"{url}/v1/completions", json=body(path, prompt, tokens)) as resp:
        assert resp.status == 200, await resp.read()
        rid = resp.headers.get("x-request-id")
        async for data in sse_payloads(resp.content.iter_any()):
            record_chunk(record, data, time.monotonic())
    return {"path": path, "id": rid, "start": record.start, "first": record.first}


async def _burst_rounds(urls: dict[str, str], rounds: int, streams: int, tokens: int,
                        nonce: str) -> list[dict]:
    """``rounds`` pairs of bursts, direct and gateway, the order alternating (one warm-up
    pair first); a row per request."""
    from tokenpace.bench.gateway import client_session, prompt_for

    rows: list[dict] = []
    async with client_session(streams) as session:
        def one(path: str, prompt: str) -> Awaitable[dict]:
            return _one_stream(session, urls[path], path, prompt, tokens)

        for i in range(-1, rounds):
            for path in (["direct", "gateway"] if i % 2 == 0 else ["gateway", "direct"]):
                t0 = time.monotonic()
                burst = await asyncio.gather(*[one(path, prompt_for(f"{nonce}b{i}", j))
                                               for j in range(streams)])
                if i >= 0:
                    rows += [dict(r, round=i, t0=t0) for r in burst]
    return rows


def _burst_summary(rows: list[dict], stamps: dict[str, dict], gate: list[dict],
                   rounds: int) -> dict:
    """Per round: median TTFT direct and through the gateway, and the gateway's parts."""
    parts: dict[str, list[float]] = {k: [] for k in (
        "ttft_direct", "ttft_gateway", "client_to_gateway", "uvicorn_to_handler",
        "handler_to_post", "engine_from_gateway", "relay_to_client", "last_post_after_send")}
    held = []
    for i in range(rounds):
        direct = [r for r in rows if r["round"] == i and r["path"] == "direct"]
        ours = [(r, stamps[r["id"]]) for r in rows
                if r["round"] == i and r["path"] == "gateway" and r["id"] in stamps]
        if not direct or not ours:
            continue
        t0 = ours[0][0]["t0"]
        parts["ttft_direct"].append(statistics.median(r["first"] - r["start"] for r in direct))
        parts["ttft_gateway"].append(statistics.median(r["first"] - r["start"] for r, _ in ours))
        for name, f in (("client_to_gateway", lambda r, s: s["read"] - r["start"]),
                        ("uvicorn_to_handler", lambda r, s: s["handler"] - s["read"]),
                        ("handler_to_post", lambda r, s: s["post"] - s["handler"]),
                        ("engine_from_gateway", lambda r, s: s["first_read"] - s["post"]),
                        ("relay_to_client", lambda r, s: r["first"] - s["first_read"])):
            parts[name].append(statistics.median(f(r, s) for r, s in ours))
        parts["last_post_after_send"].append(max(s["post"] for _, s in ours) - t0)
        if parts["handler_to_post"][-1] > 0.005:  # the median request waited for a slot
            near = [dict(g, at_ms=round((g["t"] - t0) * 1000, 1)) for g in gate
                    if t0 - 1.0 <= g["t"] <= t0 + 0.2]
            held.append({"round": i, "hold_ms": round(parts["handler_to_post"][-1] * 1000, 1),
                         "gate": near})
    out: dict[str, Any] = {k: {"median_ms": _median_ms(v), "rounds_ms": [round(x * 1000, 1) for x in v]}
                           for k, v in parts.items() if v}
    ratios = [g / d for g, d in zip(parts["ttft_gateway"], parts["ttft_direct"])]
    out["ttft_ratio"] = {"median": round(statistics.median(ratios), 3),
                         "rounds": [round(x, 3) for x in ratios]}
    out["rounds_held"] = held
    return out


async def _triples(urls: dict[str, str], pairs: int, tokens: int, nonce: str) -> list[dict]:
    from tokenpace.bench import pair_order
    from tokenpace.bench.gateway import client_session, prompt_for

    rows: list[dict] = []
    async with client_session(4) as session:
        def one(path: str, prompt: str) -> Awaitable[dict]:
            return _one_stream(session, urls[path], path, prompt, tokens)

        for i in range(-4, pairs):  # 4 warm-up triples
            for path in pair_order(list(urls), i % 6):
                row = await one(path, prompt_for(nonce, i))
                row["pair"] = i
                if i >= 0:
                    rows.append(row)
    return rows


def _schedstat(pid: int) -> tuple[float, float, int]:
    """Seconds on a CPU, seconds waiting on a run queue (runnable, not running) and time
    slices, summed over the process's threads (Linux ``/proc/PID/task/*/schedstat``)."""
    on_cpu = waiting = 0.0
    slices = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            run, wait, count = (task / "schedstat").read_text().split()
        except OSError:
            continue
        on_cpu, waiting, slices = on_cpu + int(run) / 1e9, waiting + int(wait) / 1e9, slices + int(count)
    return on_cpu, waiting, slices


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 3)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return _gateway_child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", default=None, help="write every row as JSON here")
    parser.add_argument("--bursts", type=int, default=0, metavar="ROUNDS",
                        help="bursts instead of sequential triples: ROUNDS direct/gateway pairs")
    parser.add_argument("--streams", type=int, default=32, help="streams per burst")
    args = parser.parse_args(argv)

    from tokenpace.bench import (
        CONTROL_PATH,
        Server,
        byte_proxy_server,
        free_port,
        start_all,
        tokenpace_serve_argv,
    )
    from tokenpace.bench.gateway import gateway_config

    home = Path(tempfile.mkdtemp(prefix="tokenpace-ttft-trace-"))
    engine_port, gateway_port = free_port(), free_port()
    engine = Server(tokenpace_serve_argv(Path(args.model), engine_port, "--trusted-gateway",
                                         "--allow-unauthenticated-trusted-gateway"),
                    engine_port, home / "engine.log")
    config = home / "gateway.yaml"
    config.write_text(gateway_config(engine.base_url, home / "gateway.db"))
    trace = home / "trace.jsonl"
    gateway = Server([sys.executable, __file__, "--child", str(config), str(gateway_port),
                      str(trace)], gateway_port, home / "gateway.log")
    relay = byte_proxy_server(engine, home)
    servers = [engine, gateway, relay]
    start_all(servers)
    urls = {"direct": engine.base_url, "gateway": gateway.base_url,
            CONTROL_PATH: relay.base_url}
    procs = {"gateway": gateway.proc.pid, "byte_proxy": relay.proc.pid}
    try:
        before = {k: _schedstat(pid) for k, pid in procs.items()}
        nonce = f"{time.time_ns():x}"
        if args.bursts:
            rows = asyncio.run(_burst_rounds(urls, args.bursts, args.streams, args.tokens, nonce))
        else:
            rows = asyncio.run(_triples(urls, args.pairs, args.tokens, nonce))
        after = {k: _schedstat(pid) for k, pid in procs.items()}
    finally:
        for srv in reversed(servers):
            srv.stop()
    traced = [json.loads(line) for line in trace.read_text().splitlines()]
    stamps = {r["id"]: r for r in traced if "gate" not in r}
    gate = [r for r in traced if "gate" in r]
    if args.bursts:
        summary = _burst_summary(rows, stamps, gate, args.bursts)
        print(json.dumps(summary, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows,
                                                  "stamps": list(stamps.values()), "gate": gate}))
        return 0
    by_pair: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_pair.setdefault(row["pair"], {})[row["path"]] = row
    parts: dict[str, list[float]] = {k: [] for k in (
        "client_to_gateway", "uvicorn_to_handler", "handler_to_post", "engine_from_gateway",
        "relay_to_client", "ttft_gateway", "ttft_direct", "ttft_byte_proxy", "added_gateway",
        "added_byte_proxy", "engine_from_gateway_minus_direct")}
    for triple in by_pair.values():
        g, d, p = triple["gateway"], triple["direct"], triple[CONTROL_PATH]
        s = stamps.get(g["id"])
        if s is None or "read" not in s or "post" not in s:
            continue
        parts["client_to_gateway"].append(s["read"] - g["start"])
        parts["uvicorn_to_handler"].append(s["handler"] - s["read"])
        parts["handler_to_post"].append(s["post"] - s["handler"])
        parts["engine_from_gateway"].append(s["first_read"] - s["post"])
        parts["relay_to_client"].append(g["first"] - s["first_read"])
        parts["ttft_gateway"].append(g["first"] - g["start"])
        parts["ttft_direct"].append(d["first"] - d["start"])
        parts["ttft_byte_proxy"].append(p["first"] - p["start"])
        parts["added_gateway"].append(parts["ttft_gateway"][-1] - parts["ttft_direct"][-1])
        parts["added_byte_proxy"].append(parts["ttft_byte_proxy"][-1] - parts["ttft_direct"][-1])
        parts["engine_from_gateway_minus_direct"].append(
            parts["engine_from_gateway"][-1] - parts["ttft_direct"][-1])
    summary = {k: _median_ms(v) for k, v in parts.items() if v}
    summary["triples"] = len(parts["ttft_gateway"])
    last = max(stamps.values(), key=lambda r: r["gc_count"], default=None)
    if last is not None:  # the gateway's cyclic-GC pauses over the run (cumulative)
        summary["gateway_gc"] = {"collections": last["gc_count"], "gen2": last["gc_gen2"],
                                 "total_ms": round(last["gc_total"] * 1000, 2),
                                 "max_pause_ms": round(last["gc_max"] * 1000, 3)}
    n = args.pairs + 4
    for name in procs:  # per request of that path (each served n, warm-up included)
        cpu, wait, slices = (a - b for a, b in zip(after[name], before[name]))
        summary[f"{name}_per_request"] = {"on_cpu_ms": round(cpu / n * 1000, 3),
                                          "runqueue_wait_ms": round(wait / n * 1000, 3),
                                          "time_slices": round(slices / n, 1)}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows,
                                              "stamps": list(stamps.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
