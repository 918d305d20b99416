"""Cached prompt tokens with ``state`` in Redis, against a real ``redis-server``:
the shared budget reserves the whole prompt at ``cost.prompt`` and settles to the cost with
the cached part at ``cost.cached_prompt`` (in the same store call as the slot's release),
and the shared fair-queue counter, which every replica orders by, gets the discount back.

The request goes through the real stages (admission against the suite's fake engine over
HTTP for the exact prompt count, the shared dispatcher's lease, the exchange's usage as
the relay hands it); the figures are read back from Redis, not from this process."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests._redis import RedisServer, require_redis_client
from tests.gateway._engine import EngineServer

require_redis_client()

from tokenpace.gateway import parse_config  # noqa: E402
from tokenpace.gateway.admission import admit  # noqa: E402
from tokenpace.gateway.dispatch import SharedDispatcher  # noqa: E402
from tokenpace.gateway.engines import Overhead  # noqa: E402
from tokenpace.gateway.exchange import Exchange, Outcome, Runtime  # noqa: E402
from tokenpace.gateway.ledger import open_ledger  # noqa: E402
from tokenpace.gateway.state import RedisStore  # noqa: E402
from tokenpace.gateway.tenants import Tenants  # noqa: E402
from tokenpace.gateway.wire import parse_request  # noqa: E402

PLAIN = Overhead(fixed=1, per_message=0, max_model_len=4096)
BUDGET = 100_000.0
PROMPT = "x" * 99  # the fake engine counts bytes + 1: 100 prompt tokens


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineServer]:
    server = EngineServer().start()
    yield server
    server.stop()


@pytest.mark.parametrize("weight", [1.0, 2.0])
def test_the_shared_budget_and_counter_get_the_cached_discount(
        tmp_path: Path, engine: EngineServer, redis_server: RedisServer, weight: float) -> None:
    config = parse_config({
        "engines": [{"url": engine.url, "models": ["m"]}],
        "ledger": f"sqlite:///{tmp_path / 'usage.db'}",
        "cost": {"prompt": 1.0, "cached_prompt": 0.25, "completion": 2.0},
        "prompt_count": "exact",
        "tenants": [{"id": "t", "api_keys": ["k"], "weight": weight,
                     # 30 days: the shared bucket refills 0.04 tokens a second meanwhile
                     "budgets": [{"tokens": BUDGET, "per": "30d"}]}],
    })

    async def main() -> tuple[float, float, float]:
        clock = asyncio.get_running_loop().time
        store = RedisStore(redis_server.url, lease_s=5.0, timeout_s=5.0)
        await store.start()
        dispatcher = SharedDispatcher(config, clock, store)
        rt = Runtime(config, Tenants(config, clock), dispatcher, {},
                     open_ledger(config.ledger, flush_interval_s=60), clock=clock, store=store)
        rt.prompt_bounds.remember(engine.url, "m", "completion", PLAIN)
        try:
            tenant = rt.tenants.get("t")
            budgets = tenant.config.budgets
            ex = Exchange(rt, "tpg-shared-cached", "completion", tenant, rt.clock(), time.time())
            ex.model, ex.routed, ex.cost = "m", True, rt.config.cost_of("m")
            req = parse_request("completion", {"model": "m", "prompt": PROMPT,
                                               "max_tokens": 10})
            async with httpx.AsyncClient(base_url=engine.url) as client:
                admission = await admit(rt, ex, req, client, engine.url)
            assert ex.reservation is not None  # reserved in Redis, not in process
            [reserved_level] = (await store.budget_levels("t", budgets)).values()
            assert math.isclose(reserved_level, BUDGET - admission.reserved, abs_tol=1.0)
            ex.lease = await dispatcher.lease(
                tenant, dispatcher.pools["m"], 5.0, prompt_cost=100.0,
                estimate=admission.reserved).acquire()
            ex.learn_prompt(100)
            ex.completion_tokens = 4
            ex.charge_progress()
            ex.learn_cached(80)
            ex.finish(Outcome.FINISHED, "length")
            for _ in range(100):  # the release and settlement run in the background
                [level] = (await store.budget_levels("t", budgets)).values()
                if level > reserved_level + 1.0:
                    break
                await asyncio.sleep(0.05)
            await store.flush()
            counter = (await store.counters("default", ["t"]))["t"]
            rt.ledger.flush()
            [row] = rt.ledger.rows()
            assert (row.prompt_tokens, row.cached_prompt_tokens) == (100, 80)
            return level, counter, row.cost
        finally:
            await dispatcher.close()
            await store.close()
            rt.ledger.close()

    level, counter, cost = asyncio.run(main())
    discounted = 20 * 1.0 + 80 * 0.25 + 4 * 2.0  # 48; the whole prompt would be 108
    assert cost == discounted
    assert math.isclose(level, BUDGET - discounted, abs_tol=1.0), level
    # Every replica orders the tenant by this counter: service / weight, discount included.
    assert math.isclose(counter, discounted / weight, abs_tol=1e-6), counter
