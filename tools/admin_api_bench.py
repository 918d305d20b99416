"""The admin API's costs: how long a change takes to reach a second replica, and start-up
time and memory with many API-made keys.

Propagation: two ``tokenpace gateway`` processes over one SQLite file in front of a canned
fast upstream; ``--changes`` times, a key is made at replica A (then revoked at A), and
replica B is asked with it every 5 ms until it answers 200 (then 401): the delay is from
A's answer to B's first matching answer (each change after a random pause, so that changes
do not fall in step with B's polls). Start-up: ``--keys`` keys written into the admin
store with the store's own ``create_key`` (the code the API runs, without HTTP), then one
gateway started: seconds to its first ``/health``, and its resident memory, against the
same gateway over an empty store.

    .venv/bin/python tools/admin_api_bench.py --changes 100 --keys 100000
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from tokenpace.bench import Server, fast_upstream_server, free_port
from tokenpace.gateway.registry import RegistryStore, new_key_id, new_salt

ADMIN = "sk-admin-bench"


def config(upstream: str, ledger: str, home: Path) -> dict[str, Any]:
    return {"engines": [{"url": upstream}], "ledger": ledger,
            "ledger_journal": str(home / "journal"), "admin_api_keys": [ADMIN],
            "tenants": [{"id": "file-tenant", "api_keys": ["sk-file"]}]}


def start(home: Path, cfg: dict[str, Any]) -> tuple[Server, str, float]:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    began = time.monotonic()
    server = Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(path),
                     "--port", str(port), "--log-level", "warning"], port, home / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    while True:  # finer than Server.wait_ready's half-second steps
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.proc.poll() is not None or time.monotonic() - began > 300:
            raise RuntimeError(server.log_tail())
        time.sleep(0.02)
    return server, url, time.monotonic() - began


def until(client: httpx.Client, url: str, key: str, status: int) -> float:
    began = time.monotonic()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    while client.post(url + "/v1/completions", json=body,
                      headers={"authorization": f"Bearer {key}"}).status_code != status:
        if time.monotonic() - began > 10:
            raise RuntimeError(f"no {status} at the second replica within 10 s")
        time.sleep(0.005)
    return time.monotonic() - began


def propagation(upstream: str, tmp: Path, changes: int) -> dict[str, float]:
    ledger = f"sqlite:///{tmp / 'shared.db'}"
    servers = [start(tmp / n, config(upstream, ledger, tmp / n)) for n in ("a", "b")]
    (_, a, _), (_, b, _) = servers
    admin = {"authorization": f"Bearer {ADMIN}"}
    delays: list[float] = []
    try:
        with httpx.Client(timeout=30) as client:
            assert client.post(a + "/admin/tenants", headers=admin,
                               json={"id": "bench"}).status_code == 201
            for i in range(changes // 2):
                # A pause of a random part of a poll interval before each change, so that
                # changes do not fall in step with B's polls (each would then wait a whole
                # interval, as right after B's poll saw the one before).
                time.sleep(random.uniform(0, 0.25))
                made = client.post(a + "/admin/tenants/bench/keys", headers=admin, json={})
                delays.append(until(client, b, made.json()["key"], 200))
                time.sleep(random.uniform(0, 0.25))
                client.delete(f"{a}/admin/keys/{made.json()['id']}", headers=admin)
                delays.append(until(client, b, made.json()["key"], 401))
    finally:
        for server, _, _ in servers:
            server.stop()
    ordered = sorted(delays)
    return {"changes": len(delays), "p50_ms": 1000 * statistics.median(delays),
            "p90_ms": 1000 * ordered[int(0.9 * (len(ordered) - 1))],
            "max_ms": 1000 * max(delays)}


def startup(upstream: str, tmp: Path, keys: int) -> dict[str, float]:
    ledger = f"sqlite:///{tmp / 'startup.db'}"
    home = tmp / "startup"
    store = RegistryStore(ledger)
    out: dict[str, float] = {}
    try:
        for label, count in (("empty", 0), ("keys", keys)):
            if count:
                now = time.time()
                store.create_tenant("many", {}, new_salt(), "bench", now)
                began = time.monotonic()
                for i in range(count):
                    store.create_key(new_key_id(), "many", None,
                                     hashlib.sha256(f"sk-bench-{i}".encode()).digest(),
                                     None, None, "bench", now)
                out["write_s"] = time.monotonic() - began
            server, url, took = start(home / label, config(upstream, ledger, home / label))
            try:
                if count:
                    answer = httpx.post(url + "/v1/completions", timeout=30,
                                        json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
                                        headers={"authorization": f"Bearer sk-bench-{count - 1}"})
                    assert answer.status_code == 200, answer.text
                out[f"{label}_start_s"] = took
                out[f"{label}_rss_mib"] = psutil.Process(server.proc.pid).memory_info().rss / 2**20
            finally:
                server.stop()
    finally:
        store.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=100)
    parser.add_argument("--keys", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        engine = fast_upstream_server(port, Path(tmp) / "upstream.log")
        engine.wait_ready()
        upstream = f"http://127.0.0.1:{port}"
        try:
            if args.changes:
                print("propagation", propagation(upstream, Path(tmp), args.changes), flush=True)
            if args.keys:
                print("startup", startup(upstream, Path(tmp), args.keys), flush=True)
        finally:
            engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
