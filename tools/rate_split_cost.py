"""CPU per request of a paced tenant's rate split while it runs on one engine, in process:
``RateSplitter.start`` before the request and ``end`` after it (no control call is made).

    PYTHONPATH=src .venv/bin/python tools/rate_split_cost.py
"""

from __future__ import annotations

import asyncio
import statistics
import time

from tokenpace.gateway.engines import RateSplitter

REQUESTS = 20_000
REPEATS = 7


async def _send(url: str, user: str, rate: float, version: int) -> None:
    raise AssertionError("one engine: no control call")


async def main() -> None:
    splitter = RateSplitter(_send)
    per_request_us = []
    for _ in range(REPEATS):
        start = time.process_time()
        for _ in range(REQUESTS):
            await splitter.start("t", 80.0, "e1")
            splitter.end("t", 80.0, "e1")
        await splitter.drain()
        per_request_us.append((time.process_time() - start) / REQUESTS * 1e6)
    print(f"start + end, one engine: median {statistics.median(per_request_us):.1f} us CPU "
          f"per request (min {min(per_request_us):.1f}, max {max(per_request_us):.1f}, "
          f"{REPEATS} repeats of {REQUESTS})")


if __name__ == "__main__":
    asyncio.run(main())
