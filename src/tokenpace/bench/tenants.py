"""`tokenpace bench tenants`: what the number of configured tenants costs the gateway.

A SaaS platform configures a tenant per customer, thousands of them, of which a few hundred
send traffic at any moment. This bench holds the traffic fixed and varies only how many
tenants the configuration lists: each arm is one gateway (its own process) in front of the
canned fast upstream (``_fast_upstream``, its own process, so the engine is never the limit
and its CPU is not counted), ``max_inflight`` 8 so that requests queue in the gateway's fair
queue, two lanes, weights 1-3 and a token budget per tenant. Per arm:

- start-up: from the process's spawn to its first good ``/health`` (polled every 10 ms),
  a fresh process per repeat, the arms alternating;
- gateway CPU per request: ``requests`` streamed completions spread round-robin over the
  first ``active`` tenants by ``clients`` concurrent clients, the gateway process's own CPU
  time over the requests; every arm's gateway runs at once and each repeat loads them one
  after the other in alternating order; the ratio to the first arm, repeat by repeat, with
  a bootstrap interval of its median;
- resident memory after start-up and after the load;
- ``/metrics``: bytes, lines and the time to answer (median of 5 scrapes), after the load;
- the extra wait a request sees while ``/metrics`` is scraped or ``/admin/reload`` runs: a
  probe client sends one small non-streamed request after the other; the extra wait is the
  probe latency while the scrape or reload is in flight, minus the probe's median latency
  of the quiet phase before (each event's worst probe; ``events`` of each kind).

Nothing here is a pass/fail test: the figures go to the JSON result; the goals
(CPU ratio <= 1.2, no request delayed over 50 ms, start-up <= 2 s, ``/metrics`` <= 1 MB with
100 active tenants) are printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from ._cli import add_common_args, positive_int, write_outputs
from . import _fast_upstream as fast_upstream
from ._environment import environment
from ._paired import pair_order
from .._process import Server, free_port
from .overhead import median_interval

ADMIN_KEY = "sk-bench-admin"
LANES = ("interactive", "batch")
STREAM_TOKENS = 16
PROBE_GAP_S = 0.005
QUIET_S = 2.0


def tenant_key(i: int) -> str:
    return f"sk-tenant-{i:05d}"


def config_document(tenants: int, upstream: str, ledger: Path) -> dict[str, Any]:
    """The gateway configuration of an arm: ``tenants`` tenants over two lanes."""
    return {
        "engines": [{"url": upstream, "models": ["tiny"], "max_inflight": 8}],
        "lanes": [{"name": LANES[0], "priority": 0}, {"name": LANES[1], "priority": 10}],
        "ledger": f"sqlite:///{ledger}",
        "metrics_cache": 0,  # each scrape renders: its cost is what is measured
        "admin_api_keys": [ADMIN_KEY],
        "tenants": [{"id": f"tenant-{i:05d}", "api_keys": [tenant_key(i)],
                     "lane": LANES[i % 2], "weight": 1 + i % 3,
                     "budgets": [{"tokens": 10_000_000, "per": "1h"}]}
                    for i in range(tenants)],
    }


def write_config(document: dict[str, Any], path: Path, fmt: str) -> None:
    """As YAML (block style, the way people write it) or as JSON (which is YAML too)."""
    if fmt == "json":
        path.write_text(json.dumps(document, indent=1))
        return
    import yaml

    path.write_text(yaml.safe_dump(document, sort_keys=False, default_flow_style=False))


def _rss_mb(pid: int) -> float:
    import psutil

    return round(psutil.Process(pid).memory_info().rss / 2**20, 1)


def _start(config: Path, home: Path, name: str) -> tuple[Server, float]:
    """Start a gateway; seconds from spawn to its first good /health."""
    port = free_port()
    t0 = time.monotonic()
    server = Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(config),
                     "--port", str(port), "--log-level", "warning"], port, home / f"{name}.log")
    deadline = t0 + 120
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if server.exited():
                raise RuntimeError(f"gateway exited:\n{server.log_tail()}")
            try:
                if client.get(f"{server.base_url}/health").status_code == 200:
                    return server, time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.01)
    server.stop()
    raise RuntimeError(f"gateway not ready after 120 s:\n{server.log_tail()}")


async def _load(url: str, requests: int, clients: int, active: int) -> None:
    """``requests`` streamed completions over the first ``active`` tenants, ``clients`` at once."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": STREAM_TOKENS, "stream": True}
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        left = iter(range(requests))

        async def client() -> None:
            for i in left:
                headers = {"authorization": f"Bearer {tenant_key(i % active)}"}
                async with session.post(f"{url}/v1/completions", json=body,
                                        headers=headers) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                    async for _ in resp.content.iter_any():
                        pass

        await asyncio.gather(*(client() for _ in range(clients)))


async def _scrape(url: str) -> int:
    """``GET /metrics`` read to its end and thrown away; its size. A bare socket, read a
    megabyte at a time: an HTTP client on the probe's event loop would parse a page of tens
    of megabytes in Python there and delay the probe itself, not the gateway."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /metrics HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n"
                 .encode())
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"/metrics answered {status!r}")
    size = 0
    while chunk := await reader.read(1 << 20):
        size += len(chunk)
    writer.close()
    return size


async def _probe_events(url: str, config: Path, events: int) -> dict[str, list[float]]:
    """Per event kind, the worst extra wait (ms) of the probe's requests in flight during it."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1}
    probe_headers = {"authorization": f"Bearer {tenant_key(0)}"}
    samples: list[tuple[float, float]] = []  # (sent, latency)
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=60) as probe_client, \
            httpx.AsyncClient(timeout=120) as other:

        async def probe() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                resp = await probe_client.post(f"{url}/v1/completions", json=body,
                                               headers=probe_headers)
                resp.raise_for_status()
                samples.append((t0, time.monotonic() - t0))
                await asyncio.sleep(PROBE_GAP_S)

        task = asyncio.create_task(probe())
        await asyncio.sleep(QUIET_S)
        quiet = statistics.median(lat for _, lat in samples)
        windows: dict[str, list[tuple[float, float]]] = {"metrics": [], "reload": []}
        for _ in range(events):
            for kind in windows:
                t0 = time.monotonic()
                if kind == "metrics":
                    await _scrape(url)
                else:
                    config.touch()
                    resp = await other.post(f"{url}/admin/reload",
                                            headers={"authorization": f"Bearer {ADMIN_KEY}"})
                    resp.raise_for_status()
                windows[kind].append((t0, time.monotonic()))
                await asyncio.sleep(0.3)
        stop.set()
        await task
    out: dict[str, list[float]] = {}
    for kind, spans in windows.items():
        worst = []
        for start, end in spans:
            overlapping = [lat for sent, lat in samples if sent <= end and sent + lat >= start]
            worst.append(round(max((lat - quiet for lat in overlapping), default=0.0) * 1000, 1))
        out[kind] = worst
    out["quiet_probe_ms"] = [round(quiet * 1000, 2)]
    return out


def _metrics_page(url: str) -> dict[str, Any]:
    times, size, lines = [], 0, 0
    with httpx.Client(timeout=60) as client:
        for _ in range(5):
            t0 = time.monotonic()
            resp = client.get(f"{url}/metrics")
            times.append((time.monotonic() - t0) * 1000)
            size, lines = len(resp.content), resp.text.count("\n")
    return {"bytes": size, "lines": lines, "ms_median": round(statistics.median(times), 1)}


def _arms(configured: list[int], active: int, requests: int, clients: int, repeats: int,
          events: int, fmt: str, upstream: str, home: Path) -> list[dict[str, Any]]:
    """Every arm's figures. Start-ups alternate between the arms (a fresh process each);
    then every arm's gateway runs at once and the load repeats alternate their order
    (``pair_order``), so each repeat's CPU ratio compares gateways that met the same
    moments of the machine."""
    configs = {}
    for n in configured:
        config = home / f"gateway-{n}.{'json' if fmt == 'json' else 'yaml'}"
        write_config(config_document(n, upstream, home / f"ledger-{n}.db"), config, fmt)
        configs[n] = config
    names = [str(n) for n in configured]
    startups: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in pair_order(names, i):
            server, took = _start(configs[int(name)], home, f"startup-{name}-{i}")
            startups[name].append(took)
            server.stop()
    servers: dict[str, Server] = {}
    try:
        for name in names:
            servers[name], _ = _start(configs[int(name)], home, f"gateway-{name}")
        rss_start = {name: _rss_mb(srv.proc.pid) for name, srv in servers.items()}
        for name, srv in servers.items():  # warm-up
            asyncio.run(_load(srv.base_url, 200, 32, min(active, int(name))))
        cpu: dict[str, list[float]] = {name: [] for name in names}
        for i in range(repeats):
            for name in pair_order(names, i):
                srv = servers[name]
                cpu0, t0 = srv.cpu_seconds(), time.monotonic()
                asyncio.run(_load(srv.base_url, requests, clients, min(active, int(name))))
                wall, used = time.monotonic() - t0, srv.cpu_seconds() - cpu0
                cpu[name].append(used / requests * 1000)
                print(f"{name} tenants, round {i + 1}: {requests / wall:.0f} req/s, "
                      f"{used / requests * 1000:.3f} ms gateway CPU per request", flush=True)
        arms = []
        for name, srv in servers.items():
            rss_after = _rss_mb(srv.proc.pid)
            page = _metrics_page(srv.base_url)
            waits = asyncio.run(_probe_events(srv.base_url, configs[int(name)], events))
            arms.append({"configured": int(name), "startup_s": _figure(startups[name], 2),
                         "cpu_ms_per_request": _figure(cpu[name], 3),
                         "rss_mb": {"after_start": rss_start[name], "after_load": rss_after},
                         "metrics": page, "extra_wait_ms": waits})
        return arms
    finally:
        for srv in servers.values():
            srv.stop()


def _figure(values: list[float], digits: int) -> dict[str, Any]:
    low, high = median_interval(values) if len(values) > 1 else (values[0], values[0])
    return {"median": round(statistics.median(values), digits),
            "interval95": [round(low, digits), round(high, digits)],
            "values": [round(v, digits) for v in values]}


def run(configured: list[int], active: int = 100, requests: int = 3000, clients: int = 256,
        repeats: int = 3, events: int = 5, fmt: str = "yaml",
        workdir: Path | None = None) -> dict[str, Any]:
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-tenants-"))
    port = free_port()
    fast = fast_upstream.server(port, home / "fast-upstream.log")
    fast.wait_ready()
    try:
        arms = _arms(configured, active, requests, clients, repeats, events, fmt,
                     fast.base_url, home)
    finally:
        fast.stop()
    result: dict[str, Any] = {"benchmark": "tenants", "arms": arms, "parameters": {
        "configured": configured, "active": active, "requests": requests, "clients": clients,
        "repeats": repeats, "events": events, "format": fmt, "stream_tokens": STREAM_TOKENS}}
    base = arms[0]["cpu_ms_per_request"]["values"]
    for arm in arms[1:]:
        ratios = [a / b for a, b in zip(arm["cpu_ms_per_request"]["values"], base)]
        arm["cpu_ratio_to_first"] = _figure(ratios, 3)
    result.update(environment())
    _print(result)
    return result


def _print(result: dict[str, Any]) -> None:
    print(f"{'configured':>10} {'start s':>8} {'CPU ms/req':>11} {'ratio':>6} {'RSS MB':>13} "
          f"{'/metrics KB':>11} {'lines':>7} {'ms':>6} {'scrape +ms':>11} {'reload +ms':>11}")
    for arm in result["arms"]:
        ratio = arm.get("cpu_ratio_to_first", {}).get("median", 1.0)
        waits = arm["extra_wait_ms"]
        print(f"{arm['configured']:>10} {arm['startup_s']['median']:>8} "
              f"{arm['cpu_ms_per_request']['median']:>11} {ratio:>6} "
              f"{arm['rss_mb']['after_start']:>6}/{arm['rss_mb']['after_load']:<6} "
              f"{arm['metrics']['bytes'] / 1024:>11.0f} {arm['metrics']['lines']:>7} "
              f"{arm['metrics']['ms_median']:>6} {max(waits['metrics']):>11} "
              f"{max(waits['reload']):>11}")
    print("goals (at 10,000 configured): CPU ratio <= 1.2, start-up <= 2 s, "
          "/metrics <= 1 MB with 100 active, no request delayed over 50 ms")


def plot(result: dict[str, Any], path: Path) -> None:
    """CPU per request and start-up per configured count, with their intervals."""
    from ._plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    labels = [str(arm["configured"]) for arm in result["arms"]]
    for ax, key, title in ((axes[0], "cpu_ms_per_request", "gateway CPU ms per request"),
                           (axes[1], "startup_s", "start-up (s)")):
        medians = [arm[key]["median"] for arm in result["arms"]]
        low = [m - arm[key]["interval95"][0] for m, arm in zip(medians, result["arms"])]
        high = [arm[key]["interval95"][1] - m for m, arm in zip(medians, result["arms"])]
        ax.bar(labels, medians, yerr=[low, high], capsize=4)
        ax.set_title(title)
        ax.set_xlabel("tenants configured")
    fig.tight_layout()
    fig.savefig(path)


def _counts(value: str) -> list[int]:
    try:
        counts = [int(v) for v in value.split(",")]
    except ValueError:
        counts = []
    if not counts or any(c <= 0 for c in counts):
        raise argparse.ArgumentTypeError(f"expected positive counts such as 100,10000; got {value!r}")
    return counts


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--configured", type=_counts, default=[100, 10000],
                        help="tenant counts to configure, one gateway each (default "
                        "100,10000; the first is the baseline of the CPU ratio)")
    parser.add_argument("--active", type=positive_int, default=100,
                        help="tenants that send the load, the same in every arm (default 100)")
    parser.add_argument("--requests", type=positive_int, default=3000,
                        help="streamed requests per repeat (default 3000)")
    parser.add_argument("--clients", type=positive_int, default=256,
                        help="concurrent clients (default 256)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="load repeats and fresh start-ups per arm (default 3)")
    parser.add_argument("--events", type=positive_int, default=5,
                        help="scrapes and reloads timed against a probe request (default 5 "
                        "each)")
    parser.add_argument("--format", choices=("yaml", "json"), default="yaml",
                        help="how the configuration file is written (default yaml)")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.configured, args.requests, args.repeats, args.events = [100, 2000], 400, 2, 2
    if len(args.configured) < 2:
        raise SystemExit("tokenpace bench tenants: error: --configured needs two counts or more "
                         "(the first is the baseline of the CPU ratio)")
    result = run(args.configured, args.active, args.requests, args.clients, args.repeats,
                 args.events, args.format)
    return write_outputs(args, result, plot)
