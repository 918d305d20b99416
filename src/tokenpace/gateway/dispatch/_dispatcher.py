"""Where admitted requests wait for an engine, and which engine each one goes to.

Requests wait here, in the gateway, rather than in the engine: here they can still be
reordered, timed out or cancelled for free, and this is where fairness is decided.

Engines are grouped into pools by the model names they serve (``engines[].models``, else
learned from each engine's ``/v1/models``); an engine serving two names is in two pools.
Each pool has one fair queue (``fairness.FairQueue``: lanes in priority order with a
minimum share, weighted VTC inside a lane, FIFO inside a tenant), so VTC counters and lane
shares are measured over the whole pool, not per engine. A waiting request is dispatched
when some engine of its pool that it may use has room (below ``max_inflight`` and, when its
``/metrics`` are reachable, not already queueing or out of KV cache) and its tenant is
below ``max_concurrency``.

Which engine (``routing: pool``, the default): a tenant's engines are ranked by
rendezvous hashing over the pool's URLs (a stable preference, so a tenant's prompts meet
their own prefix cache); its request goes to the first engine in that order that has room,
unless another engine with room has more than ``pool_affinity`` fewer requests in flight,
in which case it goes to the least loaded. A tenant with ``output_tokens_per_second`` fills
its first engine and spreads to the next only when that one is full: each engine it runs on
paces a share of its rate (``engines._rate_split``), and every engine more is a share to move; it
stays on its first engine where engines have no ``api_key`` (the shares are moved by a
control call that needs it). With ``routing: pinned`` every tenant stays on its first
engine. With ``repin_after`` set, a pinned tenant
whose engine has been down that long moves to the next engine in its rendezvous order (the
drain period lets the old engine finish or drop what it held before the identity is paced
somewhere else).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

from ...fairness import FairQueue, LaneSpec
from .. import metrics
from ..config import AdapterConfig, GatewayConfig
from ..fleet import EngineSlots, Fleet, place_adapter
from ..state import Reservation
from ..tenants import ApplicationState, TenantState, dispatched
from ._homes import HomeTable


class QueueFull(Exception):
    """The tenant already has ``max_queued`` requests waiting; ``waiting``: how many wait
    on every replica together (shared slots), None in process."""

    def __init__(self, waiting: int | None = None) -> None:
        super().__init__(waiting)
        self.waiting = waiting


class Pool:
    """The engines serving one model name, and the one fair queue its requests wait in."""

    def __init__(self, model: str, queue: FairQueue[Waiter]) -> None:
        self.model = model
        self.engines: list[EngineSlots] = []
        self.queue = queue

    def __repr__(self) -> str:
        return f"Pool({self.model!r}, {[e.url for e in self.engines]})"


@dataclass(eq=False)
class Waiter:
    tenant: TenantState
    pool: Pool
    application: ApplicationState | None = None
    engine: EngineSlots | None = None  # chosen when the request is granted
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    granted: bool = False
    released: bool = False
    in_reserve: bool = False  # granted one of its engine's reserved slots
    # The conversation it continues (``wire.conversation_key``): its engine is the one that
    # key hashes to, within the load bound (``Dispatcher.choose``). None: by tenant and load.
    affinity: bytes | None = None
    # The LoRA adapter it asks for: placed where that is loaded (``fleet.place_adapter``).
    adapter: AdapterConfig | None = None


class Lease:
    """One request's slot on an engine, from the wait for it to its release.

    ``async with dispatcher.lease(...)`` holds the slot for a block and gives it back however
    the block ends (exception, cancellation). A request whose response outlives its handler
    (a stream relayed after ``handle`` returned) calls ``acquire`` and ``release`` itself:
    ``Exchange.finish`` releases. ``acquire`` leaves nothing behind when it fails or is
    cancelled, and ``release`` is idempotent, so a slot cannot leak or be freed twice.
    """

    def __init__(self, dispatcher: Dispatcher, tenant: TenantState, pool: Pool,
                 timeout_s: float, prompt_cost: float, estimate: float,
                 application: ApplicationState | None = None,
                 affinity: bytes | None = None, adapter: AdapterConfig | None = None) -> None:
        self._dispatcher = dispatcher
        self.tenant, self.pool, self.application = tenant, pool, application
        self.affinity, self.adapter = affinity, adapter
        self._wait = (timeout_s, prompt_cost, estimate)
        self.waiter: Waiter | None = None  # set once granted

    @property
    def engine(self) -> EngineSlots:
        """The engine the slot is on (once granted)."""
        assert self.waiter is not None and self.waiter.engine is not None
        return self.waiter.engine

    async def acquire(self) -> Lease:
        """Wait for the slot; raise ``QueueFull`` at once or ``TimeoutError`` after the
        timeout (see ``Dispatcher.acquire``)."""
        timeout_s, prompt_cost, estimate = self._wait
        self.waiter = await self._dispatcher.acquire(self.tenant, self.pool, timeout_s,
                                                     prompt_cost, estimate, self.application,
                                                     affinity=self.affinity,
                                                     adapter=self.adapter)
        return self

    async def again(self) -> Lease:
        """The slot's engine failed before the request reached it: give the slot back and
        wait for one on another engine of the pool, first in the tenant's order and without
        a second charge of its prompt (``FairQueue.push(ahead=True)``). Raises as
        ``acquire``; nothing is held when it does."""
        if self.waiter is not None:
            self._dispatcher.release(self.waiter)
            self.waiter = None
        timeout_s, _, _ = self._wait
        self.waiter = await self._dispatcher.acquire(self.tenant, self.pool, timeout_s, 0.0, 0.0,
                                                     self.application, ahead=True,
                                                     affinity=self.affinity,
                                                     adapter=self.adapter)
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
    """Pools of engines per model name, each with its fair queue; the engine choice, and
    the slots requests hold, counted in this process (``SharedDispatcher``: in a shared
    store). Its engines and their standing are ``fleet``'s, which tells it of each change
    (``fleet.Dispatch``)."""

    def __init__(self, config: GatewayConfig, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._config = config
        # The engines and their standing; each change comes back as ``join``, ``rerank``,
        # ``pump`` or ``forget``.
        self.fleet = Fleet(config, clock, self)
        # Whether a paced tenant's rate can be split over engines: the rate-control call
        # that moves the shares needs each engine's key (``engines[].api_key``). Fixed for
        # the life of the process: a reload that adds an engine without a key is refused.
        self.splits_rates = all(e.api_key for e in config.engines)
        self.pools: dict[str, Pool] = {}
        self.repin_after_s = config.repin_after_s
        self._states: dict[str, TenantState] = {}
        # (tenant, pool model) -> the pool's engines in rendezvous order. The order depends
        # only on the pool's engine URLs and the tenant id; health and the clock decide among
        # them in engine_for, so health changes need not (but do) clear it; reloads and a
        # pool's membership changing clear it, so a removed tenant's entry goes.
        self._ranked: dict[tuple[str, str | None], list[EngineSlots]] = {}
        # Each tenant's conversations -> the engine its last turn went to
        # (``_conversation_engine``), bounded per tenant and in all (``HomeTable``).
        self._homes = HomeTable(config.max_conversation_homes,
                                config.max_conversation_homes_per_tenant)
        for engine in self.fleet.engines:
            if engine.models is not None:
                self.join(engine, engine.models)
        self.configure(config)
        self.fleet.publish()

    @property
    def engines(self) -> list[EngineSlots]:
        """The fleet's engines (``Fleet.engines``), for reading."""
        return self.fleet.engines

    def configure(self, config: GatewayConfig) -> None:
        """Apply (re)loaded lanes, tenant lanes and weights to every pool's queue, and each
        engine's ``drain`` flag as its configuration says (``Fleet.configure``;
        ``Fleet.set_engines`` changes the engine list)."""
        self._config = config
        self.repin_after_s = config.repin_after_s
        self._homes.total = config.max_conversation_homes  # new homes are held to them
        self._homes.per_tenant = config.max_conversation_homes_per_tenant
        self._ranked.clear()
        for pool in self.pools.values():
            self._configure_queue(pool.queue, config)
        self.fleet.configure(config)

    # -- what the fleet tells it (``fleet.Dispatch`` states each call's contract) ----------

    def join(self, engine: EngineSlots, models: Iterable[str]) -> None:
        for model in models:
            pool = self.pools.get(model)
            if pool is None:
                pool = Pool(model, self._new_queue())
                self.pools[model] = pool
            pool.engines.append(engine)
            engine.pools.append(pool)

    def rerank(self) -> None:
        self._ranked.clear()

    def pump(self, engine: EngineSlots | None) -> None:
        # ``engine.pools`` holds the pools ``join`` put there.
        pools = self.pools.values() if engine is None else cast("list[Pool]", engine.pools)
        for pool in pools:
            self._pump(pool)

    def forget(self, engine: EngineSlots) -> None:
        """Drop what this dispatcher keeps about a removed engine (see SharedDispatcher)."""

    def _configure_queue(self, queue: FairQueue[Waiter], config: GatewayConfig) -> None:
        """Lanes and order; the lanes and weights of the tenants the queue has seen (a
        tenant is declared to a queue with its first request: O(tenants seen), not
        O(configured))."""
        queue.set_lanes(_lane_specs(config))
        queue.fair = config.dispatch_order == "vtc"
        self._declare_tenants(queue, config)

    def configure_tenants(self, config: GatewayConfig) -> None:
        """Apply ``config``'s tenant lanes and weights to every pool's queue, and nothing
        else (a change of the admin API's tenants: lanes and engines, their drain flags
        included, stay as they are). O(pools x tenants each queue has seen)."""
        self._config = config
        self._ranked.clear()
        for pool in self.pools.values():
            self._declare_tenants(pool.queue, config)

    def _declare_tenants(self, queue: FairQueue[Waiter], config: GatewayConfig) -> None:
        for tenant_id in queue.declared_tenants():
            tenant = config.tenant(tenant_id)
            if tenant is not None:
                queue.set_tenant(tenant.id, tenant.lane, tenant.weight,
                                 {a.id: a.weight for a in tenant.applications})

    @staticmethod
    def _declare(queue: FairQueue[Waiter], tenant: TenantState) -> None:
        """Declare the tenant to the queue before its first request there (a reload
        updates it from then on: ``_configure_queue``)."""
        if not queue.declared(tenant.id):
            cfg = tenant.config
            queue.set_tenant(cfg.id, cfg.lane, cfg.weight,
                             {a.id: a.weight for a in cfg.applications})

    # -- pools -------------------------------------------------------------------------

    def _new_queue(self) -> FairQueue[Waiter]:
        config = self._config
        queue: FairQueue[Waiter] = FairQueue(_lane_specs(config), self._clock,
                                             config.lane_share_window_s,
                                             fair=config.dispatch_order == "vtc")
        self._configure_queue(queue, config)
        return queue

    def pool_for(self, model: str) -> Pool | None:
        """The pool serving ``model`` (a served name), or None when no engine serves it."""
        pool = self.pools.get(model)
        return pool if pool is not None and pool.engines else None

    def served_models(self) -> list[str]:
        """Every model name some engine serves, sorted."""
        return sorted(model for model, pool in self.pools.items() if pool.engines)

    # -- routing ---------------------------------------------------------------------

    def _rank(self, tenant_id: str, pool: Pool | None) -> list[EngineSlots]:
        key = (tenant_id, pool.model if pool is not None else None)
        ranked = self._ranked.get(key)
        if ranked is None:  # one hash per engine and a sort: once per tenant and pool
            engines = pool.engines if pool is not None else self.engines
            ranked = sorted(engines, key=lambda e: _score(e.url, tenant_id), reverse=True)
            self._ranked[key] = ranked
        return ranked

    def engine_for(self, tenant_id: str, pool: Pool | None = None) -> EngineSlots:
        """The engine ``tenant_id`` is pinned to in ``pool`` (default: over every engine):
        the highest rendezvous score, or with ``repin_after`` the first healthy one in score
        order once that one has been down that long."""
        ranked = self._rank(tenant_id, pool)
        first = ranked[0]
        if first.healthy and first.drained:
            # Drained on purpose: its tenants move at once (a paced tenant's rate with them).
            return next((e for e in ranked[1:] if e.accepts), first)
        if first.healthy or self.repin_after_s is None or first.down_since is None \
                or self._clock() - first.down_since < self.repin_after_s:
            return first
        return next((e for e in ranked[1:] if e.accepts), first)

    def pinned(self, tenant: TenantState) -> bool:
        """Whether the tenant runs on one engine per pool: ``routing: pinned``, or a paced
        tenant whose rate cannot be split (``splits_rates``): one engine paces it."""
        return self._config.routing == "pinned" or (
            tenant.config.output_tokens_per_second is not None and not self.splits_rates)

    def preferred(self, tenant: TenantState, pool: Pool) -> EngineSlots | None:
        """The engine that counts the tenant's prompts before dispatch (``/tokenize``): its
        pinned engine when pinned, else the first healthy one in its rendezvous order."""
        if self.pinned(tenant):
            engine = self.engine_for(tenant.id, pool)
            return engine if engine.accepts else None
        return next((e for e in self._rank(tenant.id, pool) if e.accepts), None)

    def may_wait(self, tenant: TenantState, pool: Pool) -> bool:
        """Whether some engine the tenant may use in ``pool`` is up (else: refuse at once)."""
        return self.preferred(tenant, pool) is not None

    def choose(self, tenant: TenantState, pool: Pool, affinity: bytes | None = None,
               adapter: AdapterConfig | None = None) -> EngineSlots | None:
        """The engine of ``pool`` the tenant's next request goes to now; None: none has room.

        ``affinity``: the conversation the request continues (``wire.conversation_key``),
        with ``locality: conversation``: see ``_conversation_engine``. Paced and pinned
        tenants keep their own order (one engine until it is full: a paced tenant's
        conversations stay together where its rate split allows). ``adapter``: the LoRA
        adapter asked for, placed by ``fleet.place_adapter`` (a pinned tenant keeps its
        engine, where the adapter is loaded for it).

        Cost: O(engines in the pool) comparisons on cached rendezvous ranks; with an
        affinity, one BLAKE2b per engine of the pool more (about 0.5 us each).
        """
        if self.pinned(tenant):
            engine = self.engine_for(tenant.id, pool)
            return engine if self._takes(engine, tenant.id) else None
        if adapter is not None:
            return place_adapter([e for e in pool.engines if self._takes(e, tenant.id)],
                                 adapter.name, self._config.adapter_affinity, pool.engines)
        if tenant.config.output_tokens_per_second is not None:
            # A paced tenant fills its first engine in rendezvous order and spills to the
            # next only when that one is full: its rate, not an engine, bounds it, and each
            # engine more is a share to move by control call as streams start and end.
            return next((e for e in self._rank(tenant.id, pool)
                         if self._takes(e, tenant.id)), None)
        if affinity is not None and self.by_conversation(tenant, pool):
            return self._conversation_engine(tenant.id, pool, affinity)
        best: EngineSlots | None = None
        first: EngineSlots | None = None
        for engine in self._rank(tenant.id, pool):
            if not self._takes(engine, tenant.id):
                continue
            if first is None:
                first = engine
            if best is None or engine.inflight < best.inflight:
                best = engine
        if first is None or best is None:
            return None
        return first if first.inflight <= best.inflight + self._config.pool_affinity else best

    def by_conversation(self, tenant: TenantState, pool: Pool) -> bool:
        """Whether ``choose`` places the tenant's turns in ``pool`` by their conversation:
        ``locality: conversation``, a pool of several engines, a tenant neither pinned nor
        paced (those keep their own engine order)."""
        return (self._config.locality == "conversation" and len(pool.engines) > 1
                and tenant.config.output_tokens_per_second is None
                and self._config.routing != "pinned")

    def _conversation_engine(self, tenant: str, pool: Pool,
                             affinity: bytes) -> EngineSlots | None:
        """The engine a conversation's turn goes to (nothing is remembered here: the
        engine its turn is granted becomes its home, ``_remember_home``).

        - A conversation with a home (the engine its last turn went to) whose engine takes
          requests: that engine, while it has at most ``conversation_affinity`` more of the
          gateway's requests in flight than the least loaded engine with room; otherwise
          the least loaded. Its prefix is cached there, and a turn sent elsewhere computes
          the whole conversation again and caches it twice, so the bound is looser than a
          tenant's (``pool_affinity``).
        - A new conversation (no home known; or its home went down or is full): nothing of
          it is cached anywhere but a shared system prompt, so it is placed for balance as
          a tenant's request is: the first engine in the key's rendezvous order, within
          ``pool_affinity`` of the least loaded. Placing first turns by load, not by hash
          alone, keeps the engines' shares of conversations even (hashing 12 over 2 splits
          8/4 or worse 39% of the time, and the engine with more of them evicts).

        Cost: one dict lookup for the home and O(engines) comparisons; for a new
        conversation a BLAKE2b per engine of the pool more (0.5 us each).
        """
        open_engines = [e for e in pool.engines if self._takes(e, tenant)]
        if not open_engines:
            return None
        least = min(open_engines, key=lambda e: e.inflight)
        home_url = self._homes.get(tenant, affinity)
        home = None if home_url is None else next(
            (e for e in open_engines if e.url == home_url), None)
        if home is not None:
            bound = self._config.conversation_affinity
            return home if home.inflight <= least.inflight + bound else least
        first = max(open_engines, key=lambda e: _affinity_score(e.url, affinity))
        return first if first.inflight <= least.inflight + self._config.pool_affinity else least

    def _note_turn(self, waiter: Waiter) -> None:
        """A granted request that continues a conversation (placed by it): its engine is
        the conversation's home now; one for an adapter: the adapter is the engine's most
        recently used. Called once per grant, in process and shared."""
        if waiter.adapter is not None and waiter.engine is not None:
            waiter.engine.adapters.used(waiter.adapter.name)
        if waiter.affinity is not None and waiter.engine is not None \
                and self.by_conversation(waiter.tenant, waiter.pool):
            self._remember_home(waiter.tenant.id, waiter.affinity, waiter.engine)

    def _remember_home(self, tenant: str, affinity: bytes, engine: EngineSlots) -> str | None:
        """A turn of ``tenant``'s conversation ``affinity`` was granted a slot on ``engine``:
        its home now (``HomeTable``: the tenant's oldest goes first when it holds its
        bound). Returns the home it had (None: new to this replica). Cost: a few dict
        operations."""
        return self._homes.put(tenant, affinity, engine.url)

    def _takes(self, engine: EngineSlots, tenant_id: str) -> bool:
        """Whether ``engine`` takes a request of ``tenant_id`` now: it accepts requests, has
        room, and its reserved slots admit the tenant (``EngineSlots.admits``)."""
        return engine.accepts and self._open(engine) and engine.admits(tenant_id)

    def _open(self, engine: EngineSlots) -> bool:
        """Whether ``engine`` takes a request now (the shared dispatcher adds the slots
        other replicas hold)."""
        return engine.has_room()

    def spare(self, pool: Pool, keep: int) -> int:
        """Slots of ``pool`` that work which must never delay live requests (batch lines)
        may take now: none while any request waits in the pool's queue; else, summed over
        the engines that take requests and have room, the free slots beyond ``keep`` (or
        the engine's ``reserve``, the larger) per engine. O(engines in the pool). With several replicas the counts are this
        replica's (another replica's slots show only as an engine without room).

        An engine's slots are its capacity where known (``max_num_seqs``), else its
        ``max_inflight``: with ``max_inflight`` above the capacity (an engine whose lanes
        hold lower-priority requests for better ones), live requests may go past the batch
        lines, which never take more than the requests the engine runs at once."""
        if len(pool.queue):
            return 0
        return sum(max(0, engine.slots - max(keep, engine.reserve) - engine.inflight)
                   for engine in pool.engines if engine.accepts and self._open(engine))

    # -- waiting and dispatch ----------------------------------------------------------

    async def acquire(self, tenant: TenantState, pool: Pool, timeout_s: float,
                      prompt_cost: float, estimate: float,
                      application: ApplicationState | None = None,
                      ahead: bool = False, affinity: bytes | None = None,
                      adapter: AdapterConfig | None = None) -> Waiter:
        """Wait for a slot; raise ``QueueFull`` at once or ``TimeoutError`` after ``timeout_s``.
        ``ahead``: a request sent back by a failed engine (``Lease.again``); ``affinity``:
        the conversation it continues, ``adapter``: the LoRA adapter it asks for (``choose``).

        On cancellation the waiter leaves the queue, or gives its slot back if it was
        granted in the same instant, so nothing leaks.
        """
        waiter = Waiter(tenant, pool, application, affinity=affinity, adapter=adapter)
        self._states[tenant.id] = tenant
        self._declare(pool.queue, tenant)
        pool.queue.push(waiter, tenant.id, prompt_cost, estimate,
                        None if application is None else application.id, ahead=ahead)
        tenant.queued += 1
        self._pump(pool)
        if waiter.granted:
            return waiter
        if not ahead and tenant.config.max_queued is not None \
                and tenant.queued > tenant.config.max_queued:
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

    def lease(self, tenant: TenantState, pool: Pool, timeout_s: float,
              prompt_cost: float, estimate: float,
              application: ApplicationState | None = None,
              affinity: bytes | None = None, adapter: AdapterConfig | None = None) -> Lease:
        """A slot on an engine of ``pool`` for one request of ``tenant`` (and of its
        ``application``, continuing conversation ``affinity``, for LoRA ``adapter``), not
        yet waited for."""
        return Lease(self, tenant, pool, timeout_s, prompt_cost, estimate, application,
                     affinity, adapter)

    def charge(self, waiter: Waiter, cost: float) -> None:
        """Service a dispatched request received (output tokens as the stream reports them)."""
        app = waiter.application
        waiter.pool.queue.charge(waiter.tenant.id, cost, None if app is None else app.id)

    def release(self, waiter: Waiter, settle: tuple[Reservation, float] | None = None) -> bool:
        """Give a dispatched request's slots back (idempotent) and dispatch the next.
        In process there is no store call to settle ``settle`` with: False."""
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
        for pool in self.pools.values():  # the tenant's concurrency may unblock any queue
            if len(pool.queue):
                self._pump(pool)
        return False

    def _remove(self, waiter: Waiter) -> None:
        if waiter.pool.queue.remove(waiter):
            waiter.tenant.queued -= 1
            metrics.child(metrics.QUEUED, waiter.tenant.id).set(waiter.tenant.queued)

    def _placeable(self, tenant_id: str, pool: Pool) -> EngineSlots | None:
        """The engine a waiter of ``tenant_id`` would get now, if it may go at all."""
        state = self._states.get(tenant_id)
        if state is None or not self._may_dispatch(tenant_id):
            return None
        return self.choose(state, pool)

    def _eligibility(self, pool: Pool) -> tuple[Callable[[str], bool],
                                                dict[str, EngineSlots | None], set[str]]:
        """The fair queue's ``eligible`` test for one dispatch round of ``pool``, the engine
        choices it makes on the way (the chosen tenant's engine is then read, not chosen
        again), and the round's tenants to skip: those whose next request waits for its
        adapter's engine sit the round out."""
        placed: dict[str, EngineSlots | None] = {}
        skip: set[str] = set()

        def eligible(tenant_id: str) -> bool:
            if tenant_id in skip:
                return False
            engine = placed[tenant_id] = self._placeable(tenant_id, pool)
            return engine is not None

        return eligible, placed, skip

    def _may_dispatch_application(self, tenant_id: str, application_id: str) -> bool:
        """Whether a waiting request of this application may go now (below its
        ``max_concurrency``). An application a reload removed has no limit left."""
        state = self._states.get(tenant_id)
        app = None if state is None else state.applications.get(application_id)
        return app is None or not app.at_concurrency_limit()

    def _pump(self, pool: Pool) -> None:
        """Dispatch the fair queue's choices while an engine of the pool has room for them.

        Cost per dispatch: the fair queue's choice (O(tenants waiting)), each candidate
        tenant's engine choice (O(engines in the pool)), a few counters and gauges.
        """
        eligible, placed, skip = self._eligibility(pool)
        while len(pool.queue) and any(e.accepts and self._open(e) for e in pool.engines):
            placed.clear()
            waiter = pool.queue.peek(eligible, self._may_dispatch_application)
            if waiter is None:
                break
            tenant = waiter.tenant
            engine = self.engine_of(waiter, placed)
            if engine is None:  # waits for its adapter's engine: its tenant sits this round out
                skip.add(tenant.id)
                continue
            pool.queue.take(waiter)
            waiter.engine = engine
            waiter.granted = True
            self._note_turn(waiter)
            tenant.queued -= 1
            tenant.inflight += 1
            dispatched(tenant, self._clock())
            if waiter.application is not None:
                waiter.application.inflight += 1
                dispatched(waiter.application, self._clock())
            waiter.in_reserve = engine.dispatched(tenant.id)
            engine.inflight_gauge.set(engine.inflight)
            metrics.child(metrics.QUEUED, tenant.id).set(tenant.queued)
            metrics.child(metrics.INFLIGHT, tenant.id).set(tenant.inflight)
            if not waiter.future.done():
                waiter.future.set_result(None)
        if len(pool.queue):
            for engine in pool.engines:
                if engine.inflight < engine.config.max_inflight and engine.saturated():
                    engine.held.set()  # a fresh reading: the one that closed the gate may be stale

    def engine_of(self, waiter: Waiter, placed: dict[str, EngineSlots | None]) -> EngineSlots | None:
        """The engine for ``waiter``, the fair queue's choice: the eligibility test placed
        its tenant by tenant and load (``placed``); a request for an adapter, or a turn of
        a conversation, is placed again by them (O(engines)). None: a request for an
        adapter that waits for an engine holding it (``fleet.place_adapter``)."""
        tenant, pool = waiter.tenant, waiter.pool
        if waiter.adapter is not None:
            return self.choose(tenant, pool, waiter.affinity, waiter.adapter)
        if waiter.affinity is not None:
            engine = self.choose(tenant, pool, waiter.affinity, waiter.adapter)
            if engine is not None:
                return engine
        return placed.get(tenant.id) or self.choose(tenant, pool)

    def _may_dispatch(self, tenant_id: str) -> bool:
        state = self._states.get(tenant_id)
        return state is not None and not state.at_concurrency_limit()

    async def close(self) -> None:
        """Stop background work (none in process; see ``SharedDispatcher``)."""

    def publish(self, active: Iterable[str]) -> None:
        """Refresh the fairness gauges of the ``active`` tenants (those with series; called
        when /metrics is scraped). O(lanes + active tenants x pools)."""
        lane_cost: dict[str, float] = {}
        for pool in self.pools.values():
            for lane, cost in pool.queue.lane_costs().items():
                lane_cost[lane] = lane_cost.get(lane, 0.0) + cost
        total = sum(lane_cost.values())
        for lane, cost in lane_cost.items():
            metrics.LANE_SHARE.labels(lane).set(cost / total if total else 0.0)
        for tenant_id in active:
            metrics.child(metrics.FAIRNESS_DEBT, tenant_id).set(
                max((p.queue.debt(tenant_id) for p in self.pools.values()), default=0.0))
            metrics.child(metrics.QUEUED_COST, tenant_id).set(
                sum(p.queue.queued(tenant_id)[1] for p in self.pools.values()))


def _lane_specs(config: GatewayConfig) -> list[LaneSpec]:
    return [LaneSpec(lane.name, lane.priority, lane.min_share) for lane in config.lanes]


def _affinity_score(url: str, key: bytes) -> bytes:
    """The rendezvous score of engine ``url`` for a conversation key (higher first)."""
    return hashlib.blake2b(url.encode() + b"\0" + key, digest_size=8).digest()


def _score(url: str, tenant_id: str) -> int:
    digest = hashlib.blake2b(f"{url}\x00{tenant_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
