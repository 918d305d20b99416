"""Where admitted requests wait for an engine, and who goes next.

Requests wait here, in the gateway, rather than in the engine: here they can still be
reordered, timed out or cancelled for free, and this is where fairness is decided. A
request is dispatched when its engine has room (below ``max_inflight`` and, when its
``/metrics`` are reachable, not already queueing or out of KV cache) and its tenant is
below ``max_concurrency``. Which waiting request goes next is the fair queue's choice
(``fairness.FairQueue``: lanes in priority order with a minimum share, weighted VTC inside
a lane, FIFO inside a tenant).

Routing pins each tenant to one engine by rendezvous hashing over the configured engine
URLs, so the engine-side pacing quota of that identity is single and adding an engine
moves only the tenants that now hash to it. When the pinned engine is down its requests
fail fast; with ``repin_after`` set, a tenant whose engine has been down that long moves to
the next engine in its rendezvous order (the drain period lets the old engine finish or
drop what it held before the identity is paced somewhere else).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field


from ..fairness import FairQueue, LaneSpec
from . import _metrics as metrics
from ._config import EngineConfig, GatewayConfig
from ._state import Reservation
from ._tenants import TenantState


class QueueFull(Exception):
    """The tenant already has ``max_queued`` requests waiting; ``waiting``: how many wait
    on every replica together (shared slots), None in process."""

    def __init__(self, waiting: int | None = None) -> None:
        super().__init__(waiting)
        self.waiting = waiting


class EngineSlots:
    """One engine's capacity as the gateway sees it, and its queue of waiting requests.

    The saturation gate holds requests here while more would only queue inside the engine.
    Two signals, because each alone fails:

    - The gateway's own count. With the engine's capacity known (``max_num_seqs``
      configured, or learned from two readings in a row that show requests waiting beside
      the same running count), at most capacity + ``max_engine_waiting`` of the gateway's
      requests are in the engine at once: a burst larger than the engine can run waits here,
      where the fair queue orders it, and a burst that fits goes at once.
    - The engine's own waiting count, polled from its ``/metrics``, for load the gateway does
      not see (other clients, other gateway replicas). A reading is stale: it counts the
      gateway's fresh dispatches as "waiting" until the engine's next step admits them (a
      burst would hold itself back until a later poll), so the requests the gateway
      dispatched between the two last readings are not counted against it. vLLM's running
      gauge is not used for load: it keeps its last value while the engine is idle.

    While the gate holds requests it sets ``held``, and the poller reads the gauges again
    within tens of milliseconds (backing off while the engine stays full).
    """

    def __init__(self, config: EngineConfig, queue: FairQueue[Waiter]) -> None:
        self.config = config
        self.inflight = 0
        self.healthy = True
        self.down_since: float | None = None
        self.engine_waiting: float | None = None  # from the engine's /metrics
        self.engine_running: float | None = None
        self.kv_cache_usage: float | None = None
        self.learned_capacity: int | None = None
        self.queue = queue
        self.held = asyncio.Event()  # set while the gate holds requests: poll sooner
        self.inflight_gauge = metrics.ENGINE_INFLIGHT.labels(config.url)  # bound once
        self._dispatched_since_reading = 0
        self._fresh_at_reading = 0  # dispatched between the previous reading and the last

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def capacity(self) -> int | None:
        """Requests the engine runs at once (configured, else learned; None: unknown)."""
        return self.config.max_num_seqs or self.learned_capacity

    def record_reading(self, running: float | None, waiting: float | None,
                       kv_usage: float | None) -> None:
        """A fresh reading of the engine's gauges (None: not reported)."""
        if running is not None and waiting and self.engine_waiting and running == self.engine_running \
                and not self._kv_full(kv_usage):
            # Requests waited across two polls beside the same running count: that is the
            # engine's limit, not a burst between two scheduler steps.
            self.learned_capacity = max(self.learned_capacity or 0, int(running))
        if running is not None and self.learned_capacity is not None:
            self.learned_capacity = max(self.learned_capacity, int(running))
        self.engine_running, self.engine_waiting, self.kv_cache_usage = running, waiting, kv_usage
        self._fresh_at_reading = self._dispatched_since_reading
        self._dispatched_since_reading = 0

    def dispatched(self) -> None:
        self.inflight += 1
        self._dispatched_since_reading += 1

    def _kv_full(self, kv_usage: float | None) -> bool:
        limit = self.config.max_kv_cache_usage
        return limit is not None and kv_usage is not None and kv_usage >= limit

    def saturated(self) -> bool:
        """More work now would only queue inside the engine (or its KV cache is full)."""
        if self._kv_full(self.kv_cache_usage):
            return True
        limit = self.config.max_engine_waiting
        if limit is None:
            return False
        capacity = self.capacity
        if capacity is not None and self.inflight + 1 > capacity + limit:
            return True
        waiting = self.engine_waiting
        return waiting is not None and waiting - self._fresh_at_reading > limit

    def has_room(self) -> bool:
        return self.inflight < self.config.max_inflight and not self.saturated()


@dataclass(eq=False)
class Waiter:
    tenant: TenantState
    engine: EngineSlots
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    granted: bool = False
    released: bool = False


class Lease:
    """One request's slot on an engine, from the wait for it to its release.

    ``async with dispatcher.lease(...)`` holds the slot for a block and gives it back however
    the block ends (exception, cancellation). A request whose response outlives its handler
    (a stream relayed after ``handle`` returned) calls ``acquire`` and ``release`` itself:
    ``Exchange.finish`` releases. ``acquire`` leaves nothing behind when it fails or is
    cancelled, and ``release`` is idempotent, so a slot cannot leak or be freed twice.
    """

    def __init__(self, dispatcher: Dispatcher, tenant: TenantState, engine: EngineSlots,
                 timeout_s: float, prompt_cost: float, estimate: float) -> None:
        self._dispatcher = dispatcher
        self.tenant, self.engine = tenant, engine
        self._wait = (timeout_s, prompt_cost, estimate)
        self.waiter: Waiter | None = None  # set once granted

    async def acquire(self) -> Lease:
        """Wait for the slot; raise ``QueueFull`` at once or ``TimeoutError`` after the
        timeout (see ``Dispatcher.acquire``)."""
        timeout_s, prompt_cost, estimate = self._wait
        self.waiter = await self._dispatcher.acquire(self.tenant, self.engine, timeout_s,
                                                     prompt_cost, estimate)
        return self

    def charge(self, cost: float) -> None:
        """Service received (cost units), for the fair queue's counter."""
        if self.waiter is not None:
            self._dispatcher.charge(self.waiter, cost)

    def release(self, settle: tuple[Reservation, float] | None = None) -> bool:
        """Give the slot back (idempotent; nothing to do before it was granted).

        ``settle``: a budget reservation of the shared store and the actual cost, settled in
        the same store call as the release when the slot is a shared lease (one round trip
        instead of two). True when it was taken; otherwise the caller settles it.
        """
        if self.waiter is not None:
            return self._dispatcher.release(self.waiter, settle)
        return False

    async def __aenter__(self) -> Lease:
        return await self.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


class Dispatcher:
    def __init__(self, config: GatewayConfig, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.engines = [
            EngineSlots(e, FairQueue(_lane_specs(config), clock, config.lane_share_window_s,
                                     fair=config.dispatch_order == "vtc"))
            for e in config.engines
        ]
        self.repin_after_s = config.repin_after_s
        self._states: dict[str, TenantState] = {}
        # tenant -> engines in rendezvous order. The order depends only on the engine URLs
        # (fixed for a dispatcher) and the tenant id; health and the clock decide among them
        # in engine_for, so health changes need not (but do) clear it; reloads clear it so a
        # removed tenant's entry goes.
        self._ranked: dict[str, list[EngineSlots]] = {}
        self.configure(config)
        for engine in self.engines:
            engine.inflight_gauge.set(0)

    def configure(self, config: GatewayConfig) -> None:
        """Apply (re)loaded lanes, tenant lanes and weights to every engine's queue."""
        self.repin_after_s = config.repin_after_s
        self._ranked.clear()
        lanes = _lane_specs(config)
        for engine in self.engines:
            engine.queue.set_lanes(lanes)
            engine.queue.fair = config.dispatch_order == "vtc"
            for tenant in config.tenants:
                engine.queue.set_tenant(tenant.id, tenant.lane, tenant.weight)

    # -- routing ---------------------------------------------------------------------

    def engine_for(self, tenant_id: str) -> EngineSlots:
        """The engine ``tenant_id`` is pinned to (highest rendezvous score), or with
        ``repin_after`` the first healthy one in score order once it has been down that long."""
        ranked = self._ranked.get(tenant_id)
        if ranked is None:  # one hash per engine and a sort: once per tenant, not per request
            ranked = sorted(self.engines, key=lambda e: _score(e.url, tenant_id), reverse=True)
            self._ranked[tenant_id] = ranked
        first = ranked[0]
        if first.healthy or self.repin_after_s is None or first.down_since is None \
                or self._clock() - first.down_since < self.repin_after_s:
            return first
        return next((e for e in ranked[1:] if e.healthy), first)

    def set_health(self, engine: EngineSlots, healthy: bool) -> None:
        if healthy == engine.healthy:
            return
        engine.healthy = healthy
        self._ranked.clear()
        engine.down_since = None if healthy else self._clock()
        if healthy:
            self._pump(engine)

    def set_load(self, engine: EngineSlots, waiting: float | None, kv_usage: float | None,
                 running: float | None = None) -> None:
        """Saturation gauges read from the engine's /metrics (None: not reported)."""
        engine.record_reading(running, waiting, kv_usage)
        self._pump(engine)

    # -- waiting and dispatch ----------------------------------------------------------

    async def acquire(self, tenant: TenantState, engine: EngineSlots, timeout_s: float,
                      prompt_cost: float, estimate: float) -> Waiter:
        """Wait for a slot; raise ``QueueFull`` at once or ``TimeoutError`` after ``timeout_s``.

        On cancellation the waiter leaves the queue, or gives its slot back if it was
        granted in the same instant, so nothing leaks.
        """
        waiter = Waiter(tenant, engine)
        self._states[tenant.id] = tenant
        engine.queue.push(waiter, tenant.id, prompt_cost, estimate)
        tenant.queued += 1
        self._pump(engine)
        if waiter.granted:
            return waiter
        if tenant.config.max_queued is not None and tenant.queued > tenant.config.max_queued:
            self._remove(waiter)
            raise QueueFull()
        metrics.child(metrics.QUEUED, tenant.id).set(tenant.queued)
        async with asyncio.timeout(timeout_s):
            await self._wait(waiter)
        return waiter

    async def _wait(self, waiter: Waiter) -> None:
        """Wait for ``waiter``'s grant. If the wait ends otherwise (timeout, cancellation),
        give back the slot granted in the same instant, or leave the queue: nothing leaks."""
        try:
            await waiter.future
        except BaseException:
            if waiter.granted:
                self.release(waiter)
            else:
                self._remove(waiter)
            raise

    def lease(self, tenant: TenantState, engine: EngineSlots, timeout_s: float,
              prompt_cost: float, estimate: float) -> Lease:
        """A slot on ``engine`` for one request of ``tenant``, not yet waited for."""
        return Lease(self, tenant, engine, timeout_s, prompt_cost, estimate)

    def charge(self, waiter: Waiter, cost: float) -> None:
        """Service a dispatched request received (output tokens as the stream reports them)."""
        waiter.engine.queue.charge(waiter.tenant.id, cost)

    def release(self, waiter: Waiter, settle: tuple[Reservation, float] | None = None) -> bool:
        """Give a dispatched request's slots back (idempotent) and dispatch the next.
        In process there is no store call to settle ``settle`` with: False."""
        if not waiter.granted or waiter.released:
            return False
        waiter.released = True
        engine, tenant = waiter.engine, waiter.tenant
        engine.inflight -= 1
        tenant.inflight -= 1
        engine.inflight_gauge.set(engine.inflight)
        metrics.child(metrics.INFLIGHT, tenant.id).set(tenant.inflight)
        for other in self.engines:  # the tenant's concurrency may unblock any queue
            if len(other.queue):
                self._pump(other)
        return False

    def _remove(self, waiter: Waiter) -> None:
        if waiter.engine.queue.remove(waiter):
            waiter.tenant.queued -= 1
            metrics.child(metrics.QUEUED, waiter.tenant.id).set(waiter.tenant.queued)

    def _pump(self, engine: EngineSlots) -> None:
        """Dispatch the fair queue's choices while the engine has room."""
        while engine.has_room():
            waiter = engine.queue.pop(self._may_dispatch)
            if waiter is None:
                break
            tenant = waiter.tenant
            waiter.granted = True
            tenant.queued -= 1
            tenant.inflight += 1
            engine.dispatched()
            metrics.child(metrics.QUEUED, tenant.id).set(tenant.queued)
            metrics.child(metrics.INFLIGHT, tenant.id).set(tenant.inflight)
            if not waiter.future.done():
                waiter.future.set_result(None)
        if len(engine.queue) and engine.inflight < engine.config.max_inflight and engine.saturated():
            engine.held.set()  # ask for a fresh reading: the one that closed the gate may be stale
        engine.inflight_gauge.set(engine.inflight)

    def _may_dispatch(self, tenant_id: str) -> bool:
        state = self._states.get(tenant_id)
        return state is not None and not state.at_concurrency_limit()

    async def close(self) -> None:
        """Stop background work (none in process; see ``SharedDispatcher``)."""

    def publish(self) -> None:
        """Refresh the fairness gauges (called when /metrics is scraped)."""
        lane_cost: dict[str, float] = {}
        for engine in self.engines:
            for lane, cost in engine.queue.lane_costs().items():
                lane_cost[lane] = lane_cost.get(lane, 0.0) + cost
        total = sum(lane_cost.values())
        for lane, cost in lane_cost.items():
            metrics.LANE_SHARE.labels(lane).set(cost / total if total else 0.0)
        for tenant_id in self._states:
            engine = self.engine_for(tenant_id)
            metrics.child(metrics.FAIRNESS_DEBT, tenant_id).set(engine.queue.debt(tenant_id))
            metrics.child(metrics.QUEUED_COST, tenant_id).set(
                sum(e.queue.queued(tenant_id)[1] for e in self.engines))


def _lane_specs(config: GatewayConfig) -> list[LaneSpec]:
    return [LaneSpec(lane.name, lane.priority, lane.min_share) for lane in config.lanes]


def _score(url: str, tenant_id: str) -> int:
    digest = hashlib.blake2b(f"{url}\x00{tenant_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
