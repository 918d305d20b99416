"""`tokenpace bench gateway`: what the gateway adds, measured against the engine direct.

One engine (``tokenpace serve --trusted-gateway``, nobody paced) and one gateway in front of
it, all figures from one run. Both paths send the engine the same work: the same body
(prompt, ``temperature`` 0, the tenant's identity as the gateway writes it, usage in every
chunk, which is what the gateway asks the engine for anyway), a salt of the same length
(the gateway's per-tenant ``cache_salt``, a fixed one direct) and a prompt of their own per
pair, so neither call finds the other's prefix in the engine's cache. Greedy decoding
makes the two answers of a pair identical; the run counts the pairs where they are.
Time to first token is the same on both paths: from just before the request is sent to
the first chunk that carries a generated token id.

- latency: sequential streamed completions in pairs (direct and gateway, the order
  alternating from pair to pair, ``pair_order``); what the gateway adds is the per-pair
  difference, its median and 99th percentile with bootstrap intervals over pairs (``_paired``): the
  engine's own latency moves in phases on a busy machine, which independent medians of
  the two paths would measure instead of the gateway;
- burst and throughput: ``streams`` streams sent at once, direct and through the gateway
  in alternating pairs of rounds with the same prompts; per pair the ratio gateway/direct
  of the median time to first token and of the output tokens per second; reported as
  the median ratio over pairs with its bootstrap interval; and the gateway's own view of
  its rounds from its ledger (how long it held each request before dispatch, and its TTFT
  from arrival), which tells a burst held in the gateway from a slow engine;
- gateway CPU per request (sequential non-streamed 1-token requests through the gateway
  alone; this includes the background health and gauge polls that run meanwhile, so it is
  also given against the fast upstream below, where they are negligible) and per streamed
  chunk (the gateway's CPU during its own burst rounds over the chunks it relayed:
  gross, and net of the requests' share): process CPU time of the gateway only, in phases
  where only the gateway is called;
- requests per second at 100% of one core: a second gateway in front of an upstream that
  answers from canned bytes (``_fast_upstream``, its own process), so the gateway is the
  limit; requests per gateway CPU-second;
- with ``control="byte-proxy"``, one more path in every pair and burst pair: the engine
  behind a byte relay in its own process (``_control``), which tells what any second
  process on the path costs this machine from what the gateway's own work costs.

With ``state="redis"`` (``--state redis``) the run has a third path: the same gateway
configured with ``state`` in a Redis (a ``redis-server`` started for the run, or
``--redis URL``), and its own twin in front of the fast upstream. Every pair then holds
three calls (``pair_order`` cycles through their 6 orders), so the in-process and the Redis
gateway meet the same engine phases; the Redis gateway's figures carry the same names
under ``redis``, beside what Redis adds to the in-process gateway pair by pair and the
Redis server's own CPU time and commands per request and per chunk (``INFO``, read
around the Redis gateway's phases only), which the gateway process's CPU does not include.
The tenant has no budget, so a request costs the Redis gateway two store calls (take the
slots; release them, after the response) and batched fair-queue charges.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import closing
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
from ..gateway.state import StateConfig
from . import _control, _fast_upstream as fast_upstream
from ._cli import add_common_args, bench_model, positive_int, write_outputs
from ._environment import environment
from ._gateway_yaml import engine_entry, gateway_yaml, tenant_entry
from ._load import StreamRecord, async_client, percentile, stream_aiohttp
from ._paired import difference_summary, pair_order, paired_differences, ratio_summary, run_pairs
from ._redis_server import RedisServer, Usage, redis_server_binary
from .overhead import median_interval

KEY = "sk-bench"
SALT_KEY = "sk-bench-redis-salt"
"""A second key of the Redis gateway's tenant, never sent: it changes the tenant's salt."""
TENANT = "bench"
DIRECT_SALT = hashlib.sha256(b"tokenpace-bench-direct").hexdigest()
"""The direct path's ``cache_salt``: as long as the gateway's per-tenant salt (64 hex
digits), and different from it, so the engine hashes the same amount and neither path
reuses the other's cached prefix."""
CPU_ROUNDS = 3
CPU_MIN_REQUESTS = 60  # a CPU phase spans several 10 ms ticks of the process clock
# (fewer, such as the quick run's 10 requests, can read 0)
REDIS_PATH = "gateway_redis"
"""The path of the gateway with ``state`` in Redis (``--state redis``)."""
SETTLE_S = 0.05
"""How long after the Redis gateway's last response its CPU and Redis's counters are read:
it gives the slots back after each response (a store call off the request's path), and
the last ones would otherwise fall outside the reading."""
STATE_TIMEOUT = "2s"
"""The Redis gateway's ``state.timeout``: generous, so that a stall of the loaded machine
costs time in the figures rather than a 503 that aborts the run (the default, 100 ms,
bounds only how long a request may wait; it costs nothing while Redis answers)."""
STATE_RETRIES = 5
"""Retries of a request refused with ``state_unavailable`` in the CPU rounds
(``plain_requests``)."""
_WORDS = ("river", "stone", "lamp", "orbit", "maple", "quartz", "harbor", "cedar", "ember",
          "violet", "tundra", "signal", "meadow", "copper", "lantern", "glacier")


def gateway_config(engine_url: str, ledger: Path, state_url: str | None = None) -> str:
    """The gateway under test; with ``state_url`` the same one keeping its state in Redis.

    The Redis gateway's tenant also holds ``SALT_KEY``, which no call uses: the tenant's
    ``cache_salt`` is derived from its keys, so the two gateways salt the same prompt
    differently and neither finds the other's blocks in the engine's cache (the client
    and the identity the gateways write are the same).
    """
    keys = (KEY, SALT_KEY) if state_url else (KEY,)
    state = {"state": {"url": state_url, "timeout": STATE_TIMEOUT}} if state_url else {}
    return gateway_yaml([engine_entry(engine_url, 256, reserved_slots=None)],
                        [tenant_entry(TENANT, *keys)], ledger, **state)


def prompt_for(nonce: str, index: int, words: int = 24) -> str:
    """A prompt of its own for each pair (or stream): its first words differ from every
    other's, so no prompt finds another's prefix in the engine's cache."""
    rng = random.Random(f"{nonce}/{index}")
    return f"{nonce} {index}: " + " ".join(rng.choice(_WORDS) for _ in range(words))


def work(path: str) -> dict[str, object]:
    """The fields that make a plain streamed completion the gateway's work, for ``path``.

    The gateway overwrites identity and priority with the same values and adds its
    tenant's salt; the direct call carries them itself, so the engine gets the same work.
    """
    fields: dict[str, object] = {
        "temperature": 0, "priority": 0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if path == "direct":
        fields["cache_salt"] = DIRECT_SALT
    elif path == _control.PATH:
        fields["cache_salt"] = _control.SALT
    return fields


def body(path: str, prompt: str, tokens: int) -> dict[str, object]:
    """One streamed completion of ``tokens`` tokens for ``path``: the same on both paths
    but the salt (``work``)."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "return_token_ids": True,
            "vllm_xargs": {"output_rate_user": TENANT}, **work(path)}


def client_session(connections: int) -> aiohttp.ClientSession:
    """The load generator's client: keep-alive connections for both paths (the gateway
    keeps its own to the engine), created once and warmed up before anything is timed."""
    return aiohttp.ClientSession(
        # Idle connections are dropped after 4 s, before vLLM's server closes them (5 s):
        # a connection reused just as the engine closes it fails its request (a byte
        # proxy's arm met this once in a burst round on a loaded machine).
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=connections,
                                       keepalive_timeout=4),
        timeout=aiohttp.ClientTimeout(total=600), headers={"authorization": f"Bearer {KEY}"})


async def _sequential(urls: dict[str, str], pairs: int, tokens: int,
                      nonce: str) -> dict[str, list[StreamRecord]]:
    """Pairs of sequential streamed completions, one prompt per pair, after 4 warm-up pairs."""
    async with client_session(4) as session:
        def call(path: str, tag: str) -> Callable[[int], Awaitable[StreamRecord]]:
            async def one(i: int) -> StreamRecord:
                return await stream_aiohttp(session, urls[path],
                                            body(path, prompt_for(tag, i), tokens))
            return one

        await run_pairs({path: call(path, f"{nonce}w") for path in urls}, 4)
        return await run_pairs({path: call(path, nonce) for path in urls}, pairs)


async def _burst(session: aiohttp.ClientSession, url: str, path: str, streams: int, tokens: int,
                 nonce: str) -> tuple[float, list[StreamRecord]]:
    """Output tokens per second of ``streams`` streams sent at once, and their records."""
    t0 = time.monotonic()
    records = await asyncio.gather(*[
        stream_aiohttp(session, url, body(path, prompt_for(nonce, j), tokens))
        for j in range(streams)])
    elapsed = time.monotonic() - t0
    return sum(len(r.token_times) for r in records) / elapsed, list(records)


@dataclass
class _Bursts:
    """Per path, one entry per burst round (pair order); gateway figures per gateway path."""

    rates: dict[str, list[float]]
    ttft: dict[str, list[float]]
    cpu_gross: dict[str, list[tuple[float, int]]]
    """Gateway CPU seconds and chunks relayed, per round of that gateway."""
    windows: dict[str, list[tuple[float, float]]]
    """Wall-clock span of each round of that gateway (to find its requests in its ledger)."""
    store: list[tuple[Usage, int]] = field(default_factory=list)
    """What Redis did and the chunks relayed, per round of the Redis gateway."""
    client_cpu: list[float] = field(default_factory=list)
    """The load generator's own CPU seconds per round (all paths, in round order)."""
    control_cpu: list[float] = field(default_factory=list)
    """The control's (byte proxy's) CPU seconds per control round."""

    @classmethod
    def empty(cls, paths: list[str], gateways: list[str]) -> _Bursts:
        return cls({p: [] for p in paths}, {p: [] for p in paths}, {g: [] for g in gateways},
                   {g: [] for g in gateways})


async def _bursts(urls: dict[str, str], gateways: dict[str, Server], redis: RedisServer | None,
                  rounds: int, streams: int, tokens: int, nonce: str,
                  control: Server | None = None) -> _Bursts:
    """``rounds`` pairs of burst rounds, the order changing (``pair_order``), the same
    prompts in every round of a pair; one warm-up round per path first opens the
    connections. Redis's counters are read (``INFO``, outside the timed span) around the
    Redis gateway's rounds only."""
    out = _Bursts.empty(list(urls), list(gateways))
    async with client_session(streams) as session:
        for path in urls:
            await _burst(session, urls[path], path, streams, 8, f"{nonce}w")
        for i in range(rounds):
            for path in pair_order(list(urls), i):
                gateway = gateways.get(path)
                store = redis if path == REDIS_PATH else None
                store0 = store.usage() if store is not None else None
                cpu0 = gateway.cpu_seconds() if gateway is not None else 0.0
                wall0, own0 = time.time(), time.process_time()
                control0 = control.cpu_seconds() if control is not None else 0.0
                rate, records = await _burst(session, urls[path], path, streams, tokens,
                                             f"{nonce}b{i}")
                out.client_cpu.append(time.process_time() - own0)
                wall1 = time.time()
                if store is not None:
                    await asyncio.sleep(SETTLE_S)
                out.rates[path].append(rate)
                out.ttft[path].append(statistics.median(r.ttft for r in records))
                if control is not None and path == _control.PATH:
                    out.control_cpu.append(control.cpu_seconds() - control0)
                chunks = sum(len(r.token_times) for r in records)
                if gateway is not None:
                    out.windows[path].append((wall0, wall1))
                    out.cpu_gross[path].append((gateway.cpu_seconds() - cpu0, chunks))
                if store is not None and store0 is not None:
                    out.store.append((store.usage().since(store0), chunks))
                print(f"burst pair {i + 1} {path:13s}: {rate:.0f} tok/s, TTFT median "
                      f"{out.ttft[path][-1] * 1000:.0f} ms", flush=True)
    return out


async def plain_requests(url: str, requests: int, concurrency: int, tokens: int = 1) -> float:
    """``requests`` non-streamed completions, ``concurrency`` at a time; seconds taken.

    A 503 ``state_unavailable`` (the Redis gateway's store did not answer within its
    timeout: a stall of a loaded machine) is retried, as the error asks, up to
    ``STATE_RETRIES`` times per request after a short pause; the refused attempts' CPU
    stays in the round's reading. Any other failure ends the run."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": tokens, "ignore_eos": True}
    async with async_client(timeout=120, limits=limits,
                                 headers={"authorization": f"Bearer {KEY}"}) as client:
        left = iter(range(requests))

        async def worker() -> None:
            for _ in left:
                for attempt in range(STATE_RETRIES + 1):
                    resp = await client.post(f"{url}/v1/completions", json=body)
                    if (resp.status_code != 503 or attempt == STATE_RETRIES
                            or "state_unavailable" not in resp.text):
                        break
                    await asyncio.sleep(0.2 * (attempt + 1))
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")

        t0 = time.monotonic()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return time.monotonic() - t0


def _interval(values: list[float], digits: int = 3) -> dict[str, Any]:
    low, high = median_interval(values) if len(values) > 1 else (values[0], values[0])
    return {"median": round(statistics.median(values), digits),
            "interval95": [round(low, digits), round(high, digits)],
            "values": [round(v, digits) for v in values]}


def _summary(records: list[StreamRecord]) -> dict[str, float]:
    ttft = [r.ttft * 1000 for r in records]
    total = [(r.last - r.start) * 1000 for r in records]
    return {
        "ttft_ms_median": round(statistics.median(ttft), 3),
        "ttft_ms_p99": round(percentile(ttft, 99), 3),
        "total_ms_median": round(statistics.median(total), 3),
        "total_ms_p99": round(percentile(total, 99), 3),
    }


def _ledger_rounds(ledger: Path, windows: list[tuple[float, float]]) -> dict[str, Any]:
    """The gateway's own view of its burst rounds, from its ledger (read after it stopped).

    ``queue_ms`` is how long the gateway held a request before dispatching it (the gate,
    the fair queue); ``ttft_ms`` runs from the request's arrival at the gateway to its
    first token there. A burst that waits in the gateway shows in the first; what the
    engine takes, in the second, which the client's TTFT exceeds by the hop to the client.
    """
    with closing(sqlite3.connect(ledger)) as db:
        rows = db.execute("SELECT started_at, queue_ms, ttft_ms FROM requests").fetchall()
    queue_max, queue_p50, ttft_p50 = [], [], []
    for start, end in windows:
        burst = [r for r in rows if start <= r[0] <= end]
        queue = [r[1] or 0.0 for r in burst]
        ttft = [r[2] for r in burst if r[2] is not None]
        queue_max.append(round(max(queue, default=0.0), 2))
        queue_p50.append(round(statistics.median(queue) if queue else 0.0, 3))
        ttft_p50.append(round(statistics.median(ttft), 1) if ttft else None)
    return {"queue_ms_max": queue_max, "queue_ms_median": queue_p50, "ttft_ms_median": ttft_p50}


@dataclass
class _Arm:
    """A gateway under test (a path of the pairs) and its twin with the same configuration in
    front of the fast upstream, each with its own ledger."""

    gateway: Server
    fast: Server
    ledger: Path


@dataclass
class _Cpu:
    """The CPU phases, one entry per round, per gateway path; Redis's figures for the Redis
    gateway's phases, and its idle rate during the in-process gateway's."""

    per_request: dict[str, list[float]]
    """Gateway CPU seconds per sequential non-streamed request against the engine."""
    per_core: dict[str, list[float]]
    """Requests per gateway CPU-second against the fast upstream."""
    store: list[tuple[Usage, int]] = field(default_factory=list)
    """What Redis did and the requests sent, per engine phase of the Redis gateway."""
    store_fast: list[tuple[Usage, int]] = field(default_factory=list)
    """The same, per fast-upstream phase of the Redis gateway."""
    store_idle_per_s: list[float] = field(default_factory=list)
    """Redis's CPU seconds per second while only the in-process gateway was called."""


def _phase(gateway: Server, requests: int, concurrency: int, redis: RedisServer | None,
           settle_s: float = 0.0) -> tuple[float, Usage | None, float]:
    """``requests`` non-streamed 1-token requests through ``gateway`` alone: its CPU
    seconds, what Redis did meanwhile (when there is one), and the wall time; the CPU and
    Redis are read ``settle_s`` after the last response (``SETTLE_S``)."""
    before = redis.usage() if redis is not None else None
    cpu0, t0 = gateway.cpu_seconds(), time.monotonic()
    asyncio.run(plain_requests(gateway.base_url, requests, concurrency))
    wall = time.monotonic() - t0
    time.sleep(settle_s)
    cpu = gateway.cpu_seconds() - cpu0
    used = redis.usage().since(before) if redis is not None and before is not None else None
    return cpu, used, wall


def _cpu_rounds(arms: dict[str, _Arm], requests: int, redis: RedisServer | None,
                fast_requests: int | None = None) -> _Cpu:
    """``CPU_ROUNDS`` rounds, each measuring every gateway alone, the order changing:
    ``requests`` against the engine, ``fast_requests`` (default 20 x ``requests``) against
    the fast upstream."""
    out = _Cpu({name: [] for name in arms}, {name: [] for name in arms})
    for i in range(CPU_ROUNDS):
        for name in pair_order(list(arms), i):
            arm = arms[name]
            settle = SETTLE_S if name == REDIS_PATH else 0.0
            cpu, used, _ = _phase(arm.gateway, requests, 1, redis, settle)
            out.per_request[name].append(cpu / requests)
            asyncio.run(plain_requests(arm.fast.base_url, 50, 16))  # warm-up
            n = fast_requests or 20 * requests
            cpu, used_fast, wall = _phase(arm.fast, n, 16, redis, settle)
            out.per_core[name].append(n / cpu)
            if used is not None and used_fast is not None:
                if name == REDIS_PATH:
                    out.store.append((used, requests))
                    out.store_fast.append((used_fast, n))
                else:  # nobody calls Redis: its own timers and the Redis gateways' idle work
                    out.store_idle_per_s.append(used_fast.cpu_s / wall)
            print(f"round {i + 1} {name} fast upstream: {n / wall:.0f} req/s at "
                  f"{cpu / wall * 100:.0f}% of a core: {n / cpu:.0f} "
                  "requests per gateway CPU-second", flush=True)
    return out


def run(model: Path, requests: int = 200, tokens: int = 16, streams: int = 32,
        stream_tokens: int = 128, rounds: int = 24, workdir: Path | None = None,
        state: str = "memory", redis_url: str | None = None,
        control: str | None = None, fast_requests: int | None = None) -> dict[str, Any]:
    """Measure; ``state="redis"`` adds a path, the same gateway with ``state`` in a Redis
    (``redis_url``, or a ``redis-server`` started for the run); ``control``: None, or one
    of ``_control.CONTROLS`` for a control arm in every pair; ``fast_requests``: requests
    per CPU round against the fast upstream (None: 20 per request of a CPU round against
    the engine, at least ``20 * CPU_MIN_REQUESTS``)."""
    if control is not None and control not in _control.CONTROLS:
        raise ValueError(f"unknown control {control!r}; known: {', '.join(_control.CONTROLS)}")
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-gateway-"))
    redis = None
    if state == "redis":
        command = "tokenpace bench gateway"
        redis = (RedisServer.given(redis_url, command) if redis_url is not None
                 else RedisServer.start(home, command, "--state redis"))
    try:
        return _run(model, home, requests, tokens, streams, stream_tokens, rounds, redis,
                    control, fast_requests)
    finally:
        if redis is not None:
            redis.stop()


def _run(model: Path, home: Path, requests: int, tokens: int, streams: int, stream_tokens: int,
         rounds: int, redis: RedisServer | None, control: str | None,
         fast_requests: int | None = None) -> dict[str, Any]:
    nonce = f"{random.getrandbits(32):08x}"
    engine_port, fast_port = free_port(), free_port()
    engine = Server(tokenpace_serve_argv(model, engine_port, "--trusted-gateway",
                                         "--allow-unauthenticated-trusted-gateway",
                                         PROMPT_TOKENS_DETAILS), engine_port,
                    home / "engine.log")
    fast = fast_upstream.server(fast_port, home / "fast-upstream.log")
    servers = [engine, fast]
    arms: dict[str, _Arm] = {}
    states = {"gateway": None, **({REDIS_PATH: redis.url} if redis is not None else {})}
    for path, state_url in states.items():
        pair = []
        for upstream, name in ((engine.base_url, path), (fast.base_url, f"fast-{path}")):
            port, config = free_port(), home / f"{name}.yaml"
            config.write_text(gateway_config(upstream, home / f"{name}.db", state_url))
            pair.append(Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config",
                                str(config), "--port", str(port), "--log-level", "warning"],
                               port, home / f"{name}.log"))
        servers += pair
        arms[path] = _Arm(pair[0], pair[1], home / f"{path}.db")
    relay = _control.server(engine, home) if control is not None else None
    start_all(servers + ([relay] if relay is not None else []))
    urls = {"direct": engine.base_url, **{path: arm.gateway.base_url for path, arm in arms.items()}}
    if relay is not None:
        servers.append(relay)
        urls[_control.PATH] = relay.base_url
    try:
        seq = asyncio.run(_sequential(urls, requests, tokens, nonce))
        bursts = asyncio.run(_bursts(urls, {p: a.gateway for p, a in arms.items()}, redis,
                                     rounds, streams, stream_tokens, nonce, relay))
        cpu = _cpu_rounds(arms, max(requests, CPU_MIN_REQUESTS), redis, fast_requests)
    finally:
        for srv in reversed(servers):
            srv.stop()
    in_gateway = {path: _ledger_rounds(arm.ledger, bursts.windows[path])
                  for path, arm in arms.items()}
    result = figures(seq, bursts, cpu, in_gateway, streams)
    result["parameters"] = {"requests": requests, "tokens": tokens, "streams": streams,
                            "stream_tokens": stream_tokens, "rounds": rounds,
                            "fast_requests": fast_requests or 20 * max(requests,
                                                                       CPU_MIN_REQUESTS),
                            "state": "redis" if redis else "memory"}
    if relay is not None:
        ttft = {name: [r.ttft * 1000 for r in records] for name, records in seq.items()}
        total = {name: [(r.last - r.start) * 1000 for r in records] for name, records in seq.items()}
        result["parameters"]["control"] = control
        result["control"] = _control.summary(ttft, total, seq, bursts.rates, bursts.ttft,
                                             bursts.control_cpu)
    if redis is not None:
        result["redis"]["state"] = {
            "url": StateConfig(url=redis.url).redacted_url(), "timeout": STATE_TIMEOUT,
            "redis_server": redis.setup}
    result.update(environment())
    _print(result)
    return result


def _arm_figures(path: str, seq: dict[str, list[StreamRecord]], bursts: _Bursts, cpu: _Cpu,
                 in_gateway: dict[str, Any], streams: int) -> dict[str, Any]:
    """The figures of one gateway path against direct (the same keys for every gateway)."""
    ttft = {name: [r.ttft * 1000 for r in records] for name, records in seq.items()}
    total = {name: [(r.last - r.start) * 1000 for r in records] for name, records in seq.items()}
    request_cpu = statistics.median(cpu.per_request[path])
    gross = bursts.cpu_gross[path]
    cpu_per_chunk = [max(0.0, g - streams * request_cpu) / chunks for g, chunks in gross]
    rates, burst = bursts.rates, bursts.ttft
    return {
        "added_ttft_ms": difference_summary(ttft[path], ttft["direct"]),
        "added_total_ms": difference_summary(total[path], total["direct"]),
        "same_output_pairs": sum(d.token_ids == g.token_ids
                                 for d, g in zip(seq["direct"], seq[path])),
        "gateway_cpu_ms_per_request": _interval([v * 1000 for v in cpu.per_request[path]]),
        "gateway_cpu_us_per_chunk": _interval([v * 1e6 for v in cpu_per_chunk], 1),
        "gateway_cpu_us_per_chunk_gross": _interval([g / c * 1e6 for g, c in gross], 1),
        "gateway_cpu_ms_per_request_fast_upstream": _interval(
            [1000 / v for v in cpu.per_core[path]]),
        "throughput_ratio": ratio_summary(rates[path], rates["direct"], 4),
        "burst_ttft_ratio": ratio_summary(burst[path], burst["direct"]),
        "burst_in_gateway": in_gateway[path],
        "requests_per_gateway_cpu_second": _interval(cpu.per_core[path], 0),
    }


def _store_figures(seq: dict[str, list[StreamRecord]], bursts: _Bursts, cpu: _Cpu,
                   streams: int) -> dict[str, Any]:
    """What Redis adds to the in-process gateway, within the same pairs and rounds, and
    what the Redis server itself spends (its CPU is not in the gateway process's)."""
    ttft = {name: [r.ttft * 1000 for r in seq[name]] for name in ("gateway", REDIS_PATH)}
    total = {name: [(r.last - r.start) * 1000 for r in seq[name]]
             for name in ("gateway", REDIS_PATH)}
    per_request = {name: [v * 1000 for v in cpu.per_request[name]]
                   for name in ("gateway", REDIS_PATH)}
    fast = {name: [1000 / v for v in cpu.per_core[name]] for name in ("gateway", REDIS_PATH)}
    return {
        "redis_adds_ttft_ms": difference_summary(ttft[REDIS_PATH], ttft["gateway"]),
        "redis_adds_total_ms": difference_summary(total[REDIS_PATH], total["gateway"]),
        "throughput_ratio_to_gateway": ratio_summary(bursts.rates[REDIS_PATH],
                                                     bursts.rates["gateway"], 4),
        "burst_ttft_ratio_to_gateway": ratio_summary(bursts.ttft[REDIS_PATH],
                                                     bursts.ttft["gateway"]),
        "gateway_cpu_ms_added_per_request": _interval(
            paired_differences(per_request[REDIS_PATH], per_request["gateway"])),
        "gateway_cpu_ms_added_per_request_fast_upstream": _interval(
            paired_differences(fast[REDIS_PATH], fast["gateway"])),
        "redis_server_cpu_ms_per_request": _interval(
            [u.cpu_s / n * 1000 for u, n in cpu.store]),
        "redis_server_cpu_ms_per_request_fast_upstream": _interval(
            [u.cpu_s / n * 1000 for u, n in cpu.store_fast]),
        "redis_server_cpu_us_per_chunk_gross": _interval(
            [u.cpu_s / chunks * 1e6 for u, chunks in bursts.store], 2),
        "redis_server_cpu_ms_per_s_idle": _interval([v * 1000 for v in cpu.store_idle_per_s]),
        # Commands Redis ran, the scripts' inner calls included: its work, not round trips.
        "redis_commands_per_request": _interval([u.commands / n for u, n in cpu.store], 2),
        "redis_commands_per_request_fast_upstream": _interval(
            [u.commands / n for u, n in cpu.store_fast], 2),
        "redis_commands_per_request_burst": _interval(
            [u.commands / streams for u, _ in bursts.store], 2),
    }


def figures(seq: dict[str, list[StreamRecord]], bursts: _Bursts, cpu: _Cpu,
            in_gateway: dict[str, Any], streams: int) -> dict[str, Any]:
    """The result's figures from the measurements (pure: no server, no clock).

    The in-process gateway's keep their top-level keys; with the Redis path the same
    figures for the Redis gateway are under ``redis``, beside what Redis adds to the
    in-process gateway, pair by pair, and the Redis server's own CPU.
    """
    ttft = {name: [r.ttft * 1000 for r in records] for name, records in seq.items()}
    result: dict[str, Any] = {
        "benchmark": "gateway",
        "latency": {name: _summary(records) for name, records in seq.items()},
        **_arm_figures("gateway", seq, bursts, cpu, in_gateway, streams),
        "throughput_tok_s": {k: [round(v, 1) for v in vals] for k, vals in bursts.rates.items()},
        "burst_ttft_ms_median": {k: [round(v * 1000, 1) for v in vals]
                                 for k, vals in bursts.ttft.items()},
        "load_generator_cpu_s_per_round": _interval(bursts.client_cpu),
        "ttft_ms": {name: [round(v, 3) for v in values] for name, values in ttft.items()},
    }
    if REDIS_PATH in seq:
        result["redis"] = {**_arm_figures(REDIS_PATH, seq, bursts, cpu, in_gateway, streams),
                           **_store_figures(seq, bursts, cpu, streams)}
    return result


def _print(result: dict[str, Any]) -> None:
    added, requests = result["added_ttft_ms"], result["parameters"]["requests"]
    in_gateway, rounds = result["burst_in_gateway"], result["parameters"]["rounds"]
    print(f"added by the gateway (paired, {requests} pairs, {result['same_output_pairs']} with "
          f"identical output): "
          f"TTFT p50 {added['p50']['value']:+.2f} ms {added['p50']['interval95']}, p99 "
          f"{added['p99']['value']:+.2f} ms {added['p99']['interval95']} (p1 {added['p1']:+.2f}),"
          f" p99 shift {added['p99_shift']['value']:+.2f} ms {added['p99_shift']['interval95']};"
          f" throughput gateway/direct {result['throughput_ratio']['median']:.3f} "
          f"{result['throughput_ratio']['interval95']}; burst TTFT gateway/direct "
          f"{result['burst_ttft_ratio']['median']:.2f} {result['burst_ttft_ratio']['interval95']}"
          f" ({rounds} pairs; held in the gateway at most "
          f"{max(in_gateway['queue_ms_max'], default=0.0):.1f} ms); gateway CPU "
          f"{result['gateway_cpu_ms_per_request']['median']:.3f} ms per request, "
          f"{result['gateway_cpu_us_per_chunk']['median']:.1f} us per chunk net, "
          f"{result['gateway_cpu_us_per_chunk_gross']['median']:.1f} us gross; "
          f"{result['requests_per_gateway_cpu_second']['median']:.0f} requests per gateway "
          "CPU-second against a fast upstream", flush=True)
    if "control" in result:
        print(_control.line(result["control"]), flush=True)
    redis = result.get("redis")
    if redis is None:
        return
    adds, to_direct = redis["redis_adds_ttft_ms"], redis["added_ttft_ms"]["p50"]["value"]
    fast, added = (redis["gateway_cpu_ms_per_request_fast_upstream"]["median"],
                   redis["gateway_cpu_ms_added_per_request_fast_upstream"]["median"])
    ratio = redis["throughput_ratio_to_gateway"]
    print(f"with state in Redis: TTFT added to direct p50 {to_direct:+.2f} ms, to the "
          f"in-process gateway p50 {adds['p50']['value']:+.2f} ms {adds['p50']['interval95']}, "
          f"p99 {adds['p99']['value']:+.2f} ms (p1 {adds['p1']:+.2f}); throughput / in-process "
          f"gateway {ratio['median']:.3f} {ratio['interval95']}; gateway CPU {fast:.3f} ms per "
          f"request against the fast upstream ({added:+.3f} ms), "
          f"{redis['gateway_cpu_us_per_chunk']['median']:.1f} us per chunk net; redis-server CPU "
          f"{redis['redis_server_cpu_ms_per_request_fast_upstream']['median']:.3f} ms per request "
          f"({redis['redis_server_cpu_ms_per_request']['median']:.3f} against the engine), "
          f"{redis['redis_server_cpu_us_per_chunk_gross']['median']:.2f} us per chunk, "
          f"{redis['redis_commands_per_request_fast_upstream']['median']:.2f} commands per "
          f"request; {redis['requests_per_gateway_cpu_second']['median']:.0f} requests per "
          "gateway CPU-second", flush=True)


def plot(result: dict[str, Any], path: Path) -> None:
    from ._plots import pyplot, save

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in result["ttft_ms"].items():
        left.plot(range(len(values)), values, ".", markersize=3, label=name)
    left.set_xlabel("pair (direct and each gateway, one after the other)")
    left.set_ylabel("time to first token at the client (ms)")
    left.set_yscale("log")
    added = result["added_ttft_ms"]
    title = f"Sequential streamed requests: added p50 {added['p50']['value']:+.2f} ms"
    if "redis" in result:
        title += f", Redis {result['redis']['added_ttft_ms']['p50']['value']:+.2f} ms"
    left.set_title(title)
    left.legend()
    arms = [("gateway", result, "o-")]
    if "redis" in result:
        arms.append(("Redis gateway", result["redis"], "s--"))
    if "control" in result:  # the byte proxy's ratios against direct, dotted
        arms.append(("byte proxy", result["control"], "^:"))
    for arm, figures, style in arms:
        for key, label in (("throughput_ratio", "output tok/s"), ("burst_ttft_ratio", "median TTFT")):
            values = figures[key]["values"]
            right.plot(range(1, len(values) + 1), values, style, label=f"{arm}: {label}, median "
                       f"{figures[key]['median']:.2f} {figures[key]['interval95']}")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xlabel("burst pair")
    right.set_ylabel("path / direct, same pair")
    right.set_title(f"{result['parameters']['streams']} streams sent at once")
    right.legend()
    save(fig, path)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--requests", type=positive_int, default=200,
                        help="pairs of sequential streamed requests (direct, gateway; default 200)")
    parser.add_argument("--tokens", type=positive_int, default=16,
                        help="tokens per sequential request (default 16)")
    parser.add_argument("--streams", type=positive_int, default=32,
                        help="concurrent streams in the throughput rounds (default 32)")
    parser.add_argument("--stream-tokens", type=positive_int, default=128,
                        help="tokens per concurrent stream (default 128)")
    parser.add_argument("--rounds", type=positive_int, default=24,
                        help="pairs of burst rounds (direct, gateway; default 24)")
    parser.add_argument("--state", choices=("memory", "redis"), default="memory",
                        help="redis: also measure the same gateway with its state in Redis, as "
                        "a third path in the same pairs (starts a redis-server for the run "
                        "unless --redis is given; default memory: the in-process gateway only)")
    parser.add_argument("--redis", metavar="URL", default=None,
                        help="an existing Redis for --state redis (implies it); its CPU is read "
                        "with INFO, so it should serve nothing else meanwhile")
    parser.add_argument("--control", choices=["byte-proxy"], default=None,
                        help="add a control path to every pair: the engine behind a byte relay "
                             "in its own process (what any second process on the path costs)")


def main(args: argparse.Namespace) -> int:
    if args.redis is not None:
        args.state = "redis"
    if args.state == "redis":
        # Before the engine starts (a minute on the CPU), not after.
        if args.redis is None:
            redis_server_binary("tokenpace bench gateway", "--state redis")
        else:
            RedisServer.given(args.redis, "tokenpace bench gateway").stop()
    if args.quick:
        args.requests, args.streams, args.stream_tokens, args.rounds = 10, 8, 32, 3
    result = run(bench_model(args), args.requests, args.tokens, args.streams,
                 args.stream_tokens, args.rounds, state=args.state, redis_url=args.redis,
                 control=args.control, fast_requests=300 if args.quick else None)
    return write_outputs(args, result, plot)
