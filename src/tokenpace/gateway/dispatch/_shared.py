"""Dispatch when several gateway replicas share their slots and fair-queue counters.

With ``state: redis://...`` a tenant's ``max_concurrency`` and ``max_queued`` and each
engine's ``max_inflight`` are global: every replica counts the same slots, held in the
state store as leases that the store renews while the request runs (a replica that dies
gives its slots back within ``state.lease``; a request that ends, is cancelled or fails
gives them back at once). The in-process :class:`Dispatcher` stays the single-replica path,
untouched: nothing here runs without a shared store.

How a request gets its slot (round trips to the store in brackets):

- Nobody waits on this replica for the engine and the tenant is not known to be at its
  limit: take the engine slot and the tenant's running slot in one step [1]. Uncontended,
  that is the only call before the engine; release is one more, off the request's path.
- Otherwise the request takes a queued place (the global ``max_queued``; the tenant's
  shared VTC counter is lifted if it was not backlogged anywhere) [1] and waits in this
  replica's fair queue. The fair queue chooses which local waiter goes next, by the shared
  counters; the chosen one trades its queued place for the running slots in one step [1].
- If another replica holds the slots (the store refuses), the waiter stays queued: a tenant
  refused its running slot is skipped for ``SHARED_POLL_S`` while the others are tried, an
  engine refused stops the round. The round runs again when a request of this replica
  releases its slots, or after ``SHARED_POLL_S`` (25 ms) while requests wait and the engine
  has room here: a replica never loops on the store, at most one round per poll interval.
  Releases on other replicas are therefore seen within 25 ms (plus one round trip).
  With several engines in a pool, an engine the store refuses is skipped for
  ``SHARED_POLL_S`` and the round goes on with the pool's other engines.

Fairness: service (prompt cost at dispatch, output tokens as they stream) is charged to the
local queue and to the store (batched: the store sends charges every 50 ms). Every
dispatch's estimate counts in the store's lane shares, per pool (model) and lane: in the
dispatch script for a request that waited, with the next 50 ms flush for one that went
uncontended (only with two or more lanes configured). Before a dispatch choice the local
queues adopt, in one pipeline [1] at most every ``COUNTER_REFRESH_S``, the store's counters
of the tenants waiting here (lanes where two or more wait) and, for a pool where two
lanes wait and the lower one has a ``min_share``, every replica's lane costs in that pool
over ``lane_share_window``; between two reads a queue adds its own dispatches to what it
adopted. So a lane starved on all replicas together is promoted on each, also where its
share of that replica's own dispatches looks fine. With one lane, or one lane waiting,
nothing more is read than the counters. If the store does not answer, each queue goes by
its own counters and its own window until it does.

Store calls that may return a slot are shielded from the request's cancellation: a lease
granted to a request that was cancelled meanwhile is released as soon as it arrives.
``on_state_failure: closed``: a request that cannot get its slots because the store does
not answer fails with ``StateUnavailable`` (503 with ``retry-after``); ``open``: the store
itself decides under per-replica limits (each limit / replicas), and leases taken that way
are given back to the in-process fallback that granted them, also after Redis returns.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from .. import metrics
from ..config import AdapterConfig, GatewayConfig
from ..state import (
    Admission,
    StoreLease,
    Reservation,
    SlotClaim,
    SlotRefusal,
    StateStore,
    StateUnavailable,
    engine_slot,
    lane_share_key,
    queued_slot,
    running_slot,
)
from ..tenants import ApplicationState, TenantState, dispatched
from ..fleet import EngineSlots
from ._adapter_share import AdapterShare
from ._dispatcher import Dispatcher, Pool, QueueFull, Waiter

logger = logging.getLogger("tokenpace.gateway")

T = TypeVar("T")

SHARED_POLL_S = 0.025
"""How soon a replica asks the store again for slots another replica held (and the most
often it does: one dispatch round per engine per interval while requests wait)."""

HOME_TTL_S = 600.0
"""How long the store keeps a conversation's engine after its last turn (every turn's read
renews it): one idle longer is placed again as a new conversation, by which time busy
engines have most likely evicted its prefix anyway."""

COUNTER_REFRESH_S = 0.05
"""Longest age of the shared VTC counters and lane costs a dispatch decision uses (the
store's flush interval: fresher reads would see little new)."""


@dataclass(eq=False)
class SharedWaiter(Waiter):
    """A waiter whose slots are leases in the shared store."""

    prompt_cost: float = 0.0
    estimate: float = 0.0
    queued: StoreLease | None = None  # its queued place while it waits
    running: StoreLease | None = None  # its engine and tenant slots once granted


class SharedDispatcher(Dispatcher):
    """The dispatcher of one replica among several sharing ``store``."""

    def __init__(self, config: GatewayConfig, clock: Callable[[], float],
                 store: StateStore) -> None:
        self.store = store
        self.adapter_share = AdapterShare(store)
        self._lane_names: list[str] = []
        self._share_window_s = config.lane_share_window_s
        super().__init__(config, clock)
        self._blocked: dict[str, float] = {}  # tenant -> until when its global slots are full
        self._full: dict[EngineSlots, float] = {}  # engine -> until when other replicas fill it
        self._pumping: set[Pool] = set()
        self._again: set[Pool] = set()
        self._polls: dict[Pool, asyncio.TimerHandle] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._counters_at = -math.inf
        self._shares_at: dict[Pool, float] = {}  # when each queue adopted shared costs

    def configure(self, config: GatewayConfig) -> None:
        super().configure(config)
        self._lane_names = [lane.name for lane in config.lanes]
        self._share_window_s = config.lane_share_window_s
        for pool in self.pools.values():
            pool.queue.lift = False  # the store lifts, over every replica's backlog

    def forget(self, engine: EngineSlots) -> None:
        self._full.pop(engine, None)

    def _new_queue(self) -> Any:
        queue = super()._new_queue()
        queue.lift = False
        return queue

    # -- claims ------------------------------------------------------------------------

    @staticmethod
    def _claims(tenant: TenantState, engine: EngineSlots,
                application: ApplicationState | None = None) -> list[SlotClaim]:
        claims = [engine_slot(engine.url, engine.config.max_inflight),
                  running_slot(tenant.id, tenant.config.max_concurrency)]
        if application is not None and application.config.max_concurrency is not None:
            # An application's max_concurrency is global too: its own running slots.
            claims.append(running_slot(application.owner, application.config.max_concurrency))
        return claims

    def _may_dispatch(self, tenant_id: str) -> bool:
        state = self._states.get(tenant_id)
        if state is None or state.at_concurrency_limit():
            return False
        until = self._blocked.get(tenant_id)
        return until is None or until <= self._clock()

    def _may_dispatch_application(self, tenant_id: str, application_id: str) -> bool:
        state = self._states.get(tenant_id)
        app = None if state is None else state.applications.get(application_id)
        if app is None:
            return True
        if app.at_concurrency_limit():
            return False
        until = self._blocked.get(app.owner)
        return until is None or until <= self._clock()

    def _open(self, engine: EngineSlots) -> bool:
        until = self._full.get(engine)
        return engine.has_room() and (until is None or until <= self._clock())

    def _refused(self, refusal: SlotRefusal, tenant: TenantState, engine: EngineSlots) -> None:
        """Note a refusal: the tenant's slots or the engine's are held by other replicas;
        either is skipped for ``SHARED_POLL_S``."""
        if refusal.claim.key.startswith("running:"):
            # The tenant's slots, or its application's (``running:<owner>``).
            self._blocked[refusal.claim.key[len("running:"):]] = self._clock() + SHARED_POLL_S
        else:
            self._full[engine] = self._clock() + SHARED_POLL_S

    # -- waiting -----------------------------------------------------------------------

    async def acquire(self, tenant: TenantState, pool: Pool, timeout_s: float,
                      prompt_cost: float, estimate: float,
                      application: ApplicationState | None = None,
                      ahead: bool = False, affinity: bytes | None = None,
                      adapter: AdapterConfig | None = None) -> Waiter:
        """Wait for the global slots; raise ``QueueFull`` at once, ``TimeoutError`` after
        ``timeout_s``, ``StateUnavailable`` when the store does not answer (closed).
        ``ahead``: a request sent back by a failed engine (``Lease.again``): first in its
        tenant's order, and not held to ``max_queued`` (it was admitted)."""
        waiter = SharedWaiter(tenant, pool, application, affinity=affinity, adapter=adapter,
                              prompt_cost=prompt_cost, estimate=estimate)
        app_id = None if application is None else application.id
        self._states[tenant.id] = tenant
        self._declare(pool.queue, tenant)
        with anyio.fail_after(timeout_s):
            if affinity is not None and self.by_conversation(tenant, pool):
                await self._read_home(tenant.id, pool, affinity)
            if adapter is not None and not self.adapter_share.ready.is_set():
                # The first adapter request: what the other replicas said first (once).
                self.adapter_share.start(self._adapter_engines)
                await self.adapter_share.ready.wait()
            engine = (self.choose(tenant, pool, affinity, adapter)
                      if not len(pool.queue) and self._may_dispatch(tenant.id)
                      and (app_id is None or self._may_dispatch_application(tenant.id, app_id))
                      else None)
            if engine is not None:
                result = await self._call(self.store.acquire(
                    self._claims(tenant, engine, application)))
                if isinstance(result, StoreLease):
                    # Through the queue's books as if popped: the prompt's charge on the
                    # tenant's counter, the estimate in the lane's share; in the store's
                    # lane shares with its next flush (no round trip; one lane: no shares).
                    pool.queue.push(waiter, tenant.id, prompt_cost, estimate, app_id)
                    pool.queue.take(waiter)
                    if len(self._lane_names) > 1:
                        self.store.count_dispatch(
                            lane_share_key(pool.model, tenant.config.lane), estimate)
                    waiter.engine = engine
                    self._grant(waiter, result)
                    return waiter
                self._refused(result, tenant, engine)
            lane = tenant.config.lane
            admitted = await self._call(self.store.admit(
                tenant.id, (), 0.0,
                queued_slot(tenant.id, None if ahead else tenant.config.max_queued), lane))
            if isinstance(admitted, SlotRefusal):
                raise QueueFull(admitted.held)
            assert isinstance(admitted, Admission)
            waiter.queued = admitted.queued
            for other in self.pools.values():  # the store's lift, on every queue it uses
                other.queue.set_counters({tenant.id: admitted.counter})
            pool.queue.push(waiter, tenant.id, prompt_cost, estimate, app_id, ahead=ahead)
            tenant.queued += 1
            metrics.child(metrics.QUEUED, tenant.id).set(tenant.queued)
            self._kick(pool)
            await self._wait(waiter)
        return waiter

    async def _read_home(self, tenant: str, pool: Pool, affinity: bytes) -> None:
        """Adopt the engine the store says conversation ``affinity`` runs on (another
        replica may have placed or moved it): one round trip per turn (GETEX; ~0.2 ms on
        this project's loaded CI box, docs/benchmarks/state.md), the price of every replica making the same choice. A store that
        does not answer leaves this replica's own table as the answer."""
        try:
            url = await self.store.home_read(affinity.hex(), HOME_TTL_S)
        except StateUnavailable:
            return
        if url is not None and url != self._homes.get(tenant, affinity) \
                and any(e.url == url for e in pool.engines):
            self._homes.put(tenant, affinity, url)

    def _adapter_engines(self) -> list[EngineSlots]:
        """The engines of the pools that serve adapters (their bases')."""
        bases = {a.base for a in self._config.adapters}
        return [e for model, pool in self.pools.items() if model in bases
                for e in pool.engines]

    def _remember_home(self, tenant: str, affinity: bytes, engine: EngineSlots) -> str | None:
        """As in process; a home that is new or moved goes to the store for every replica
        (with its next flush: no round trip)."""
        previous = super()._remember_home(tenant, affinity, engine)
        if previous != engine.url:
            self.store.home_write(affinity.hex(), engine.url, HOME_TTL_S)
        return previous

    async def _call(self, call: Awaitable[T]) -> T:
        """A store call that may grant a lease, shielded from the caller's cancellation: a
        lease that arrives for a caller gone meanwhile is released at once."""
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._orphaned)
            raise

    def _orphaned(self, task: asyncio.Future[Any]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        result = task.result()
        lease = result.queued if isinstance(result, Admission) else result
        if isinstance(lease, StoreLease):
            self._spawn(self._release_lease(lease))

    def _grant(self, waiter: SharedWaiter, lease: StoreLease) -> None:
        tenant, engine = waiter.tenant, waiter.engine
        assert engine is not None
        waiter.running = lease
        waiter.granted = True
        self._note_turn(waiter)
        tenant.inflight += 1
        dispatched(tenant, self._clock())
        if waiter.application is not None:
            waiter.application.inflight += 1
            dispatched(waiter.application, self._clock())
        waiter.in_reserve = engine.dispatched(tenant.id)
        if waiter.prompt_cost:
            self.store.charge(tenant.config.lane, tenant.id,
                              waiter.prompt_cost / tenant.config.weight)
        metrics.child(metrics.INFLIGHT, tenant.id).set(tenant.inflight)
        engine.inflight_gauge.set(engine.inflight)
        if not waiter.future.done():
            waiter.future.set_result(None)

    def charge(self, waiter: Waiter, cost: float) -> None:
        """Service received: on this replica's queue now, on the shared counter with the
        store's next flush (no round trip per token)."""
        super().charge(waiter, cost)
        tenant = waiter.tenant
        self.store.charge(tenant.config.lane, tenant.id, cost / tenant.config.weight)

    def release(self, waiter: Waiter, settle: tuple[Reservation, float] | None = None) -> bool:
        """Give the slots back (idempotent): the store's leases in the background, with
        ``settle``'s reservation settled in the same call; then this replica's waiters get
        their turn. True: ``settle`` was taken."""
        if not waiter.granted or waiter.released:
            return False
        waiter.released = True
        engine, tenant = waiter.engine, waiter.tenant
        assert engine is not None
        engine.released(tenant.id, waiter.in_reserve)
        if waiter.adapter is not None:
            engine.adapters.done(waiter.adapter.name)
        tenant.inflight -= 1
        if waiter.application is not None:
            waiter.application.inflight -= 1
        engine.inflight_gauge.set(engine.inflight)
        metrics.child(metrics.INFLIGHT, tenant.id).set(tenant.inflight)
        assert isinstance(waiter, SharedWaiter) and waiter.running is not None
        self._spawn(self._give_back(waiter.running, tenant.id, settle, waiter.application))
        return settle is not None

    async def _give_back(self, lease: StoreLease, tenant_id: str,
                         settle: tuple[Reservation, float] | None,
                         application: ApplicationState | None = None) -> None:
        # The waiters are woken after the store has the slots back, or they would be
        # refused the slots this request still holds there and wait for the next poll.
        try:
            if settle is None:
                await self.store.release(lease)
            else:  # one script for both (a failure leaves the reservation charged)
                await self.store.finish(lease, *settle)
        except StateUnavailable:
            pass  # the lease expires with its lease time
        self._blocked.pop(tenant_id, None)
        if application is not None:
            self._blocked.pop(application.owner, None)
        for pool in self.pools.values():
            if len(pool.queue):
                self._kick(pool)

    async def _release_lease(self, lease: StoreLease) -> None:
        try:
            await self.store.release(lease)
        except StateUnavailable:
            pass  # it expires with its lease time

    def _remove(self, waiter: Waiter) -> None:
        super()._remove(waiter)
        assert isinstance(waiter, SharedWaiter)
        if waiter.queued is not None and not waiter.queued.released:
            self._spawn(self._release_lease(waiter.queued))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Stop polls, background rounds and the adapter share (the store's leases expire
        with its lease time if their releases did not go out)."""
        await self.adapter_share.close()
        for handle in self._polls.values():
            handle.cancel()
        self._polls.clear()
        # Releases and settlements under way finish (each is bounded by the store's
        # timeout); what is still running after a second is cancelled.
        if self._background:
            await asyncio.wait(list(self._background), timeout=1.0)
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # -- dispatch ------------------------------------------------------------------------

    def _pump(self, pool: Pool) -> None:
        self._kick(pool)

    def _kick(self, pool: Pool) -> None:
        """Run a dispatch round for ``pool`` (one at a time; a kick during a round asks
        for another)."""
        if pool in self._pumping:
            self._again.add(pool)
            return
        self._pumping.add(pool)
        self._spawn(self._rounds(pool))

    async def _rounds(self, pool: Pool) -> None:
        try:
            while True:
                self._again.discard(pool)
                await self._round(pool)
                if pool not in self._again:
                    break
        except Exception:
            logger.exception("dispatch round for model %s failed", pool.model)
        finally:
            self._pumping.discard(pool)
        if not len(pool.queue):
            return
        for engine in pool.engines:
            if engine.inflight < engine.config.max_inflight and engine.saturated():
                engine.held.set()  # ask for a fresh reading, as the in-process pump does
        if pool not in self._polls and any(e.accepts and e.has_room() for e in pool.engines):
            # Requests wait while this replica has room: the store refused (other replicas
            # hold the slots) or a tenant is blocked. Ask again after the poll interval.
            self._polls[pool] = asyncio.get_running_loop().call_later(
                SHARED_POLL_S, self._poll, pool)

    def _poll(self, pool: Pool) -> None:
        self._polls.pop(pool, None)
        self._kick(pool)

    async def _round(self, pool: Pool) -> None:
        """Dispatch the fair queue's choices while the store grants their slots."""
        eligible, placed, skip = self._eligibility(pool)
        while any(e.accepts and self._open(e) for e in pool.engines):
            if self._stale(pool):
                await self._refresh()
            placed.clear()
            waiter = pool.queue.peek(eligible, self._may_dispatch_application)
            if waiter is None:
                break
            assert isinstance(waiter, SharedWaiter) and waiter.queued is not None
            tenant = waiter.tenant
            engine = self.engine_of(waiter, placed)
            if engine is None:  # waits for its adapter's engine: its tenant sits this round out
                skip.add(tenant.id)
                continue
            try:
                result = await self.store.dispatch(
                    self._claims(tenant, engine, waiter.application), waiter.queued,
                    lane_share_key(pool.model, tenant.config.lane), waiter.estimate)
            except StateUnavailable as exc:
                # on_state_failure: closed: this request cannot get its slots; 503.
                if pool.queue.remove(waiter):
                    tenant.queued -= 1
                    metrics.child(metrics.QUEUED, tenant.id).set(tenant.queued)
                    self._spawn(self._release_lease(waiter.queued))
                    waiter.future.set_exception(exc)
                continue
            if isinstance(result, SlotRefusal):
                self._refused(result, tenant, engine)
                continue
            if not pool.queue.take(waiter):  # it left (timeout, client gone) meanwhile
                self._spawn(self._release_lease(result))
                continue
            tenant.queued -= 1
            metrics.child(metrics.QUEUED, tenant.id).set(tenant.queued)
            waiter.engine = engine
            self._grant(waiter, result)

    def _stale(self, pool: Pool) -> bool:
        """Whether the next choice for ``pool`` needs a fresher reading of the store:
        the counters are older than ``COUNTER_REFRESH_S``, or the lane shares matter for
        this queue and its adopted lane costs are that old (or there are none)."""
        now = self._clock()
        if now - self._counters_at >= COUNTER_REFRESH_S:
            return True
        return now - self._shares_at.get(pool, -math.inf) >= COUNTER_REFRESH_S \
            and pool.queue.shares_matter()

    async def _refresh(self) -> None:
        """Adopt what every replica did, in one pipeline [1]: the shared counters of the
        tenants waiting here (in each lane where two or more wait: with one there is no
        choice), and, for each pool whose next choice may depend on the lane shares (two
        lanes waiting, one below the first with a ``min_share``), every replica's
        dispatched cost per lane in that pool. At most once per ``COUNTER_REFRESH_S``,
        twice when lanes start to compete in between; none while nothing waits. Redis
        sums the window's seconds per lane: O(lanes x window seconds) per read."""
        now = self._clock()
        self._counters_at = now
        waiting: dict[str, list[str]] = {}
        seen: set[str] = set()
        for pool in self.pools.values():  # O(tenants waiting here), not O(configured)
            for tenant_id, lane in pool.queue.backlogged():
                if tenant_id not in seen:
                    seen.add(tenant_id)
                    waiting.setdefault(lane, []).append(tenant_id)
        reads = {lane: tenants for lane, tenants in waiting.items() if len(tenants) >= 2}
        contended = {pool: {lane_share_key(pool.model, lane): lane for lane in self._lane_names}
                     for pool in self.pools.values() if pool.queue.shares_matter()}
        keys = [key for names in contended.values() for key in names]
        try:
            view = await self.store.read_fairness(reads, keys, self._share_window_s)
        except StateUnavailable:
            view = None  # decide on this replica's own counters and shares until it answers
        for pool in self.pools.values():
            if view is not None:
                for values in view.counters.values():
                    pool.queue.set_counters(values)
            names = contended.get(pool)
            if names is None:
                pool.queue.set_lane_costs(None)  # no lane choice to make: its own window
                self._shares_at.pop(pool, None)
                continue
            self._shares_at[pool] = now  # also after a failure: no retry before the interval
            if view is not None and view.lane_costs is not None:
                pool.queue.set_lane_costs({lane: view.lane_costs.get(key, 0.0)
                                           for key, lane in names.items()})
            else:
                pool.queue.set_lane_costs(None)


def make_dispatcher(config: GatewayConfig, clock: Callable[[], float],
                    store: StateStore | None) -> Dispatcher:
    """The in-process dispatcher for one replica, the shared one with a shared store."""
    return Dispatcher(config, clock) if store is None else SharedDispatcher(config, clock, store)
