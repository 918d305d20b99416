"""Gateway CPU per request of two source trees, side by side: for a change that must not
cost anything (a restructure), the CPU phase of ``tokenpace bench gateway`` with both
gateways up at once and measured alternately, so that the machine's load drifts over both.

Each gateway runs ``tokenpace gateway`` from its tree in front of one canned fast upstream
(``tokenpace.bench._fast_upstream``); a round sends each ``--requests`` non-streamed
requests, 16 at a time, and reads the process's CPU seconds before and after.

    git worktree add /tmp/before <commit>
    .venv/bin/python scripts/gateway_cpu_ab.py --before /tmp/before/src --rounds 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

from tokenpace._process import Server, free_port, start_all
from tokenpace.bench.gateway import _gateway_config, _plain


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the other tree's src/ directory")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp())
    fast_port = free_port()
    fast = Server([sys.executable, "-m", "tokenpace.bench._fast_upstream", str(fast_port)],
                  fast_port, home / "fast.log")
    gateways: dict[str, Server] = {}
    for name, src in (("before", args.before), ("after", None)):
        port, config = free_port(), home / f"{name}.yaml"
        config.write_text(_gateway_config(fast.base_url, home / f"{name}.db"))
        env = {"PYTHONPATH": src} if src else {}
        gateways[name] = Server(
            [sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(config),
             "--port", str(port), "--log-level", "warning"], port, home / f"{name}.log", env=env)
    if "PYTHONPATH" in os.environ:
        raise SystemExit("unset PYTHONPATH: the 'after' gateway runs this checkout's code")
    start_all([fast, *gateways.values()])
    us: dict[str, list[float]] = {name: [] for name in gateways}
    try:
        for server in gateways.values():
            asyncio.run(_plain(server.base_url, 200, 16))  # warm-up
        for i in range(args.rounds):
            for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
                server = gateways[name]
                cpu0 = server.cpu_seconds()
                asyncio.run(_plain(server.base_url, args.requests, 16))
                us[name].append((server.cpu_seconds() - cpu0) / args.requests * 1e6)
            print(f"round {i + 1}: " + ", ".join(f"{n} {v[-1]:.0f} us" for n, v in us.items()),
                  flush=True)
    finally:
        for server in [*gateways.values(), fast]:
            server.stop()
    ratios = sorted(a / b for a, b in zip(us["after"], us["before"]))
    for name, values in us.items():
        print(f"{name}: median {statistics.median(values):.0f} us of gateway CPU per request")
    print(f"after / before per round: median {statistics.median(ratios):.3f}, "
          f"range [{ratios[0]:.3f}, {ratios[-1]:.3f}] over {len(ratios)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
