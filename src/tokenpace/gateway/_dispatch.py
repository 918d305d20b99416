"""Where admitted requests wait for an engine slot, and who goes next.

A request may be dispatched when its engine is below ``max_inflight`` and its tenant below
``max_concurrency``; until then it waits here, in the gateway, where it can still be
reordered, timed out or cancelled for free. The order among waiters is first come, first
served, skipping waiters whose tenant is at its concurrency limit (so one saturated
tenant never blocks the others).

Routing pins each tenant to one engine by rendezvous hashing over the configured engine
URLs: the same tenant always lands on the same engine while the list is unchanged, so the
engine-side pacing quota of that identity is single, and adding an engine moves only the
tenants that now hash to it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from dataclasses import dataclass, field

import anyio

from . import _metrics as metrics
from ._config import EngineConfig
from ._tenants import TenantState


class QueueFull(Exception):
    """The tenant already has ``max_queued`` requests waiting."""


class EngineSlots:
    """One engine's capacity as the gateway sees it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.inflight = 0
        self.healthy = True
        self.waiting: deque[Waiter] = deque()

    @property
    def url(self) -> str:
        return self.config.url

    def has_room(self) -> bool:
        return self.inflight < self.config.max_inflight


@dataclass(eq=False)
class Waiter:
    tenant: TenantState
    engine: EngineSlots
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    granted: bool = False
    released: bool = False


class Dispatcher:
    def __init__(self, engines: list[EngineConfig]) -> None:
        self.engines = [EngineSlots(e) for e in engines]
        for engine in self.engines:
            metrics.ENGINE_INFLIGHT.labels(engine.url).set(0)

    def engine_for(self, tenant_id: str) -> EngineSlots:
        """The engine ``tenant_id`` is pinned to (highest rendezvous score)."""
        return max(self.engines, key=lambda e: _score(e.url, tenant_id))

    async def acquire(self, tenant: TenantState, engine: EngineSlots, timeout_s: float) -> Waiter:
        """Wait for a slot; raise ``QueueFull`` at once or ``TimeoutError`` after ``timeout_s``.

        On cancellation the waiter leaves the queue, or gives its slot back if it was
        granted in the same instant, so nothing leaks.
        """
        waiter = Waiter(tenant, engine)
        engine.waiting.append(waiter)
        tenant.queued += 1
        self._pump(engine)
        if waiter.granted:
            return waiter
        if tenant.config.max_queued is not None and tenant.queued > tenant.config.max_queued:
            self._remove(waiter)
            raise QueueFull()
        metrics.QUEUED.labels(tenant.id).set(tenant.queued)
        try:
            with anyio.fail_after(timeout_s):
                await waiter.future
        except BaseException:
            if waiter.granted:
                self.release(waiter)
            else:
                self._remove(waiter)
            raise
        return waiter

    def release(self, waiter: Waiter) -> None:
        """Give a dispatched request's slots back (idempotent) and dispatch the next."""
        if not waiter.granted or waiter.released:
            return
        waiter.released = True
        engine, tenant = waiter.engine, waiter.tenant
        engine.inflight -= 1
        tenant.inflight -= 1
        metrics.ENGINE_INFLIGHT.labels(engine.url).set(engine.inflight)
        metrics.INFLIGHT.labels(tenant.id).set(tenant.inflight)
        for other in self.engines:
            if other.waiting:
                self._pump(other)

    def _remove(self, waiter: Waiter) -> None:
        try:
            waiter.engine.waiting.remove(waiter)
        except ValueError:
            return
        waiter.tenant.queued -= 1
        metrics.QUEUED.labels(waiter.tenant.id).set(waiter.tenant.queued)

    def _pump(self, engine: EngineSlots) -> None:
        """Grant slots to waiters in arrival order while the engine has room."""
        if not engine.has_room():
            return
        kept: deque[Waiter] = deque()
        while engine.waiting:
            waiter = engine.waiting.popleft()
            tenant = waiter.tenant
            if not engine.has_room() or tenant.at_concurrency_limit():
                kept.append(waiter)
                continue
            waiter.granted = True
            tenant.queued -= 1
            tenant.inflight += 1
            engine.inflight += 1
            metrics.QUEUED.labels(tenant.id).set(tenant.queued)
            metrics.INFLIGHT.labels(tenant.id).set(tenant.inflight)
            if not waiter.future.done():
                waiter.future.set_result(None)
        engine.waiting = kept
        metrics.ENGINE_INFLIGHT.labels(engine.url).set(engine.inflight)


def _score(url: str, tenant_id: str) -> int:
    digest = hashlib.blake2b(f"{url}\x00{tenant_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
