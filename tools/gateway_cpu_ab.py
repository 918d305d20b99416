"""Gateway CPU per request of two or more source trees, side by side: for a change that must
not cost anything (a restructure), or to see what features cost since an old commit, the
CPU phase of ``tokenpace bench gateway`` with every gateway up at once and measured in
turn (the order rotating each round), so that the machine's load drifts over all of them.

Each gateway runs ``tokenpace gateway`` from its tree in front of one canned fast upstream
(``tokenpace.bench.fast_upstream_server``); a round sends each ``--requests`` non-streamed
requests, 16 at a time, and reads the process's CPU seconds before and after; with
``--stream-tokens K`` it then sends as many streamed requests of K tokens, and the CPU per
chunk is (streamed - plain) / K.

    git worktree add /tmp/before <commit>
    .venv/bin/python tools/gateway_cpu_ab.py --before /tmp/before/src --rounds 8
    .venv/bin/python tools/gateway_cpu_ab.py --tree old=/tmp/old/src --tree main=/tmp/main/src \
        --after ../dev/src --stream-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from tokenpace.bench import Server, fast_upstream_server, free_port, start_all
from tokenpace.bench.gateway import KEY, gateway_config, plain_requests


async def _streamed(url: str, requests: int, concurrency: int, tokens: int) -> None:
    """``requests`` streamed completions of ``tokens`` chunks, read to their end."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": tokens, "stream": True}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits,
                                 headers={"authorization": f"Bearer {KEY}"}) as client:
        left = iter(range(requests))

        async def worker() -> None:
            for _ in left:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(f"HTTP {resp.status_code}")
                    async for _chunk in resp.aiter_bytes():
                        pass

        await asyncio.gather(*[worker() for _ in range(concurrency)])


def _tree(value: str) -> tuple[str, str]:
    name, _, src = value.partition("=")
    if not name or not src:
        raise argparse.ArgumentTypeError(f"expected NAME=SRC, got {value!r}")
    return name, src


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="the other tree's src/ directory (named 'before')")
    parser.add_argument("--tree", type=_tree, action="append", default=[],
                        help="NAME=SRC: one more tree to measure (repeatable)")
    parser.add_argument("--after", help="the src/ directory of 'after' (default: the code "
                        "this Python imports)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--stream-tokens", type=int, default=0,
                        help="also measure streamed requests of this many chunks")
    args = parser.parse_args()
    trees = ([("before", args.before)] if args.before else []) + args.tree + [
        ("after", args.after)]
    if len(trees) < 2:
        parser.error("give --before or at least one --tree")
    if "PYTHONPATH" in os.environ:
        raise SystemExit("unset PYTHONPATH: each gateway gets its own")
    home = Path(tempfile.mkdtemp())
    fast_port = free_port()
    fast = fast_upstream_server(fast_port, home / "fast.log")
    gateways: dict[str, Server] = {}
    for name, src in trees:
        port, config = free_port(), home / f"{name}.yaml"
        config.write_text(gateway_config(fast.base_url, home / f"{name}.db"))
        env = {"PYTHONPATH": src} if src else {}
        gateways[name] = Server(
            [sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(config),
             "--port", str(port), "--log-level", "warning"], port, home / f"{name}.log", env=env)
    start_all([fast, *gateways.values()])
    us: dict[str, list[float]] = {name: [] for name in gateways}
    chunk_us: dict[str, list[float]] = {name: [] for name in gateways}
    names = list(gateways)
    try:
        for server in gateways.values():
            asyncio.run(plain_requests(server.base_url, 200, 16))  # warm-up
            if args.stream_tokens:
                asyncio.run(_streamed(server.base_url, 100, 16, args.stream_tokens))
        for i in range(args.rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                server = gateways[name]
                cpu0 = server.cpu_seconds()
                asyncio.run(plain_requests(server.base_url, args.requests, 16))
                plain = (server.cpu_seconds() - cpu0) / args.requests * 1e6
                us[name].append(plain)
                if args.stream_tokens:
                    cpu0 = server.cpu_seconds()
                    asyncio.run(_streamed(server.base_url, args.requests, 16, args.stream_tokens))
                    streamed = (server.cpu_seconds() - cpu0) / args.requests * 1e6
                    chunk_us[name].append((streamed - plain) / args.stream_tokens)
            print(f"round {i + 1}: " + ", ".join(
                f"{n} {v[-1]:.0f} us" + (f" ({chunk_us[n][-1]:.1f} us/chunk)"
                                         if args.stream_tokens else "")
                for n, v in us.items()), flush=True)
    finally:
        for server in [*gateways.values(), fast]:
            server.stop()
    for name in names:
        line = f"{name}: median {statistics.median(us[name]):.0f} us of gateway CPU per request"
        if args.stream_tokens:
            line += f", {statistics.median(chunk_us[name]):.1f} us per streamed chunk"
        print(line)
    for name in names[:-1]:
        ratios = sorted(a / b for a, b in zip(us["after"], us[name]))
        print(f"after / {name} per round: median {statistics.median(ratios):.3f}, "
              f"range [{ratios[0]:.3f}, {ratios[-1]:.3f}] over {len(ratios)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
