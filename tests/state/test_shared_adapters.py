"""LoRA adapters' whereabouts shared by replicas (``dispatch._adapter_share``), against a
real ``redis-server``: an adapter one replica loaded is where the others send its
requests, before any health check lists it; one replica never unloads an adapter another
has requests in flight for, until that replica's heartbeat stops; an unload by one is
known to the others."""

from __future__ import annotations

import asyncio
from typing import Any

from tests._redis import RedisServer, require_redis_client
from tests.state._replicas import Replica, with_replicas

require_redis_client()

from tokenpace.gateway import parse_config  # noqa: E402
from tokenpace.gateway.dispatch import Lease  # noqa: E402
from tokenpace.gateway.dispatch._adapter_share import ADAPTER_BUSY_S  # noqa: E402

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
TENANTS = [f"v{i}" for i in range(12)]


def config() -> Any:
    return parse_config({
        "engines": [{"url": u, "max_inflight": 16, "models": ["base"], "max_adapters": 1}
                    for u in URLS],
        "adapters": [{"name": n, "base": "base", "path": f"/adapters/{n}"} for n in "ab"],
        "tenants": [{"id": t, "api_keys": [f"k-{t}"]} for t in ["u", *TENANTS]],
        "ledger": "sqlite:///unused.db",
    })


async def grant(rep: Replica, adapter: str | None, tenant: str = "u") -> Lease:
    dispatcher, tenants, _ = rep
    cfg = None if adapter is None else dispatcher._config.adapter(adapter)
    return await dispatcher.lease(tenants.get(tenant), dispatcher.pools["base"], 10.0, 1.0,
                                  1.0, adapter=cfg).acquire()


async def busy_on(rep: Replica, url: str) -> Lease:
    """A request of some tenant that the pool's affinity sends to ``url``."""
    for tenant in TENANTS:
        lease = await grant(rep, None, tenant)
        if lease.engine.url == url:
            return lease
        lease.release()
    raise AssertionError(f"no tenant of {TENANTS} goes to {url}")


async def share(rep: Replica) -> None:
    """One round of the replica's adapter share, its words in Redis before it returns."""
    dispatcher, _, store = rep
    await dispatcher.adapter_share.sync(dispatcher._adapter_engines())
    await store.flush()


def engine(rep: Replica, url: str) -> Any:
    return next(e for e in rep[0].pools["base"].engines if e.url == url)


def test_replicas_agree_on_where_an_adapter_is_and_who_may_unload_it(
        redis_server: RedisServer) -> None:
    async def body(reps: list[Replica]) -> None:
        r0, r1 = reps
        # Replica 0: one engine busy with another request, adapter a goes to the other,
        # which loads it (as ``fleet.ensure_loaded`` does after the engine's 200).
        other = await busy_on(r0, URLS[0])
        first = await grant(r0, "a")
        assert first.engine.url == URLS[1]
        engine(r0, URLS[1]).adapters.loaded("a")
        await share(r0)
        # Replica 1 knows nothing of either request, and has one of its own on the engine
        # that holds a: by load it would load a on the other, yet a's request goes where
        # a is loaded.
        own = await busy_on(r1, URLS[1])
        await share(r1)
        assert "a" in engine(r1, URLS[1]).adapters
        assert "a" not in engine(r1, URLS[0]).adapters
        at_one = await grant(r1, "a")
        assert at_one.engine.url == URLS[1]
        at_one.release()
        own.release()
        # Replica 0 still has a request in flight for a: replica 1 would not unload a
        # there for b, even though its own requests for a ended.
        held = engine(r1, URLS[1]).adapters
        assert held.busy_elsewhere == {"a"}
        assert held.victim(keep="b") is None
        # That request ends: a is idle everywhere, replica 1's victim.
        first.release()
        other.release()
        await share(r0)
        await share(r1)
        assert held.victim(keep="b") == "a"
        # Replica 1 unloads it: replica 0 knows, and loads it again before sending more.
        held.unloaded("a")
        await share(r1)
        await share(r0)
        assert "a" not in engine(r0, URLS[1]).adapters
    with_replicas(redis_server, config, body)


def test_a_stopped_replicas_adapters_are_free_after_its_heartbeats_stop(
        redis_server: RedisServer) -> None:
    async def body(reps: list[Replica]) -> None:
        r0, r1 = reps
        lease = await grant(r0, "a")
        engine(r0, lease.engine.url).adapters.loaded("a")
        await share(r0)
        await share(r1)
        held = engine(r1, lease.engine.url).adapters
        assert held.victim(keep="b") is None, "a has a request in flight at replica 0"
        # Replica 0 stops sharing (a replica killed with the request in flight).
        await r0[0].adapter_share.close()
        await asyncio.sleep(ADAPTER_BUSY_S + 0.2)
        await share(r1)
        assert held.victim(keep="b") == "a"
        lease.release()
    with_replicas(redis_server, config, body)
