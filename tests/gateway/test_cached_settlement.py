"""Cached prompt tokens settled at ``cost.cached_prompt``, in process on the real
stages: admission reserves the whole prompt at ``cost.prompt`` (a cache hit is known only
after the engine ran the prompt), the fair queue is charged so at dispatch or at the first
usage, and the engine's final usage brings the cached count: the budget settles to the
discounted cost, the fair queue's counter gets the discount back, and the ledger row and
the metric say how many prompt tokens were cached.

The engine is the test suite's fake engine over real HTTP (it answers ``/tokenize`` for
the exact count); the usage the relay would read is handed to the exchange as the relay
hands it (``learn_prompt``, ``charge_progress``, ``learn_cached``, ``finish``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway._engine import EngineServer
from tokenpace.gateway import metrics, parse_config
from tokenpace.gateway.admission import admit
from tokenpace.gateway.dispatch import Dispatcher
from tokenpace.gateway.engines import Overhead
from tokenpace.gateway.exchange import Exchange, Outcome, Runtime
from tokenpace.gateway.ledger import open_ledger
from tokenpace.gateway.tenants import Tenants
from tokenpace.gateway.wire import parse_request

PLAIN = Overhead(fixed=1, per_message=0, max_model_len=4096)
COST = {"prompt": 1.0, "cached_prompt": 0.25, "completion": 2.0}
BUDGET = 100_000.0
PROMPT = "x" * 99  # the fake engine counts bytes + 1: 100 prompt tokens
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineServer]:
    server = EngineServer().start()
    yield server
    server.stop()


def runtime(tmp_path: Path, engine_url: str, prompt_count: str, tenant_id: str,
            cost: dict[str, float] = COST) -> Runtime:
    config = parse_config({
        "engines": [{"url": engine_url, "models": ["m"]}],
        "ledger": f"sqlite:///{tmp_path / 'usage.db'}",
        "cost": cost, "prompt_count": prompt_count,
        "tenants": [{"id": tenant_id, "api_keys": ["k"],
                     "budgets": [{"tokens": BUDGET, "per": "1d"}]}],
    })
    now = [0.0]  # a frozen clock: no refill between reservation and settlement
    clock = lambda: now[0]  # noqa: E731
    rt = Runtime(config, Tenants(config, clock), Dispatcher(config, clock), {},
                 open_ledger(config.ledger, flush_interval_s=60), clock=clock)
    rt.prompt_bounds.remember(engine_url, "m", "completion", PLAIN)
    return rt


def serve(rt: Runtime, engine_url: str, tenant_id: str, cached: int | None,
          completion: int) -> tuple[Exchange, dict[str, float]]:
    """One request through admission and dispatch, its usage as the relay reads it; the
    budget level and fair-queue counter at each step."""
    seen: dict[str, float] = {}

    async def main() -> Exchange:
        tenant = rt.tenants.get(tenant_id)
        ex = Exchange(rt, f"tpg-{tenant_id}-{cached}", "completion", tenant, rt.clock(),
                      time.time())
        ex.model, ex.routed, ex.cost = "m", True, rt.config.cost_of("m")
        req = parse_request("completion", {"model": "m", "prompt": PROMPT,
                                           "max_tokens": MAX_TOKENS})
        async with httpx.AsyncClient(base_url=engine_url) as client:
            admission = await admit(rt, ex, req, client, engine_url)
        seen["reserved"] = admission.reserved
        seen["level_admitted"] = level(rt, tenant_id)
        pool = rt.dispatcher.pools["m"]
        # As the proxy leases: the prompt's cost at cost.prompt when it was counted.
        ex.lease = await rt.dispatcher.lease(
            tenant, pool, 5.0, prompt_cost=ex.cost.prompt * admission.prompt_tokens,
            estimate=admission.reserved).acquire()
        seen["counter_dispatched"] = pool.queue.counter(tenant_id)
        # The first usage chunk: the exact prompt; then the output as it streams.
        ex.learn_prompt(100)
        ex.completion_tokens = completion
        ex.charge_progress()
        seen["counter_full"] = pool.queue.counter(tenant_id)
        # The final usage: the cached count, then the one exit.
        ex.learn_cached(cached)
        ex.finish(Outcome.FINISHED, "length")
        seen["counter_settled"] = pool.queue.counter(tenant_id)
        seen["level_settled"] = level(rt, tenant_id)
        return ex

    return asyncio.run(main()), seen


def level(rt: Runtime, tenant_id: str) -> float:
    return rt.tenants.get(tenant_id).budgets.levels(rt.clock())[f"{BUDGET:g}/1d"]


@pytest.mark.parametrize("prompt_count", ["exact", "bound"])
def test_reserve_the_whole_prompt_settle_the_cached_part_at_its_price(
        tmp_path: Path, engine: EngineServer, prompt_count: str) -> None:
    tenant_id = f"t-{prompt_count}"
    rt = runtime(tmp_path, engine.url, prompt_count, tenant_id)
    try:
        before = metrics.child(metrics.CACHED_PROMPT_TOKENS, tenant_id, "default")._value.get()
        ex, seen = serve(rt, engine.url, tenant_id, cached=80, completion=4)
        full = 100 * 1.0 + 4 * 2.0
        discounted = 20 * 1.0 + 80 * 0.25 + 4 * 2.0  # 48
        # Reserved: the whole prompt (or its byte bound) at cost.prompt, and max_tokens.
        bound = 100 if prompt_count == "exact" else 1 + 99 + 1  # overhead + bytes + slack
        assert seen["reserved"] == bound * 1.0 + MAX_TOKENS * 2.0
        assert seen["level_admitted"] == BUDGET - seen["reserved"]
        # The fair queue: the prompt in full (at dispatch when counted, else at its first
        # usage), then the discount back once the final usage said what was cached.
        assert seen["counter_full"] == full
        assert seen["counter_settled"] == discounted
        # The budget settles to the discounted cost.
        assert seen["level_settled"] == BUDGET - discounted
        rt.ledger.flush()
        [row] = rt.ledger.rows()
        assert (row.prompt_tokens, row.cached_prompt_tokens, row.completion_tokens) == (100, 80, 4)
        assert row.cost == discounted and row.served
        after = metrics.child(metrics.CACHED_PROMPT_TOKENS, tenant_id, "default")._value.get()
        assert after - before == 80
        assert ex.cache_credited
    finally:
        rt.ledger.close()


@pytest.mark.parametrize("cached, charged", [
    (None, 100.0),  # the engine did not report it (no --enable-prompt-tokens-details)
    (0, 100.0),  # a miss
    (500, 25.0),  # more than the prompt: clamped to the prompt
])
def test_an_absent_or_odd_cached_count_charges_the_prompt_in_full_or_clamped(
        tmp_path: Path, engine: EngineServer, cached: int | None, charged: float) -> None:
    tenant_id = f"t-odd-{cached}"
    rt = runtime(tmp_path, engine.url, "exact", tenant_id)
    try:
        _, seen = serve(rt, engine.url, tenant_id, cached=cached, completion=0)
        assert math.isclose(seen["counter_settled"], charged)
        assert math.isclose(seen["level_settled"], BUDGET - charged)
        rt.ledger.flush()
        [row] = rt.ledger.rows()
        assert row.cached_prompt_tokens == min(cached or 0, 100) and row.cost == charged
    finally:
        rt.ledger.close()


def test_cached_prompt_defaulting_to_prompt_changes_nothing(
        tmp_path: Path, engine: EngineServer) -> None:
    rt = runtime(tmp_path, engine.url, "exact", "t-default", {"prompt": 1.0, "completion": 2.0})
    try:
        _, seen = serve(rt, engine.url, "t-default", cached=80, completion=4)
        assert seen["counter_settled"] == seen["counter_full"] == 108.0
        assert seen["level_settled"] == BUDGET - 108.0
        rt.ledger.flush()
        [row] = rt.ledger.rows()
        assert row.cached_prompt_tokens == 80 and row.cost == 108.0  # counted, not discounted
    finally:
        rt.ledger.close()
