"""`tokenpace bench hostile`: one hostile tenant against another, with the default limits.

A gateway process with nothing configured beyond two tenants with valid keys (``victim``
and ``attacker``), one engine and a SQLite ledger: every limit is the gateway's default,
as a new operator keeps them. The engine is the tiny model (``tokenpace serve
--max-num-seqs 16``) started for the run, or an existing one (``engine_url``).

The victim sends ordinary chat requests at a steady ``rate`` (a short prompt,
``VICTIM_TOKENS`` output tokens with ``ignore_eos``, streamed and not in turn), each with
a ``victim_timeout``. Phases, one at a time:

- ``baseline``: the victim alone for ``duration`` seconds;
- one per attack (``_hostile_attacks.ATTACKS``): a fresh gateway and ledger, the victim
  alone for ``baseline`` seconds (the attack's own baseline), then for ``duration`` seconds
  beside the attack (at least ``MIN_SECONDS`` for attacks on connections, unless
  ``quick``). The attack is stopped, the victim's requests in flight are awaited,
  the gateway's ``/health`` is asked once, and the gateway gets SIGTERM (SIGKILL when its
  processes are still there 30 s later; ``stop_s`` says how long the stop took). A gateway
  that hangs or dies is a figure of its phase.

Per phase: the victim's latency (p50, p90, p99, max: the seconds from sending to the last byte
of the answer, or to its failure) over every request sent during the attack, and over
those of its own baseline that ended before the attack began; their ratios, and the ratio
to the ``baseline`` phase; its outcomes by status (``200``, ``503``, ``timeout``, ...);
the gateway's resident memory (``VmRSS`` of its process sampled every ``RSS_SAMPLE_S``: at
the attack's start, its peak until the victim's last answer, the difference); the bytes
of the ledger's directory (the SQLite ledger, its batch store and journal) once the
gateway answers and after its stop (the write-ahead log is folded in at the stop: a few
KB either way are noise), and the victim's answered requests with no ledger row (by
``x-request-id``); the attacker's outcomes (``_hostile_attacks``); the load average at
each phase's start and end. After each phase the bench waits until the engine answers a
one-token completion within ``SETTLE_LATENCY_S`` (work the attack left on it), and
reports how long that took.

``gateway_src`` runs the gateway from another source tree (``PYTHONPATH``): the same
battery measures an older commit. The bench, the attacker and the engine stay this tree's.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sqlite3
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from .._process import Server, free_port, tokenpace_serve_argv
from ._cli import add_common_args, bench_model, check_gateway_src, positive_float, write_outputs
from ._environment import environment
from ._hostile_attacks import (
    ATTACKS,
    FULL,
    HTTP_TIMEOUT_S,
    MIN_SECONDS,
    QUICK,
    Scale,
    Target,
    run_attack,
)

VICTIM_KEY = "sk-bench-hostile-victim"
ATTACKER_KEY = "sk-bench-hostile-attacker"
VICTIM_TOKENS = 16
VICTIM_PROMPT = "Say something short about the sea."
RSS_SAMPLE_S = 0.1
SETTLE_LATENCY_S = 1.0
SETTLE_TIMEOUT_S = 120.0
GATEWAY_START_TIMEOUT_S = 120.0

__all__ = ["ATTACKS", "add_cli_args", "main", "plot", "run"]


@dataclass
class VictimCall:
    sent: float  # time.monotonic()
    seconds: float = math.nan
    outcome: str = ""  # the HTTP status, "200-incomplete" (a stream cut short), or the error
    request_id: str | None = None


def _quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _victim_stats(calls: Sequence[VictimCall]) -> dict[str, Any]:
    seconds = [c.seconds for c in calls if not math.isnan(c.seconds)]
    outcomes = Counter(c.outcome for c in calls)
    return {"sent": len(calls), "ok": outcomes.get("200", 0),
            "errors": {k: v for k, v in sorted(outcomes.items()) if k != "200"},
            "p50_s": _quantile(seconds, 0.5), "p90_s": _quantile(seconds, 0.9),
            "p99_s": _quantile(seconds, 0.99),
            "max_s": max(seconds) if seconds else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


class _Victim:
    """The victim tenant, in its own thread and event loop: a request every ``1 / rate``
    seconds until ``stop_sending``, then its requests in flight are awaited (each has
    ``timeout`` seconds)."""

    def __init__(self, url: str, model: str, rate: float, timeout: float) -> None:
        self.url, self.model, self.rate, self.timeout = url, model, rate, timeout
        self.calls: list[VictimCall] = []
        self.stop_sending = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, session: aiohttp.ClientSession, call: VictimCall, stream: bool) -> None:
        body = {"model": self.model, "max_tokens": VICTIM_TOKENS, "ignore_eos": True,
                "stream": stream, "messages": [{"role": "user", "content": VICTIM_PROMPT}]}
        try:
            async with session.post("/v1/chat/completions", json=body) as resp:
                call.request_id = resp.headers.get("x-request-id")
                data = await resp.read()
                call.outcome = str(resp.status)
                if stream and resp.status == 200 and b"[DONE]" not in data:
                    call.outcome = "200-incomplete"
        except asyncio.TimeoutError:
            call.outcome = "timeout"
        except (aiohttp.ClientError, OSError) as exc:
            call.outcome = type(exc).__name__
        call.seconds = time.monotonic() - call.sent

    async def _run(self) -> None:
        tasks = []
        async with aiohttp.ClientSession(
                base_url=self.url, headers={"Authorization": f"Bearer {VICTIM_KEY}"},
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout)) as session:
            start = time.monotonic()
            i = 0
            while not self.stop_sending.is_set():
                call = VictimCall(sent=time.monotonic())
                self.calls.append(call)
                tasks.append(asyncio.ensure_future(self._one(session, call, i % 2 == 1)))
                i += 1
                await asyncio.sleep(max(0.0, start + i / self.rate - time.monotonic()))
            await asyncio.gather(*tasks, return_exceptions=True)

    def between(self, lo: float, hi: float) -> list[VictimCall]:
        return [c for c in self.calls if lo <= c.sent < hi]


class _Memory:
    """``VmRSS`` of one process, sampled in a thread every ``RSS_SAMPLE_S``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            rss = rss_bytes(self.pid)
            if rss is not None:
                self.samples.append((time.monotonic(), rss))
            time.sleep(RSS_SAMPLE_S)

    def figures(self, start: float, end: float) -> dict[str, float | None]:
        self.stop.set()
        self.thread.join(timeout=5)
        before = [rss for t, rss in self.samples if t <= start]
        during = [rss for t, rss in self.samples if start <= t <= end]
        at_start = before[-1] if before else (during[0] if during else None)
        peak = max(during) if during else None
        mb = 1024 * 1024
        return {"rss_start_mb": at_start / mb if at_start is not None else None,
                "rss_peak_mb": peak / mb if peak is not None else None,
                "rss_growth_mb": (peak - at_start) / mb
                if peak is not None and at_start is not None else None}


def rss_bytes(pid: int) -> int | None:
    """The resident set of ``pid`` from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _ledger_rows(db: Path) -> dict[str, list[str]]:
    """Request ids per tenant in the SQLite ledger ``db`` (empty when it has none)."""
    if not db.exists():
        return {}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        found: dict[str, list[str]] = {}
        for request_id, tenant in conn.execute("SELECT request_id, tenant FROM requests"):
            found.setdefault(tenant, []).append(request_id)
        return found
    except sqlite3.Error:
        return {}
    finally:
        conn.close()


def _gateway_config(engine_url: str, ledger: Path) -> str:
    import json

    return json.dumps({
        "engines": [engine_url],
        "ledger": f"sqlite:///{ledger}",
        "tenants": [{"id": "victim", "api_keys": [VICTIM_KEY]},
                    {"id": "attacker", "api_keys": [ATTACKER_KEY]}],
    }, indent=2)


# The bench's own calls are plain HTTP: ``verify=False`` spares each one loading the CA
# bundle (about 0.2 s of CPU a call here).


def _health(url: str) -> str:
    try:
        return str(httpx.get(f"{url}/health", timeout=5.0, verify=False).status_code)
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def _settle(engine_url: str, model: str) -> float:
    """Seconds until the engine answers a one-token completion within
    ``SETTLE_LATENCY_S`` (at most ``SETTLE_TIMEOUT_S``)."""
    began = time.monotonic()
    while time.monotonic() - began < SETTLE_TIMEOUT_S:
        t0 = time.monotonic()
        try:
            resp = httpx.post(f"{engine_url}/v1/completions", timeout=30.0, verify=False,
                              json={"model": model, "prompt": "hi", "max_tokens": 1})
            if resp.status_code == 200 and time.monotonic() - t0 < SETTLE_LATENCY_S:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return time.monotonic() - began


class _Run:
    """What every phase shares: the engine, the gateway's source, the victim's load."""

    def __init__(self, home: Path, engine_url: str, model: str, gateway_src: Path | None,
                 rate: float, victim_timeout: float, scale: Scale) -> None:
        self.home, self.engine_url, self.model = home, engine_url, model
        self.env = {"PYTHONPATH": str(gateway_src)} if gateway_src is not None else {}
        self.rate, self.victim_timeout, self.scale = rate, victim_timeout, scale

    def phase(self, name: str, baseline: float, duration: float) -> dict[str, Any]:
        """One phase (module docstring); ``name`` "baseline" runs no attack."""
        data = self.home / name
        data.mkdir(parents=True, exist_ok=True)
        config = data / "gateway.json"
        config.write_text(_gateway_config(self.engine_url, data / "ledger" / "usage.db"))
        (data / "ledger").mkdir(exist_ok=True)
        port = free_port()
        gateway = Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config",
                          str(config), "--port", str(port), "--log-level", "warning"],
                         port, data / "gateway.log", env=self.env)
        load_start = os.getloadavg()
        try:
            gateway.wait_ready(GATEWAY_START_TIMEOUT_S)
        except RuntimeError:
            gateway.stop()
            raise
        try:
            result = self._load(name, gateway, baseline, duration, data)
        finally:
            stopping = time.monotonic()
            gateway.stop()
        result["gateway"]["stop_s"] = time.monotonic() - stopping
        result["gateway"]["exit_code"] = gateway.proc.poll()
        rows = _ledger_rows(data / "ledger" / "usage.db")
        ok_ids = {c.request_id for c in result.pop("_victim_ok") if c.request_id}
        victim_rows = set(rows.get("victim", []))
        result["ledger"].update({
            "bytes_end": _dir_bytes(data / "ledger"),
            "rows": {tenant: len(ids) for tenant, ids in sorted(rows.items())},
            "victim_answered_ok": len(ok_ids),
            "victim_ok_without_row": len(ok_ids - victim_rows)})
        result["ledger"]["growth_bytes"] = (result["ledger"]["bytes_end"]
                                            - result["ledger"]["bytes_start"])
        result["engine_settle_s"] = _settle(self.engine_url, self.model)
        result["load_average"] = {"start": list(load_start), "end": list(os.getloadavg())}
        _print_phase(result)
        return result

    def _load(self, name: str, gateway: Server, baseline: float, duration: float,
              data: Path) -> dict[str, Any]:
        bytes_start = _dir_bytes(data / "ledger")
        memory = _Memory(gateway.proc.pid)
        victim = _Victim(gateway.base_url, self.model, self.rate, self.victim_timeout)
        t0 = time.monotonic()
        victim.thread.start()
        seen: dict[str, Counter[str]] = {}
        attacker = None
        stop = threading.Event()
        if name != "baseline":
            time.sleep(baseline)
            target = Target(gateway.base_url, ATTACKER_KEY, self.model)
            attacker = threading.Thread(
                target=lambda: seen.update(outcomes=run_attack(name, target, self.scale, stop)),
                daemon=True)
        t_attack = time.monotonic()
        if attacker is not None:
            attacker.start()
        time.sleep(duration)
        t_stop = time.monotonic()
        stop.set()
        victim.stop_sending.set()
        victim.thread.join(timeout=self.victim_timeout + 30)
        if attacker is not None:
            attacker.join(timeout=HTTP_TIMEOUT_S + 30)
        t_end = time.monotonic()
        health = _health(gateway.base_url)
        memory_figures = memory.figures(t_attack if attacker is not None else t0, t_end)
        during = victim.between(t_attack, t_stop)
        # The attack's own baseline: requests that ended before it began (one still in
        # flight then would carry the attack's delay into the baseline).
        alone = [c for c in victim.between(t0, t_attack) if c.sent + c.seconds <= t_attack]
        result: dict[str, Any] = {
            "name": name,
            "seconds": {"baseline": round(t_attack - t0, 3), "attack": round(t_stop - t_attack, 3),
                        "drain": round(t_end - t_stop, 3)},
            "victim": {"attack" if attacker is not None else "alone": _victim_stats(during)},
            "gateway": {**memory_figures, "health_after": health,
                        "alive_after": not gateway.exited(),
                        "victim_thread_finished": not victim.thread.is_alive()},
            "ledger": {"bytes_start": bytes_start},
            "_victim_ok": [c for c in victim.calls if c.outcome == "200"],
        }
        if attacker is not None:
            stats = result["victim"]
            stats["baseline"] = _victim_stats(alone)
            stats["p50_ratio"] = _ratio(stats["attack"]["p50_s"], stats["baseline"]["p50_s"])
            stats["p99_ratio"] = _ratio(stats["attack"]["p99_s"], stats["baseline"]["p99_s"])
            result["attacker"] = {"outcomes": dict(sorted(seen.get("outcomes", {}).items())),
                                  "finished": not attacker.is_alive()}
        return result


def _print_phase(result: dict[str, Any]) -> None:
    victim = result["victim"]
    main = victim.get("attack") or victim["alone"]
    base = victim.get("baseline")
    p99 = main["p99_s"]
    line = (f"{result['name']:>17}: victim p50 {_fmt(main['p50_s'])} p99 {_fmt(p99)} "
            f"({main['ok']}/{main['sent']} ok, errors {main['errors'] or 0})")
    if base is not None:
        line += f"; alone p99 {_fmt(base['p99_s'])}, x{_fmt(victim['p99_ratio'], '', 1)}"
    gw = result["gateway"]
    line += (f"; RSS +{_fmt(gw['rss_growth_mb'], ' MB', 0)}, health after {gw['health_after']}"
             f"; ledger {result['ledger']['growth_bytes'] / 1e6:+.1f} MB, victim rows missing "
             f"{result['ledger']['victim_ok_without_row']}")
    if "attacker" in result:
        line += f"; attacker {result['attacker']['outcomes']}"
    line += f"; load {result['load_average']['end'][0]:.1f}"
    print(line, flush=True)


def _fmt(value: float | None, unit: str = " s", digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _engine_model(engine_url: str) -> str:
    resp = httpx.get(f"{engine_url}/v1/models", timeout=30.0, verify=False)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def run(model: Path | None, attacks: Sequence[str] = tuple(ATTACKS), duration: float = 15.0,
        baseline: float = 8.0, rate: float = 8.0, victim_timeout: float = 30.0,
        quick: bool = False, engine_url: str | None = None, gateway_src: Path | None = None,
        workdir: Path | None = None) -> dict[str, Any]:
    """Run the battery (module docstring) and return its figures. ``model`` is started
    as the engine unless ``engine_url`` names a running one."""
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise ValueError(f"unknown attacks: {', '.join(unknown)}; known: {', '.join(ATTACKS)}")
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-hostile-"))
    engine: Server | None = None
    if engine_url is None:
        if model is None:
            raise ValueError("give a model to start or an engine_url")
        port = free_port()
        engine = Server(tokenpace_serve_argv(model, port, "--max-num-seqs", "16"), port,
                        home / "engine.log")
        engine_url = engine.base_url
    try:
        if engine is not None:
            engine.wait_ready()
        served = _engine_model(engine_url)
        _settle(engine_url, served)
        scale = QUICK if quick else FULL
        runner = _Run(home, engine_url, served, gateway_src, rate, victim_timeout, scale)
        phases = [runner.phase("baseline", 0.0, duration)]
        for name in attacks:
            seconds = duration if quick else max(duration, MIN_SECONDS.get(name, 0.0))
            phases.append(runner.phase(name, baseline, seconds))
    finally:
        if engine is not None:
            engine.stop()
    reference = phases[0]["victim"]["alone"]["p99_s"]
    for phase in phases[1:]:
        phase["victim"]["p99_ratio_to_baseline_phase"] = _ratio(
            phase["victim"]["attack"]["p99_s"], reference)
    from .metering import _gateway_commit

    return {
        "benchmark": "hostile",
        "parameters": {
            "attacks": list(attacks), "duration_s": duration, "baseline_s": baseline,
            "min_seconds": {} if quick else MIN_SECONDS,
            "victim_rate": rate, "victim_tokens": VICTIM_TOKENS,
            "victim_timeout_s": victim_timeout, "quick": quick,
            "scale": scale.__dict__, "engine": engine_url if engine is None
            else "tiny (tokenpace serve --max-num-seqs 16), started for the run",
            "gateway_config": "two tenants (victim, attacker), one engine, a SQLite ledger; "
            "every limit the default", "workdir": str(home)},
        "gateway": {"source": str(gateway_src) if gateway_src else "this tree",
                    "commit": _gateway_commit(gateway_src)},
        "phases": phases,
        **environment(),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """The victim's p99 ratio (attack over its own baseline) and the gateway's memory
    growth, per attack."""
    from ._plots import pyplot, save

    plt = pyplot()
    attacks = [p for p in result["phases"] if "attacker" in p]
    names = [p["name"].replace("_", "\n") for p in attacks]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    ratios = [p["victim"]["p99_ratio"] or 0.0 for p in attacks]
    left.bar(range(len(attacks)), ratios, color=[
        "tab:red" if (r or 0) > 2 or p["victim"]["attack"]["errors"] else "tab:green"
        for r, p in zip(ratios, attacks)])
    left.axhline(2.0, color="black", linestyle="--", label="goal: within 2x")
    left.set_yscale("log")
    left.set_xticks(range(len(attacks)), names, fontsize=8)
    left.set_title("victim p99 during the attack / alone (red: >2x or errors)")
    left.legend()
    right.bar(range(len(attacks)), [p["gateway"]["rss_growth_mb"] or 0.0 for p in attacks])
    right.set_xticks(range(len(attacks)), names, fontsize=8)
    right.set_title("gateway RSS growth during the attack (MB)")
    save(fig, path)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "A gateway with the default limits (two tenants, one engine on the tiny model, a "
        "SQLite ledger). A victim tenant sends short chat requests at a steady rate, alone, "
        "then beside each attack in turn (a fresh gateway each): a parse bomb, batch uploads, "
        "a tokenize flood, slow readers, huge model names, slowloris, a connection flood. Per "
        "attack: the victim's p50/p99 latency against its own baseline, its errors, the "
        "gateway's memory growth, the ledger's growth and the victim's rows, what the "
        "attacker got. --quick: shorter phases and smaller attacks.")
    add_common_args(parser)
    parser.add_argument("--duration", type=positive_float, default=None,
                        help="seconds of each attack, and of the baseline phase (default 15; "
                        "--quick: 5)")
    parser.add_argument("--baseline", type=positive_float, default=None,
                        help="seconds of the victim alone before each attack (default 8; "
                        "--quick: 4)")
    parser.add_argument("--rate", type=positive_float, default=8.0,
                        help="the victim's requests per second (default 8)")
    parser.add_argument("--victim-timeout", type=positive_float, default=30.0,
                        help="seconds each victim request may take (default 30)")
    parser.add_argument("--attacks", type=lambda v: [a for a in v.split(",") if a],
                        default=None, metavar="NAME[,NAME...]",
                        help="the attacks to run (default all: parse_bomb, batch_uploads, "
                        "tokenize_flood, slow_readers, huge_model_names, slowloris, "
                        "connection_flood)")
    parser.add_argument("--engine-url", default=None, metavar="URL",
                        help="use this running engine (its first served model) instead of "
                        "starting the tiny model")
    parser.add_argument("--gateway-src", type=Path, default=None, metavar="DIR",
                        help="run the gateway from this source tree (the src/ directory of "
                        "another checkout; PYTHONPATH=DIR)")


def main(args: argparse.Namespace) -> int:
    if args.duration is None:
        args.duration = 5.0 if args.quick else 15.0
    if args.baseline is None:
        args.baseline = 4.0 if args.quick else 8.0
    check_gateway_src(args.gateway_src, "tokenpace bench hostile")
    attacks = args.attacks or list(ATTACKS)
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise SystemExit(f"tokenpace bench hostile: error: --attacks: unknown "
                         f"{', '.join(unknown)}; known: {', '.join(ATTACKS)}")
    result = run(None if args.engine_url else bench_model(args), attacks, args.duration,
                 args.baseline, args.rate, args.victim_timeout, quick=args.quick,
                 engine_url=args.engine_url, gateway_src=args.gateway_src)
    return write_outputs(args, result, plot)
