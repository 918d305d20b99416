"""Lane shares (``min_share``) across gateway replicas, against a real ``redis-server``.

Two replicas' dispatchers in one process, each with its own store connection, on one
engine with one global slot. The lower lane's share is decided on what every replica
dispatched to the engine, not on what the deciding replica dispatched itself: a lane
starved on all replicas together is promoted on a replica where its own share looks fine,
and a lane served on another replica is not promoted where it looks starved locally.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests._redis import RedisServer, require_redis_client

require_redis_client()

from tokenpace.gateway import parse_config  # noqa: E402
from tokenpace.gateway.dispatch import Lease  # noqa: E402
from tokenpace.gateway.dispatch import SharedDispatcher  # noqa: E402
from tokenpace.gateway.state import RedisStore  # noqa: E402
from tokenpace.gateway.tenants import Tenants  # noqa: E402

URL = "http://127.0.0.1:1"
MIN_SHARE = 0.25


def config() -> Any:
    return parse_config({
        "engines": [{"url": URL, "max_inflight": 1, "models": ["m"]}],
        "lanes": [{"name": "interactive", "priority": 0},
                  {"name": "batch", "priority": 10, "min_share": MIN_SHARE}],
        "tenants": [{"id": "i", "api_keys": ["k1"], "lane": "interactive"},
                    {"id": "h", "api_keys": ["k2"], "lane": "interactive"},
                    {"id": "b", "api_keys": ["k3"], "lane": "batch"}],
        "ledger": "sqlite:///unused.db",
    })


class Replica:
    def __init__(self, url: str) -> None:
        cfg = config()
        clock = asyncio.get_running_loop().time
        self.store = RedisStore(url, lease_s=5.0, timeout_s=5.0)  # generous: a loaded box
        self.dispatcher = SharedDispatcher(cfg, clock, self.store)
        self.tenants = Tenants(cfg, clock)
        self.engine = self.dispatcher.engines[0]

    def lease(self, tenant: str, estimate: float) -> Lease:
        state = self.tenants.get(tenant)
        assert state is not None
        return self.dispatcher.lease(state, self.dispatcher.pools["m"], 30.0, 1.0, estimate)

    async def dispatch(self, tenant: str, estimate: float) -> None:
        """One request through the uncontended path (the slot is free): its cost reaches
        the store with the next flush, sent here at once."""
        held = await self.lease(tenant, estimate).acquire()
        held.release()
        await self.store.flush()
        await self.released()

    async def released(self) -> None:
        for _ in range(500):
            if not (await self.store.held([f"engine:{URL}"]))[f"engine:{URL}"]:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the engine slot stayed held")

    async def close(self) -> None:
        await self.dispatcher.close()
        await self.store.close()


async def first_granted(replica: Replica, before: dict[str, float]) -> tuple[str, dict[str, float]]:
    """With a request of ``h`` holding the engine's one slot, queue one request of each lane
    on ``replica``, release the slot, and return the tenant dispatched first, with the
    replica's own lane shares at that moment."""
    for tenant, estimate in before.items():
        await replica.dispatch(tenant, estimate)
    holder = await replica.lease("h", 1.0).acquire()
    waiting = {tenant: asyncio.create_task(replica.lease(tenant, 10.0).acquire())
               for tenant in ("i", "b")}  # interactive queued first
    for _ in range(1000):
        if len(replica.dispatcher.pools["m"].queue) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(replica.dispatcher.pools["m"].queue) == 2 and not any(t.done() for t in waiting.values())
    own = replica.dispatcher.pools["m"].queue.lane_shares()
    holder.release()
    done, _ = await asyncio.wait(waiting.values(), timeout=10,
                                 return_when=asyncio.FIRST_COMPLETED)
    assert done, "neither waiter was dispatched within 10 s"
    first = next(tenant for tenant, task in waiting.items() if task in done)
    (await waiting[first]).release()
    other = next(t for t in waiting if t != first)
    (await asyncio.wait_for(waiting[other], 10)).release()
    return first, own


@pytest.mark.parametrize(("case", "mine", "theirs", "expected"), [
    # Replica 0 sent batch work itself (its own batch share 100 / 101, far above 0.25), but
    # replica 1 sent 1000 units of interactive work: batch has 100 / 1101 = 0.09 overall.
    ("starved_overall", {"b": 100.0}, {"i": 1000.0}, "b"),
    # Replica 0 sent only interactive work (its own batch share: 0), but replica 1 sent
    # 1000 units of batch work: batch has 1000 / 1101 overall, no promotion.
    ("served_elsewhere", {"i": 100.0}, {"b": 1000.0}, "i"),
])
def test_lane_shares_count_every_replicas_dispatches(
        redis_server: RedisServer, case: str, mine: dict[str, float],
        theirs: dict[str, float], expected: str) -> None:
    async def main() -> None:
        reps = [Replica(redis_server.url), Replica(redis_server.url)]
        try:
            for tenant, estimate in theirs.items():
                await reps[1].dispatch(tenant, estimate)
            first, own = await first_granted(reps[0], mine)
            # What replica 0 alone saw would have decided the other way.
            locally_promoted = own["batch"] < MIN_SHARE
            assert locally_promoted == (expected == "i"), own
            assert first == expected, (case, own)
        finally:
            for rep in reps:
                await rep.close()

    asyncio.run(main())
