"""Embeddings through the gateway against the engine called directly, in the same run.

One vLLM engine serving the tiny model as an embedding model (``--runner pooling
--convert embed``) and one gateway in front of it with two tenants: ``plain`` (no cap, no
budget: nothing is counted before dispatch) and ``counted`` (a budget: each input is
counted with the engine's ``/tokenize`` first). Each round sends ``--requests``
``/v1/embeddings`` requests of ``--inputs`` texts, ``--concurrency`` at a time, on each
path in turn (direct, gateway plain, gateway counted; the order rotates from round to
round, ``pair_order``); every request's texts are its own. Per round and path: requests
per second, and for the gateway paths the gateway process's CPU seconds per request over
its phase (psutil, the gateway alone being called). Reported: each figure's median over
rounds with its 95% bootstrap interval, and the ratio gateway / direct of requests per
second, per round, likewise.

    .venv/bin/python tools/embeddings_bench.py --rounds 6 --requests 300 --out /tmp/emb.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tokenpace.bench import Server, free_port, pair_order, start_all, vllm_server_argv, write_json
from tokenpace.bench.overhead import median_interval
from tokenpace.tiny_model import write_tiny_model

KEYS = {"gateway": "sk-plain", "gateway-counted": "sk-counted"}
WORDS = ("river", "stone", "lamp", "orbit", "maple", "quartz", "harbor", "cedar", "ember",
         "violet", "tundra", "signal", "meadow", "copper", "lantern", "glacier")


def texts(rng: random.Random, inputs: int, words: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(inputs)]


async def phase(url: str, key: str | None, requests: int, concurrency: int, inputs: int,
                words: int, seed: int) -> float:
    """``requests`` embeddings requests, ``concurrency`` at a time; seconds taken."""
    rng = random.Random(seed)
    bodies = [{"model": "tiny", "input": texts(rng, inputs, words)} for _ in range(requests)]
    headers = {"authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=headers) as client:
        left = iter(bodies)

        async def worker() -> None:
            for body in left:
                resp = await client.post(f"{url}/v1/embeddings", json=body)
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")

        t0 = time.monotonic()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return time.monotonic() - t0


def summary(values: list[float], digits: int = 4) -> dict[str, Any]:
    low, high = median_interval(values) if len(values) > 1 else (values[0], values[0])
    return {"median": round(statistics.median(values), digits),
            "interval95": [round(low, digits), round(high, digits)],
            "values": [round(v, digits) for v in values]}


def run(rounds: int, requests: int, concurrency: int, inputs: int, words: int,
        home: Path) -> dict[str, Any]:
    model = home / "tiny"
    write_tiny_model(model)
    engine_port, gateway_port = free_port(), free_port()
    engine = Server(vllm_server_argv(model, engine_port, "--runner", "pooling",
                                     "--convert", "embed"), engine_port, home / "engine.log")
    config = {
        "engines": [{"url": f"http://127.0.0.1:{engine_port}", "max_inflight": 2 * concurrency}],
        "ledger": f"sqlite:///{home / 'usage.db'}",
        "tenants": [{"id": "plain", "api_keys": [KEYS["gateway"]]},
                    {"id": "counted", "api_keys": [KEYS["gateway-counted"]],
                     "budgets": [{"tokens": 10 ** 12, "per": "1d"}]}],
    }
    (home / "gateway.yaml").write_text(yaml.safe_dump(config))
    gateway = Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config",
                      str(home / "gateway.yaml"), "--port", str(gateway_port),
                      "--log-level", "warning"], gateway_port, home / "gateway.log")
    start_all([engine, gateway])
    urls = {"direct": engine.base_url, "gateway": gateway.base_url,
            "gateway-counted": gateway.base_url}
    rps: dict[str, list[float]] = {name: [] for name in urls}
    cpu: dict[str, list[float]] = {name: [] for name in KEYS}
    try:
        for name in urls:  # warm-up: the engine's first batches, the gateway's connections
            asyncio.run(phase(urls[name], KEYS.get(name), 2 * concurrency, concurrency,
                              inputs, words, seed=-1))
        for i in range(rounds):
            for name in pair_order(list(urls), i):
                cpu0 = gateway.cpu_seconds()
                wall = asyncio.run(phase(urls[name], KEYS.get(name), requests, concurrency,
                                         inputs, words, seed=i * 10 + len(name)))
                rps[name].append(requests / wall)
                if name in cpu:
                    cpu[name].append((gateway.cpu_seconds() - cpu0) / requests * 1e6)
                print(f"round {i + 1} {name}: {requests / wall:.1f} req/s", flush=True)
    finally:
        gateway.stop()
        engine.stop()
    return {
        "parameters": {"rounds": rounds, "requests": requests, "concurrency": concurrency,
                       "inputs": inputs, "words": words},
        "requests_per_s": {name: summary(values, 2) for name, values in rps.items()},
        "ratio_to_direct": {name: summary([g / d for g, d in zip(rps[name], rps["direct"])])
                            for name in KEYS},
        "gateway_cpu_us_per_request": {name: summary(values, 1) for name, values in cpu.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=300, help="per round and path")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--inputs", type=int, default=4, help="texts per request")
    parser.add_argument("--words", type=int, default=16, help="words per text")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="tokenpace-embeddings-bench-"))
    result = run(args.rounds, args.requests, args.concurrency, args.inputs, args.words, home)
    print(json.dumps(result, indent=2))
    if args.out is not None:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
