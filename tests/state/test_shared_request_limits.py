"""``max_requests`` shared by replicas through a real ``redis-server``: two gateways'
admission stages, each with its own Redis client, count against one limit, and the 429's
request headers are exact from either (Redis's own clock; 3 per hour refills one request
per 1200 s, so the milliseconds between calls move no figure)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._redis import RedisServer, require_redis_client

require_redis_client()

from tokenpace.gateway import parse_config  # noqa: E402
from tokenpace.gateway.admission import Admission, admit  # noqa: E402
from tokenpace.gateway.wire import parse_request  # noqa: E402
from tokenpace.gateway.dispatch import Dispatcher  # noqa: E402
from tokenpace.gateway.wire import GatewayError  # noqa: E402
from tokenpace.gateway.ledger import open_ledger  # noqa: E402
from tokenpace.gateway.exchange import Runtime  # noqa: E402
from tokenpace.gateway.exchange import Exchange  # noqa: E402
from tokenpace.gateway.state import RedisStore  # noqa: E402
from tokenpace.gateway.tenants import Tenants  # noqa: E402

CLOSED = "http://127.0.0.1:1"  # no request here needs the engine


def _runtime(tmp_path: Path, name: str, redis_url: str) -> Runtime:
    config = parse_config({
        "engines": [CLOSED], "ledger": f"sqlite:///{tmp_path / f'{name}.db'}",
        "state": {"url": redis_url, "timeout": "1s"},
        "cost": {"prompt": 1.0, "completion": 1.0},
        "tenants": [{"id": "t", "api_keys": ["k"],
                     "max_requests": [{"requests": 3, "per": "1h"}],
                     "budgets": [{"tokens": 1000, "per": "1h"}]}],
    })
    clock = time.monotonic
    store = RedisStore(redis_url, timeout_s=1.0)
    return Runtime(config, Tenants(config, clock), Dispatcher(config, clock), {},
                   open_ledger(config.ledger), clock=clock, store=store)


async def _admit(rt: Runtime) -> Any:
    ex = Exchange(rt, "tpg-test", "completion", rt.tenants.get("t"), rt.clock(), time.time())
    req = parse_request("completion", {"model": "m", "prompt": [1], "max_tokens": 1})
    async with httpx.AsyncClient(base_url=CLOSED) as client:
        try:
            return await admit(rt, ex, req, client)
        except GatewayError as exc:
            return exc


def test_replicas_count_requests_against_one_limit(tmp_path: Path,
                                                   redis_server: RedisServer) -> None:
    async def body() -> None:
        a, b = (_runtime(tmp_path, name, redis_server.url) for name in ("a", "b"))
        try:
            results = [await _admit(rt) for rt in (a, b, a)]
            assert all(isinstance(r, Admission) for r in results), results
            for rt in (b, a):
                refused = await _admit(rt)
                assert isinstance(refused, GatewayError), refused
                assert (refused.status, refused.reason) == (429, "requests")
                h = refused.headers
                assert h["x-ratelimit-limit-requests"] == "3"
                assert h["x-ratelimit-remaining-requests"] == "0"
                assert h["retry-after"] in ("1199", "1200")  # one request: 1200 s, less elapsed
                reset = h["x-ratelimit-reset-requests"]  # 3 requests: 3600 s, less elapsed
                assert reset == "1h0m0s" or reset.startswith("59m59."), reset
        finally:
            for rt in (a, b):
                await rt.store.close()
                rt.ledger.close()

    asyncio.run(body())


def test_limits_in_observe_mode_are_shared_too_and_refuse_nothing(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """An observed ``max_requests`` of 1 per hour and an observed budget of 3 per hour,
    counted in Redis across two replicas; an enforced limit of the same figures would
    have its own key."""
    from tokenpace.gateway import metrics

    def runtime(name: str) -> Runtime:
        config = parse_config({
            "engines": [CLOSED], "ledger": f"sqlite:///{tmp_path / f'{name}.db'}",
            "state": {"url": redis_server.url, "timeout": "1s"},
            "cost": {"prompt": 1.0, "completion": 1.0},
            "tenants": [{"id": "obs", "api_keys": ["k"],
                         "max_requests": [{"requests": 1, "per": "1h", "mode": "observe"}],
                         "budgets": [{"tokens": 3, "per": "1h", "mode": "observe"}]}],
        })
        store = RedisStore(redis_server.url, timeout_s=1.0)
        return Runtime(config, Tenants(config, time.monotonic),
                       Dispatcher(config, time.monotonic), {}, open_ledger(config.ledger),
                       clock=time.monotonic, store=store)

    def count(reason: str) -> float:
        return metrics.REGISTRY.get_sample_value(
            "tokenpace_gateway_would_reject_total",
            {"tenant": "obs", "application": "", "reason": reason}) or 0.0

    async def body() -> None:
        a, b = runtime("a"), runtime("b")
        try:
            requests0, budget0 = count("requests"), count("budget")
            for rt in (a, b, a):  # each request costs 2: 1 prompt token + max_tokens 1
                ex = Exchange(rt, "tpg-test", "completion", rt.tenants.get("obs"), rt.clock(),
                              time.time())
                req = parse_request("completion", {"model": "m", "prompt": [1], "max_tokens": 1})
                async with httpx.AsyncClient(base_url=CLOSED) as client:
                    assert isinstance(await admit(rt, ex, req, client), Admission)
            assert count("requests") == requests0 + 2  # the 2nd and 3rd, on either replica
            assert count("budget") == budget0 + 2  # 2 of 3 taken by the first
            levels = await a.store.budget_levels("obs", [rt_spec for rt_spec in
                                                         a.config.tenants[0].observed_budgets])
            assert levels == {"observe:3/1h": pytest.approx(1.0, abs=0.01)}
        finally:
            for rt in (a, b):
                await rt.store.close()
                rt.ledger.close()

    asyncio.run(body())
