"""Run timing-derived end-to-end tests repeatedly under extra CPU load; summarise each value.

    PYTHONPATH=src .venv/bin/python tools/timing_distribution.py --repeat 10 --load 1 \\
        --out timing.jsonl -- tests/e2e/test_serve.py -k isolation

Each selected test runs ``--repeat`` times in one pytest session (``-p tests._repeat``,
sharing the module's servers as CI does) while ``--load`` busy-loop processes each take a
core. Every value a test checks with ``tests/e2e/_timing.expect`` lands in ``--out``; the
summary shows, per value, its distribution and how close it came to its bound. With
``--summarise-only`` it only prints the summary of an existing ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

BUSY = "while True: pass"


def summarise(path: Path) -> str:
    """One row per checked value: its distribution and its closest approach to the bound."""
    values: dict[tuple[str, str, bool], list[tuple[float, float]]] = defaultdict(list)
    for line in path.read_text().splitlines():
        e = json.loads(line)
        values[(e["test"], e["name"], e["upper"])].append((e["value"], e["bound"]))
    loads = [json.loads(line).get("load1", float("nan")) for line in path.read_text().splitlines()]
    rows = [f"1-min load average while measuring: {min(loads):.1f} to {max(loads):.1f} "
            f"(median {statistics.median(loads):.1f}) on {os.cpu_count()} cores",
            "test | value | n | min | median | max | bound | worst value/bound"]
    for (test, name, upper), pairs in sorted(values.items()):
        vs, bs = [v for v, _ in pairs], [b for _, b in pairs]
        ratios = [v / b for v, b in pairs]
        worst = max(ratios) if upper else min(ratios)
        bound = f"{'<=' if upper else '>='} {statistics.median(bs):.4g}"
        if min(bs) != max(bs):  # a bound that depends on a measured baseline
            bound += f" ({min(bs):.4g}..{max(bs):.4g})"
        rows.append(f"{test} | {name} | {len(vs)} | {min(vs):.4g} | {statistics.median(vs):.4g}"
                    f" | {max(vs):.4g} | {bound} | {worst:.3f}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--load", type=int, default=1, help="busy-loop processes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--summarise-only", action="store_true")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    if args.repeat < 1 or args.load < 0:
        parser.error("--repeat must be >= 1 and --load >= 0")
    rc = 0
    if not args.summarise_only:
        env = dict(os.environ, TOKENPACE_REPEAT=str(args.repeat),
                   TOKENPACE_TIMING_LOG=str(args.out.resolve()))
        load = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.load)]
        try:
            rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "tests._repeat", "-q",
                                  *args.pytest_args], env=env)
        finally:
            for proc in load:
                proc.kill()
                proc.wait()
    print(summarise(args.out))
    return rc


if __name__ == "__main__":
    sys.exit(main())
