"""`tokenpace bench batch`: the Batch API's lines in the capacity live traffic leaves free.

One engine (``tokenpace serve`` on the tiny model, ``--max-num-seqs slots``,
``--scheduling-policy priority`` so that it also orders its own queue by the lane priority
the gateway sends) behind one gateway: the engine's ``max_inflight`` is ``slots``, lanes
``interactive`` (priority 0) and ``batch`` (priority 10), ``batch.headroom`` slots kept
for live requests. Tenants: ``live`` (interactive lane) sends live requests; ``b1``
(weight 2) and ``b2`` (weight 1) submit batches. Every request, live or a batch line, has
the same shape: an 8-token prompt (token ids), ``tokens`` output tokens, ``ignore_eos``.

Each round runs five phases, their order changing from round to round (``pair_order``):

- ``alone``: the live tenant alone: open-loop Poisson arrivals at ``rate`` requests/s of
  streamed completions for ``duration`` s; time to first token (p50, p99) of the requests
  sent after ``warmup`` s, and the requests completed per second after it;
- ``with_batch``: the same arrivals (same seed as ``alone`` in that round) while a large
  batch of ``b1`` runs (submitted first; the load starts once its lines complete); also
  the batch's output tokens/s over the counted window (its ``usage.output_tokens`` read
  from ``GET /v1/batches/{id}`` at the window's start and end);
- ``batch_alone``: a batch of ``b1`` with nobody else: its output tokens/s, read the same way;
- ``direct``: the same requests (not streamed, as batch lines are) sent straight to the
  engine by ``slots`` closed-loop clients: what the engine serves with nobody else
  (output tokens/s of the responses that end in the counted window);
- ``two_tenants``: ``b1`` and ``b2`` submit a large batch each at once: each one's output
  tokens over the counted window; ``b1``'s share (goal: its weight's, 2/3).

Every batch is larger than a phase can run (``batch_lines``; the bench checks that it was
still running at the window's end) and is cancelled after its phase; the next phase starts
once it is ``cancelled`` (its lines in flight ended), on an idle engine.

Goals (the issue's): p50 TTFT with the batch within 1.2x of alone, live requests/s
unchanged, the batch alone at >= 0.8 of direct (its ceiling is ``(slots - headroom) /
slots``: it never takes the headroom slots), ``b1``'s share by weight. Ratios are medians of
the per-round ratios with a 95% bootstrap interval (``ratio_summary``).

Where each process runs (``layout``): ``split`` (the default) starts the engine, all its
processes, on the first half of the cores and the gateway and the load on the others, as
separate machines would have them (an accelerator's engine does not compute on the
gateway's cores). ``shared`` leaves vLLM its own binding: its model on one core, its
engine-core and API-server processes beside the gateway and the load on the rest. On a
machine of two cores that measures the operating system's scheduler more than the
gateway: while the batch keeps the engine busy, its engine-core process takes most of the
second core and the gateway's event loop waits for it, runnable, for up to seconds at a
time (the engine idles meanwhile), so live requests wait seconds for their first token
without ever waiting in the gateway's queue.

Also recorded per phase, to explain the numbers (``machine``): the engine's own token
count, each core's busy fraction, the CPU of the engine's and the gateway's processes, the
fraction of the time the gateway's event loop was runnable but waiting for a core, the
live requests' wait in the gateway's queue and their time to first token as the gateway
saw it; and the live requests' time per output token (``tpot_p50_s``): on the CPU an
engine step of 16 sequences takes longer than one of 1 or 2, and a live request shares
its steps with the batch's lines, its first token too.
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

from .._process import Server, free_port, start_all, tokenpace_serve_argv
from ..up import CPU_BIND_ENV
from ._cli import add_common_args, bench_model, positive_float, positive_int, write_outputs
from ._environment import environment
from ._gateway_yaml import engine_entry, gateway_yaml, tenant_entry
from ._load import StreamRecord, percentile, stream_aiohttp
from ._paired import bootstrap_interval, pair_order, ratio_summary

PHASES = ("alone", "with_batch", "batch_alone", "direct", "two_tenants")
LAYOUTS = ("split", "shared")
PROMPT = [17, 42, 99, 7, 256, 31, 64, 128]  # the tiny model's ordinary token ids
LIVE, B1, B2 = "live", "b1", "b2"
WEIGHTS = {B1: 2.0, B2: 1.0}
KEYS = {t: f"sk-bench-{t}" for t in (LIVE, B1, B2)}
GOALS = {"ttft_p50_ratio_max": 1.2, "req_per_s_ratio_min": 0.95,
         "batch_over_direct_min": 0.8, "b1_share": round(WEIGHTS[B1] / sum(WEIGHTS.values()), 4),
         "b1_share_tolerance": 0.05}
WAIT_S = 180.0  # at most this long for a batch to start running, or to end cancelled


def _gateway_config(engine_url: str, slots: int, headroom: int, ledger: Path,
                    lanes: bool = True) -> str:
    """With the engine's lanes, ``max_inflight`` is twice ``slots`` (the places the engine
    holds batch lines in): live requests go past the batch lines, which still take at most
    ``slots - headroom`` (``max_num_seqs``: ``Dispatcher.spare``)."""
    return gateway_yaml(
        [engine_entry(engine_url, 2 * slots if lanes else slots, models=["tiny"],
                      max_num_seqs=slots, scheduling_policy="priority")],
        [tenant_entry(LIVE, KEYS[LIVE], lane="interactive", queue_timeout="10m")]
        + [tenant_entry(t, KEYS[t], lane="batch", weight=w, queue_timeout="10m")
           for t, w in WEIGHTS.items()],
        ledger,
        lanes=[{"name": "interactive", "priority": 0}, {"name": "batch", "priority": 10}],
        metrics_cache=0,  # counters read after the run: never a cached page
        batch={"lane": "batch", "headroom": headroom},
    )


def _auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


def _lines(n: int, tokens: int, tag: str) -> bytes:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True}
    return "".join(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST",
                               "url": "/v1/completions", "body": body}) + "\n"
                   for i in range(n)).encode()


class _Batches:
    """The gateway's Batch API, as the tenants call it."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def _json(self, method: str, path: str, tenant: str, **kw: Any) -> dict[str, Any]:
        async with self.session.request(method, f"{self.url}{path}", headers=_auth(tenant),
                                        **kw) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{method} {path}: HTTP {resp.status}: "
                                   f"{(await resp.read())[:300]!r}")
            return dict(await resp.json())

    async def upload(self, tenant: str, content: bytes) -> str:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename="input.jsonl",
                       content_type="application/jsonl")
        return str((await self._json("POST", "/v1/files", tenant, data=form))["id"])

    async def create(self, tenant: str, file_id: str) -> str:
        return str((await self._json("POST", "/v1/batches", tenant, json={
            "input_file_id": file_id, "endpoint": "/v1/completions",
            "completion_window": "24h"}))["id"])

    async def get(self, tenant: str, batch_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/batches/{batch_id}", tenant)

    async def sample(self, tenant: str, batch_id: str) -> dict[str, Any]:
        """The batch's output tokens so far, timed at the middle of the call."""
        before = time.monotonic()
        batch = await self.get(tenant, batch_id)
        return {"t": (before + time.monotonic()) / 2, "status": batch["status"],
                "output_tokens": batch["usage"]["output_tokens"],
                "completed": batch["request_counts"]["completed"],
                "failed": batch["request_counts"]["failed"],
                "total": batch["request_counts"]["total"]}

    async def wait(self, tenant: str, batch_id: str, statuses: tuple[str, ...],
                   min_completed: int = 0) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        while True:
            batch = await self.get(tenant, batch_id)
            if batch["status"] in statuses \
                    and batch["request_counts"]["completed"] >= min_completed:
                return batch
            if batch["status"] in ("failed", "expired", "completed", "cancelled") \
                    and batch["status"] not in statuses:
                raise RuntimeError(f"batch {batch_id} of {tenant} ended {batch['status']}: "
                                   f"{batch.get('errors')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch_id} of {tenant} still {batch['status']} "
                                   f"({batch['request_counts']}) after {WAIT_S:.0f} s")
            await asyncio.sleep(0.1)

    async def start(self, jobs: list[tuple[str, bytes]]) -> list[str]:
        """Upload every file, then create the batches at once; return once each one's
        lines run (a line of each completed)."""
        files = [await self.upload(tenant, content) for tenant, content in jobs]
        ids = await asyncio.gather(*(self.create(tenant, f)
                                     for (tenant, _), f in zip(jobs, files)))
        for (tenant, _), batch_id in zip(jobs, ids):
            await self.wait(tenant, batch_id, ("in_progress",), min_completed=1)
        return list(ids)

    async def cancel(self, tenant: str, batch_id: str) -> dict[str, Any]:
        """Cancel and wait until it is cancelled (its lines in flight ended); a batch that
        completed first is left as it is (``outlasted_window`` then says so)."""
        if (await self.get(tenant, batch_id))["status"] in ("validating", "in_progress"):
            async with self.session.post(f"{self.url}/v1/batches/{batch_id}/cancel",
                                         headers=_auth(tenant)) as resp:
                await resp.read()  # a 400: it finished meanwhile (the wait tells)
        return await self.wait(tenant, batch_id, ("cancelled", "completed"))


def _arrivals(rate: float, duration: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _live(url: str, t0: float, arrivals: list[float], duration: float, warmup: float,
                tokens: int) -> dict[str, Any]:
    """Open-loop streamed requests of the live tenant sent at ``t0 + arrivals``."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    records: list[StreamRecord] = []
    errors: list[str] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout, headers=_auth(LIVE)) as session:

        async def one(offset: float) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            try:
                records.append(await stream_aiohttp(session, url, body, LIVE))
            except Exception as exc:  # counted and reported, not fatal
                errors.append(f"{type(exc).__name__}: {exc}"[:300])

        await asyncio.wait_for(asyncio.gather(*(one(a) for a in arrivals)),
                               timeout=duration + WAIT_S)
    start, end = t0 + warmup, t0 + duration
    counted = [r for r in records if start <= r.start < end and r.token_times]
    ttfts = [r.ttft for r in counted]
    tpots = [(r.last - r.first) / (len(r.token_times) - 1)
             for r in counted if len(r.token_times) > 1]
    done = sum(1 for r in records if r.token_times and start <= r.last < end)
    short = sum(1 for r in counted if len(r.token_times) < tokens)
    return {"ttft_p50_s": round(percentile(ttfts, 50), 4) if ttfts else None,
            "ttft_p99_s": round(percentile(ttfts, 99), 4) if ttfts else None,
            "tpot_p50_s": round(statistics.median(tpots), 5) if tpots else None,
            "req_per_s": round(done / (duration - warmup), 3),
            "requests": len(counted), "sent": len(arrivals), "errors": len(errors),
            "short_answers": short, "error_examples": errors[:3]}


async def _direct(url: str, t0: float, streams: int, duration: float, warmup: float,
                  tokens: int) -> dict[str, Any]:
    """``streams`` closed-loop clients sending the batch lines' request to the engine."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True}
    ends: list[tuple[float, int]] = []
    deadline = t0 + duration
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:

        async def client() -> None:
            while time.monotonic() < deadline:
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
                    answer = await resp.json()
                ends.append((time.monotonic(), int(answer["usage"]["completion_tokens"])))

        await asyncio.gather(*(client() for _ in range(streams)))
    counted = [n for t, n in ends if t0 + warmup <= t < deadline]
    return {"output_tokens_per_s": round(sum(counted) / (duration - warmup), 1),
            "requests": len(counted)}


_GENERATED = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", re.M)
def _live_series(name: str, suffix: str) -> re.Pattern[str]:
    return re.compile(rf'^tokenpace_gateway_{name}_{suffix}\{{[^}}]*tenant="{LIVE}"[^}}]*\}} '
                      r'(\S+)$', re.M)


_LIVE_SERIES = {  # the live tenant's wait in the gateway (admission to dispatch) and its
    # time to first token as the gateway saw it (arrival to the first token it relayed)
    "queue_sum": _live_series("queue_seconds", "sum"),
    "queue_count": _live_series("queue_seconds", "count"),
    "queue_le_10ms": _live_series("queue_seconds", r'bucket(?=\{[^}]*le="0\.01")'),
    "ttft_sum": _live_series("time_to_first_token_seconds", "sum"),
    "ttft_count": _live_series("time_to_first_token_seconds", "count")}


def _cores() -> list[tuple[int, int]]:
    """(busy, total) jiffies of each core, from /proc/stat (Linux)."""
    out = []
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                v = [int(x) for x in line.split()[1:]]
                idle = v[3] + (v[4] if len(v) > 4 else 0)
                out.append((sum(v[:8]) - idle, sum(v[:8])))
    return out


def _runnable_wait_s(pid: int) -> float:
    """Seconds the process's main thread (the gateway's event loop) has spent ready to run
    but waiting for a core (``/proc/PID/schedstat``, Linux)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class _Probe:
    """What the machine did over a window, beside what the clients saw: the engine's own
    count of generated tokens (``vllm:generation_tokens_total``: checks the batch's usage
    and the direct clients' count), each core's busy fraction and the CPU (in cores) of
    the engine's processes and of the gateway's."""

    def __init__(self, engine: Server, gateway: Server) -> None:
        self.engine, self.gateway = engine, gateway

    async def snap(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(f"{self.engine.base_url}/metrics") as resp:
            text = await resp.text()
        async with session.get(f"{self.gateway.base_url}/metrics") as resp:
            gateway = await resp.text()
        live = {kind: sum(float(v) for v in pattern.findall(gateway))
                for kind, pattern in _LIVE_SERIES.items()}
        return {"t": time.monotonic(), "cores": _cores(),
                "generated": sum(float(v) for v in _GENERATED.findall(text)),
                "engine_cpu": self.engine.cpu_seconds(),
                "gateway_cpu": self.gateway.cpu_seconds(), "live": live,
                "gateway_loop_wait": _runnable_wait_s(self.gateway.proc.pid)}

    @staticmethod
    def between(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        span = b["t"] - a["t"]
        live = {k: b["live"][k] - a["live"][k] for k in _LIVE_SERIES}
        n, m = live["queue_count"], live["ttft_count"]
        return {"engine_output_tokens_per_s": round((b["generated"] - a["generated"]) / span, 1),
                "cores_busy": [round((bb - ab) / max(1, bt - at), 3)
                               for (ab, at), (bb, bt) in zip(a["cores"], b["cores"])],
                "engine_cores": round((b["engine_cpu"] - a["engine_cpu"]) / span, 3),
                "gateway_cores": round((b["gateway_cpu"] - a["gateway_cpu"]) / span, 3),
                "live_queue_mean_s": round(live["queue_sum"] / n, 4) if n else None,
                "live_queued_over_10ms": round(1 - live["queue_le_10ms"] / n, 3) if n else None,
                "live_gateway_ttft_mean_s": round(live["ttft_sum"] / m, 4) if m else None,
                "gateway_loop_waiting_for_cpu": round(
                    (b["gateway_loop_wait"] - a["gateway_loop_wait"]) / span, 3)}


def _rate(first: dict[str, Any], last: dict[str, Any]) -> float:
    return (last["output_tokens"] - first["output_tokens"]) / (last["t"] - first["t"])


def _still_running(sample: dict[str, Any]) -> bool:
    return sample["status"] == "in_progress" and sample["completed"] < sample["total"]


async def _window(probe: _Probe, api: _Batches | None, batches: list[tuple[str, str]],
                  t0: float, duration: float, warmup: float
                  ) -> tuple[dict[str, Any], list[tuple[dict[str, Any], dict[str, Any]]]]:
    """The machine over ``[t0 + warmup, t0 + duration]``, and each batch's samples at
    both ends."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.sleep(max(0.0, t0 + warmup - time.monotonic()))
        machine = await probe.snap(session)
        first = await asyncio.gather(*(api.sample(t, b) for t, b in batches)) if api else []
        await asyncio.sleep(max(0.0, t0 + duration - time.monotonic()))
        machine_end = await probe.snap(session)
        last = await asyncio.gather(*(api.sample(t, b) for t, b in batches)) if api else []
    return probe.between(machine, machine_end), list(zip(first, last))


def _batch_entry(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    return {"output_tokens_per_s": round(_rate(first, last), 1),
            "output_tokens": last["output_tokens"] - first["output_tokens"],
            "lines": last["completed"] - first["completed"],
            "failed_lines": last["failed"],
            "window_s": round(last["t"] - first["t"], 3),
            "outlasted_window": _still_running(last)}


async def _phase(name: str, round_index: int, probe: _Probe, p: dict[str, Any]) -> dict[str, Any]:
    duration, warmup, tokens = p["duration_s"], p["warmup_s"], p["max_tokens"]
    gateway, engine = probe.gateway.base_url, probe.engine.base_url
    arrivals = _arrivals(p["rate"], duration, seed=round_index)
    if name in ("alone", "direct"):
        t0 = time.monotonic()
        load = (_live(gateway, t0, arrivals, duration, warmup, tokens) if name == "alone"
                else _direct(engine, t0, p["slots"], duration, warmup, tokens))
        result, (machine, _) = await asyncio.gather(
            load, _window(probe, None, [], t0, duration, warmup))
        return {**result, "machine": machine}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        api = _Batches(session, gateway)
        tenants = [B1, B2] if name == "two_tenants" else [B1]
        ids = await api.start([(t, _lines(p["batch_lines"], tokens, f"r{round_index}-{t}"))
                               for t in tenants])
        batches = list(zip(tenants, ids))
        try:
            t0 = time.monotonic()
            if name == "with_batch":
                live, (machine, windows) = await asyncio.gather(
                    _live(gateway, t0, arrivals, duration, warmup, tokens),
                    _window(probe, api, batches, t0, duration, warmup))
                return {**live, "batch": _batch_entry(*windows[0]), "machine": machine}
            machine, windows = await _window(probe, api, batches, t0, duration, warmup)
        finally:
            await asyncio.gather(*(api.cancel(t, b) for t, b in batches))
    entries = {t: _batch_entry(*w) for t, w in zip(tenants, windows)}
    if name == "batch_alone":
        return {**entries[B1], "machine": machine}
    total = sum(e["output_tokens"] for e in entries.values())
    share = round(entries[B1]["output_tokens"] / total, 4) if total else None
    return {**entries, "b1_share": share,
            "output_tokens_per_s": round(sum(e["output_tokens_per_s"]
                                             for e in entries.values()), 1),
            "machine": machine}


async def _warm(gateway: str, engine: str, p: dict[str, Any]) -> None:
    """A fresh engine's first batch sizes are slow, and the gateway's store is created on
    first use: a few seconds of each kind of work, not counted."""
    await _direct(engine, time.monotonic(), p["slots"], 3.0, 0.0, p["max_tokens"])
    await _live(gateway, time.monotonic(), _arrivals(p["rate"], 2.0, seed=-1), 2.0, 0.0,
                p["max_tokens"])
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        api = _Batches(session, gateway)
        for tenant in WEIGHTS:
            file_id = await api.upload(tenant, _lines(2 * p["slots"], p["max_tokens"],
                                                      f"warm-{tenant}"))
            await api.wait(tenant, await api.create(tenant, file_id), ("completed",))


def split_cpus(cpus: list[int]) -> tuple[list[int], list[int]]:
    """The engine's cores and the gateway's and the load's (``layout: split``): the first
    half and the rest (one each on a machine of two)."""
    half = max(1, len(cpus) // 2)
    return cpus[:half], cpus[half:]


def run(model: Path, duration: float = 20.0, warmup: float = 4.0, rounds: int = 3,
        rate: float = 4.0, max_tokens: int = 32, slots: int = 16, headroom: int = 1,
        batch_lines: int = 4000, layout: str = "split",
        workdir: Path | None = None, lanes: bool = True) -> dict[str, Any]:
    """``layout``: ``split`` runs the engine (all its processes) on half of the cores and
    the gateway and the load on the other half, as separate machines would; ``shared``
    leaves the engine vLLM's own binding (its model on one core, its other processes
    beside the gateway and the load on the rest). ``lanes``: the engine holds batch lines
    for live requests (tokenpace's lanes, ``slots`` more places to hold them in); False:
    vLLM's own priority scheduling (``--no-lanes``)."""
    if not 0 < warmup < duration:
        raise ValueError("warmup must be above 0 and below duration")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: one of {', '.join(LAYOUTS)}, got {layout!r}")
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-batch-"))
    own = sorted(os.sched_getaffinity(0))
    if layout == "split" and len(own) < 2:
        raise ValueError("layout split needs two cores or more")
    engine_cpus, rest_cpus = split_cpus(own) if layout == "split" else (own, own)
    engine_port, gateway_port = free_port(), free_port()
    started = time.monotonic()
    # Processes inherit the affinity of the one that starts them: the engine is started
    # from the engine's cores, everything after it from the rest.
    servers: list[Server] = []
    os.sched_setaffinity(0, engine_cpus)
    try:
        engine = Server(tokenpace_serve_argv(model, engine_port, "--max-num-seqs", str(slots),
                                             "--scheduling-policy", "priority",
                                             *(() if lanes else ("--no-lanes",))),
                        engine_port, home / "engine.log",
                        env={CPU_BIND_ENV: ",".join(map(str, engine_cpus))}
                        if layout == "split" else None)
        servers.append(engine)
        os.sched_setaffinity(0, rest_cpus)
        config = home / "gateway.yaml"
        config.write_text(_gateway_config(engine.base_url, slots, headroom, home / "usage.db",
                                          lanes))
        gateway = Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config",
                          str(config), "--port", str(gateway_port), "--log-level", "warning"],
                         gateway_port, home / "gateway.log")
        servers.append(gateway)
    except BaseException:
        for server in servers:
            server.stop()
        os.sched_setaffinity(0, own)
        raise
    params: dict[str, Any] = {
        "duration_s": duration, "warmup_s": warmup, "rounds": rounds, "rate": rate,
        "max_tokens": max_tokens, "prompt_tokens": len(PROMPT), "slots": slots,
        "headroom": headroom, "batch_lines": batch_lines, "weights": WEIGHTS,
        "engines": "1 x tiny (--scheduling-policy priority"
                   + (", lanes: 2 x slots held)" if lanes else ", --no-lanes)"),
        "engine_lanes": lanes,
        "lanes": {"interactive": 0, "batch": 10}, "layout": layout,
        "engine_cpus": engine_cpus, "gateway_and_load_cpus": rest_cpus}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in PHASES}
    try:
        start_all([engine, gateway])
        asyncio.run(_warm(gateway.base_url, engine.base_url, params))
        probe = _Probe(engine, gateway)
        for i in range(rounds):
            for name in pair_order(list(PHASES), i):
                runs[name].append(asyncio.run(_phase(name, i, probe, params)))
                print(f"round {i + 1} {name}: {runs[name][-1]}", flush=True)
    finally:
        for server in (gateway, engine):
            server.stop()
        os.sched_setaffinity(0, own)
    result = {"benchmark": "batch", "parameters": params,
              **summarize(runs, slots, headroom),
              "wall_s": round(time.monotonic() - started, 1), **environment()}
    _print(result)
    print(f"logs and databases in {home}")
    return result


def summarize(runs: dict[str, list[dict[str, Any]]], slots: int,
              headroom: int) -> dict[str, Any]:
    """Medians per phase, the paired ratios and the share (pure: tested on made-up runs)."""
    def values(phase: str, key: str) -> list[float]:
        return [r[key] for r in runs[phase]]

    live = {phase: {key: values(phase, key) for key in
                    ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "req_per_s", "requests",
                     "errors")} for phase in ("alone", "with_batch")}
    batch_rate = {"batch_alone": values("batch_alone", "output_tokens_per_s"),
                  "direct": values("direct", "output_tokens_per_s"),
                  "with_batch": [r["batch"]["output_tokens_per_s"] for r in runs["with_batch"]],
                  "two_tenants": values("two_tenants", "output_tokens_per_s")}
    shares = [r["b1_share"] for r in runs["two_tenants"] if r["b1_share"] is not None]
    low, high = bootstrap_interval(shares, statistics.median) if shares else (None, None)
    ratios = {key: ratio_summary(live["with_batch"][key], live["alone"][key])
              for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "req_per_s")}
    over_direct = ratio_summary(batch_rate["batch_alone"], batch_rate["direct"])
    share = {"median": round(statistics.median(shares), 4) if shares else None,
             "interval95": [round(low, 4), round(high, 4)] if shares else None,
             "values": shares, "expected": GOALS["b1_share"]}
    machine = {phase: {key: [r["machine"][key] for r in runs[phase]]
                       for key in runs[phase][0]["machine"]} for phase in PHASES}
    outlasted = all(r["outlasted_window"] for r in runs["batch_alone"]) \
        and all(r["batch"]["outlasted_window"] for r in runs["with_batch"]) \
        and all(r[t]["outlasted_window"] for r in runs["two_tenants"] for t in WEIGHTS)
    return {
        "phases": {
            "live": live,
            "batch_output_tokens_per_s": batch_rate,
            "medians": {
                **{f"{phase}.{k}": statistics.median(v) for phase, m in live.items()
                   for k, v in m.items() if v and None not in v},
                **{f"{k}.output_tokens_per_s": statistics.median(v)
                   for k, v in batch_rate.items() if v}}},
        "with_batch_over_alone": ratios,
        "batch_alone_over_direct": over_direct,
        "batch_ceiling": round((slots - headroom) / slots, 4),
        "batch_alone_over_direct_engine_count": ratio_summary(
            machine["batch_alone"]["engine_output_tokens_per_s"],
            machine["direct"]["engine_output_tokens_per_s"]),
        "machine": machine,
        "with_batch_batch_over_batch_alone": ratio_summary(batch_rate["with_batch"],
                                                           batch_rate["batch_alone"]),
        "two_tenants_b1_share": share,
        "every_batch_outlasted_its_window": outlasted,
        "goals": {**GOALS, "met": {
            "ttft_p50": ratios["ttft_p50_s"]["median"] <= GOALS["ttft_p50_ratio_max"],
            "req_per_s": ratios["req_per_s"]["median"] >= GOALS["req_per_s_ratio_min"],
            "batch_over_direct": over_direct["median"] >= GOALS["batch_over_direct_min"],
            "b1_share": share["median"] is not None and abs(share["median"] - GOALS["b1_share"])
            <= GOALS["b1_share_tolerance"]}},
        "runs": runs,
    }


def _print(result: dict[str, Any]) -> None:
    live = result["phases"]["live"]
    for phase in ("alone", "with_batch"):
        m = live[phase]
        print(f"{phase:>11} (per round): TTFT p50 {m['ttft_p50_s']} s, p99 {m['ttft_p99_s']} s, "
              f"time per token p50 {m['tpot_p50_s']} s, req/s {m['req_per_s']}, "
              f"errors {m['errors']}")
    for key, summary in result["with_batch_over_alone"].items():
        print(f"with_batch / alone {key}: {summary['median']} {summary['interval95']}")
    rates = result["phases"]["batch_output_tokens_per_s"]
    print(f"batch output tokens/s: {rates}")
    summary = result["batch_alone_over_direct"]
    print(f"batch alone / direct: {summary['median']} {summary['interval95']} "
          f"(ceiling {result['batch_ceiling']}: the headroom is never used by lines)")
    summary = result["batch_alone_over_direct_engine_count"]
    print(f"batch alone / direct, the engine's own token count: {summary['median']} "
          f"{summary['interval95']}")
    for phase, m in result["machine"].items():
        print(f"{phase:>11} (per round): engine tokens/s {m['engine_output_tokens_per_s']}, "
              f"cores busy {m['cores_busy']}, engine cores {m['engine_cores']}, "
              f"gateway cores {m['gateway_cores']}")
    for phase in ("alone", "with_batch"):
        m = result["machine"][phase]
        print(f"{phase:>11} (per round): live requests' mean wait in the gateway "
              f"{m['live_queue_mean_s']} s, fraction that waited over 10 ms "
              f"{m['live_queued_over_10ms']}, mean TTFT at the gateway "
              f"{m['live_gateway_ttft_mean_s']} s")
    for phase, m in result["machine"].items():
        print(f"{phase:>11} (per round): the gateway's event loop waiting for a core "
              f"{m['gateway_loop_waiting_for_cpu']} of the time")
    share = result["two_tenants_b1_share"]
    print(f"two tenants, b1's share (weight 2 of 3): {share['median']} {share['interval95']} "
          f"({share['values']})")
    print(f"every batch outlasted its window: {result['every_batch_outlasted_its_window']}")
    print(f"goals met: {result['goals']['met']}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    live = result["phases"]["live"]
    phases = ("alone", "with_batch")
    for ax, key, title in ((axes[0], "ttft_p50_s", "live TTFT p50 (s)"),
                           (axes[1], "ttft_p99_s", "live TTFT p99 (s)")):
        for x, phase in enumerate(phases):
            ax.scatter([x] * len(live[phase][key]), live[phase][key], color="gray", s=12)
            ax.bar(x, statistics.median(live[phase][key]), alpha=0.6)
        ax.set_xticks(range(len(phases)), phases)
        ax.set_title(title)
    rates = result["phases"]["batch_output_tokens_per_s"]
    names = ("direct", "batch_alone", "with_batch", "two_tenants")
    axes[2].bar(range(len(names)), [statistics.median(rates[n]) for n in names], alpha=0.6)
    for x, n in enumerate(names):
        axes[2].scatter([x] * len(rates[n]), rates[n], color="gray", s=12)
    axes[2].set_xticks(range(len(names)), ["direct", "batch\nalone", "batch with\nlive",
                                            "two\nbatches"])
    axes[2].set_title("output tokens/s (batch / engine)")
    share = result["two_tenants_b1_share"]
    rounds = range(1, len(share["values"]) + 1)
    axes[3].scatter(rounds, share["values"], label="b1 per round")
    axes[3].set_xticks(list(rounds))
    axes[3].axhline(share["expected"], color="red", linestyle="--", label="weight 2/3")
    axes[3].set_ylim(0, 1)
    axes[3].set_xlabel("round")
    axes[3].set_title("b1's share of two batches")
    axes[3].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "One engine on the tiny model (--max-num-seqs 16, priority scheduling) behind one "
        "gateway (lanes interactive and batch, batch.headroom 1). In rounds, the order of the "
        "phases changing: a live tenant's open-loop Poisson requests alone and while a large "
        "batch runs (time to first token p50 and p99, requests/s; goals: p50 within 1.2x, "
        "requests/s unchanged); a batch alone against the same requests sent straight to the "
        "engine by 16 clients (output tokens/s; goal >= 0.8); two tenants' batches at once, "
        "weights 2 and 1 (goal: shares 2/3 and 1/3). The engine runs on half of the cores, "
        "the gateway and the load on the others (--layout).")
    add_common_args(parser)
    parser.add_argument("--duration", type=positive_float, default=20.0,
                        help="seconds per phase and round (default 20)")
    parser.add_argument("--warmup", type=positive_float, default=4.0,
                        help="first seconds of a phase left uncounted (default 4)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="rounds, the order of the phases changing (default 3)")
    parser.add_argument("--rate", type=positive_float, default=4.0,
                        help="the live tenant's Poisson arrivals, requests/s (default 4)")
    parser.add_argument("--tokens", type=positive_int, default=32,
                        help="output tokens per request, live and batch line (default 32)")
    parser.add_argument("--headroom", type=int, default=1,
                        help="batch.headroom: of the engine's 16 slots, those batch lines never "
                        "take (default 1)")
    parser.add_argument("--layout", choices=LAYOUTS, default="split",
                        help="split: the engine on half of the cores, the gateway and the load "
                        "on the others, as on separate machines (default); shared: vLLM's own "
                        "binding, its processes beside the gateway's on the same cores (on 2 "
                        "cores the busy engine then keeps the gateway waiting for a core)")
    parser.add_argument("--lanes", choices=("on", "off"), default="on",
                        help="on: the engine holds batch lines for live requests (tokenpace's "
                        "lanes, default); off: vLLM's own priority scheduling (--no-lanes)")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        result = run(bench_model(args), duration=8.0, warmup=2.0, rounds=1, rate=args.rate,
                     max_tokens=args.tokens, batch_lines=1500, headroom=args.headroom,
                     layout=args.layout, lanes=args.lanes == "on")
    else:
        if args.warmup >= args.duration:
            raise SystemExit("tokenpace bench batch: error: --warmup must be below --duration")
        result = run(bench_model(args), args.duration, args.warmup, args.rounds, args.rate,
                     args.tokens, headroom=args.headroom, layout=args.layout,
                     lanes=args.lanes == "on")
    return write_outputs(args, result, plot)
