"""A separate process that holds slot leases (renewed) until it is killed.

``python -m tests.state._holder URL LEASE_S KEY LIMIT COUNT`` takes COUNT slots of KEY,
prints ``held`` and keeps them renewed.
"""

from __future__ import annotations

import asyncio
import sys

from tokenpace.gateway.state import RedisStore, SlotClaim, StoreLease


async def main(url: str, lease_s: float, key: str, limit: int, count: int) -> None:
    store = RedisStore(url, lease_s=lease_s, timeout_s=lease_s / 4)
    await store.start()
    for _ in range(count):
        lease = await store.acquire([SlotClaim(key, limit)])
        assert isinstance(lease, StoreLease), lease
    print("held", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
