"""Calendar budgets in the shared store, against a real ``redis-server``: the same figures
as the in-process store across a month's edge (a fake wall clock on the replica; Redis's
own clock plays no part in a calendar period), through every script that touches budgets."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import pytest

from tests._redis import RedisServer, require_redis_client

require_redis_client()

from tokenpace.fairness import BudgetRefusal, BudgetSpec, nominal_seconds  # noqa: E402
from tokenpace.gateway.state import (  # noqa: E402
    Admission,
    LocalStore,
    RedisStore,
    Reservation,
    StateStore,
    queued_slot,
)

MONTH = BudgetSpec(1000, nominal_seconds("month"), calendar="month")
SLIDING = BudgetSpec(100_000, 86400.0)


def utc(*args: int) -> float:
    return datetime(*args, tzinfo=timezone.utc).timestamp()


class Wall:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_month_budget_resets_at_the_first_in_redis_as_in_process(redis_server: RedisServer) -> None:
    wall = Wall(utc(2028, 2, 29, 23, 50))  # a leap February's last minutes

    async def body() -> None:
        shared = RedisStore(redis_server.url, timeout_s=2.0, wall=wall)
        stores: list[StateStore] = [shared, LocalStore(wall=wall)]
        try:
            firsts = [await s.reserve("acme", [SLIDING, MONTH], 700) for s in stores]
            for first in firsts:
                assert isinstance(first, Reservation)
                headroom = first.headroom()
                assert headroom is not None and headroom.budget == MONTH
                assert headroom.remaining == pytest.approx(300)
                assert headroom.reset_s == pytest.approx(600)  # until Mar 1st 00:00 UTC
            for store in stores:
                refusal = await store.reserve("acme", [SLIDING, MONTH], 400)
                assert isinstance(refusal, BudgetRefusal) and refusal.budget == MONTH
                assert refusal.remaining == pytest.approx(300)
                assert refusal.retry_after_s == pytest.approx(600)
                assert refusal.reset_s == pytest.approx(600)
                too_big = await store.reserve("acme", [MONTH], 1001)
                assert isinstance(too_big, BudgetRefusal)
                assert too_big.retry_after_s == float("inf")
            # The key names its period and expires an hour after it ends.
            keys = await shared._redis.keys("tokenpace:b:acme:1000/month@*")
            assert keys == [f"tokenpace:b:acme:1000/month@{int(utc(2028, 2, 1))}"]
            ttl_ms = await shared._redis.pttl(keys[0])
            assert 600_000 + 3_590_000 < ttl_ms <= 600_000 + 3_600_000

            wall.t = utc(2028, 3, 1, 0, 0, 5)
            for store in stores:
                levels = await store.budget_levels("acme", [MONTH, SLIDING])
                assert levels["1000/month"] == pytest.approx(1000)
                # Settled after the edge: the difference lands in the new period (capped).
                first = firsts[stores.index(store)]
                assert isinstance(first, Reservation)
                await store.settle(first, 900)
                assert (await store.budget_levels("acme", [MONTH]))["1000/month"] == \
                    pytest.approx(800)
            # Admission and settlement in one script each, as the dispatcher calls them.
            admitted = await shared.admit("acme", [MONTH], 500, queued_slot("acme", None), "l")
            assert isinstance(admitted, Admission)
            refused = await shared.admit("acme", [MONTH], 500, queued_slot("acme", None), "l")
            assert isinstance(refused, BudgetRefusal)
            assert refused.retry_after_s == pytest.approx(31 * 86400 - 5)  # March
            await shared.finish(admitted.queued, admitted.reservation, 100)
            assert (await shared.budget_levels("acme", [MONTH]))["1000/month"] == \
                pytest.approx(700)
        finally:
            await shared.close()

    asyncio.run(body())
