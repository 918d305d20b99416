"""A separate process that reserves from one shared budget as fast as it can.

Run as ``python -m tests.state._reserver URL TENANT COST COUNT``; prints how many
reservations Redis granted.
"""

from __future__ import annotations

import asyncio
import sys

from tokenpace.fairness import BudgetRefusal, BudgetSpec
from tokenpace.gateway.state import RedisStore

BUDGET = BudgetSpec(1000, 3600)


async def main(url: str, tenant: str, cost: float, count: int) -> int:
    store = RedisStore(url, timeout_s=2.0)  # generous: this measures atomicity, not latency
    granted = 0
    try:
        for _ in range(count):
            if not isinstance(await store.reserve(tenant, [BUDGET], cost), BudgetRefusal):
                granted += 1
    finally:
        await store.close()
    return granted


if __name__ == "__main__":
    url, tenant, cost, count = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    print(asyncio.run(main(url, tenant, cost, count)), flush=True)
