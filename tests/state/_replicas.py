"""Several gateway replicas' dispatchers over one real ``redis-server``, in one process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tests._redis import RedisServer, require_redis_client

require_redis_client()

from tokenpace.gateway.dispatch import SharedDispatcher  # noqa: E402
from tokenpace.gateway.state import RedisStore  # noqa: E402
from tokenpace.gateway.tenants import Tenants  # noqa: E402

Replica = tuple[SharedDispatcher, Tenants, RedisStore]


def with_replicas(redis_server: RedisServer, config: Callable[[], Any],
                  body: Callable[[list[Replica]], Awaitable[None]], replicas: int = 2) -> None:
    """Run ``body`` with ``replicas`` dispatchers, each with its own configuration (from
    ``config``), tenants and store connection, as separate gateway processes have."""
    async def main() -> None:
        reps = []
        for _ in range(replicas):
            cfg = config()
            clock = asyncio.get_running_loop().time
            store = RedisStore(redis_server.url, lease_s=5.0, timeout_s=5.0)
            await store.start()
            reps.append((SharedDispatcher(cfg, clock, store), Tenants(cfg, clock), store))
        try:
            await body(reps)
        finally:
            for dispatcher, _, store in reps:
                await dispatcher.close()
                await store.close()
    asyncio.run(main())
