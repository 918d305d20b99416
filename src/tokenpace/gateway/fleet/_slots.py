"""One engine as the gateway sees it: its standing (up, drained, shutting down), its
capacity and load, and the pools it is a member of.

``EngineSlots`` is read on every dispatch decision (``accepts``, ``has_room``: a few
attribute reads and comparisons each); it is written by the fleet (standing, load, pool
membership) and by the dispatcher (``dispatched``, ``inflight``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sized
from typing import Protocol

from .. import metrics
from ..config import EngineConfig
from ._adapter_set import AdapterSet


class EnginePool(Protocol):
    """A pool as the fleet sees it (``dispatch.Pool`` is one): the model name it serves,
    its member engines, and the queue of requests waiting for them."""

    @property
    def model(self) -> str: ...

    @property
    def engines(self) -> list[EngineSlots]: ...

    @property
    def queue(self) -> Sized: ...


class EngineSlots:
    """One engine's capacity as the gateway sees it, and its queue of waiting requests.

    The saturation gate holds requests here while more would only queue inside the engine.
    Two signals, because each alone fails:

    - The gateway's own count. With the engine's capacity known (``max_num_seqs``
      configured, reported on its ``/health`` by ``tokenpace serve``, or learned from two
      readings in a row that show requests waiting beside the same running count), at
      most capacity + ``max_engine_waiting`` of the gateway's
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

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.pools: list[EnginePool] = []  # one per model name it serves
        self.models: frozenset[str] | None = (  # None: not known yet (learned)
            frozenset(config.models) if config.models is not None else None)
        self.inflight = 0
        # Tenant id -> its requests in flight here (this replica's): ``admits`` reads it.
        self.by_tenant: dict[str, int] = {}
        self.in_reserve = 0  # of ``inflight``: requests in its reserved slots (``admits``)
        self.healthy = True
        self.down_since: float | None = None
        # Connections refused in a row (requests that never reached it): one takes it out
        # of dispatch, unless it is the last engine up in one of its pools
        # (``Fleet.connect_failed``).
        self.connect_failures = 0
        # Drained (``engines[].drain``, ``POST /admin/engines/drain``): no new dispatches.
        self.draining = config.drain
        # Shutting down (it said so: vLLM on SIGTERM): drained until it goes down; since when.
        self.stopping_since: float | None = None
        self.up_gauge = metrics.ENGINE_UP.labels(config.url)
        self.draining_gauge = metrics.ENGINE_DRAINING.labels(config.url)
        self.refused_counter = metrics.ENGINE_REFUSED.labels(config.url)
        self.engine_waiting: float | None = None  # from the engine's /metrics
        self.engine_running: float | None = None
        self.kv_cache_usage: float | None = None
        # Its --max-num-seqs as its /health reports it (tokenpace serve does; None: not).
        self.reported_capacity: int | None = None
        self.learned_capacity: int | None = None
        # Route -> the top-level request fields the engine reads (``_fields``); empty: not
        # known (every field is forwarded). Read once a large body asked for them
        # (``fields_wanted``), at the next good health check; again when it comes back.
        self.request_fields: dict[str, frozenset[str]] = {}
        self.fields_wanted = False
        self.fields_learned = False
        # The LoRA adapters it holds (``_adapters``): learned from its /v1/models and kept
        # by the loads the gateway makes.
        self.adapters = AdapterSet()
        self.held = asyncio.Event()  # set while the gate holds requests: poll sooner
        self.inflight_gauge = metrics.ENGINE_INFLIGHT.labels(config.url)  # bound once
        self._dispatched_since_reading = 0
        self._fresh_at_reading = 0  # dispatched between the previous reading and the last

    @property
    def url(self) -> str:
        return self.config.url

    def publish(self) -> None:
        """Set the engine's gauges (a new engine: up, nothing in flight)."""
        self.inflight_gauge.set(self.inflight)
        self.up_gauge.set(int(self.healthy))
        self.draining_gauge.set(int(self.drained))

    def unpublish(self) -> None:
        """Remove the engine's series (it left the configuration)."""
        for family in (metrics.ENGINE_INFLIGHT, metrics.ENGINE_UP, metrics.ENGINE_DRAINING,
                       metrics.ENGINE_REFUSED):
            try:
                family.remove(self.url)
            except KeyError:
                pass

    @property
    def accepts(self) -> bool:
        """Whether new requests may go to it: up, not drained, not shutting down (three
        attribute reads)."""
        return self.healthy and not self.draining and self.stopping_since is None

    @property
    def drained(self) -> bool:
        """Drained by an operator or shutting down: what ``/health`` and the gauge show."""
        return self.draining or self.stopping_since is not None

    def waiting(self) -> int:
        """Requests waiting in the queues of the pools this engine serves."""
        return sum(len(pool.queue) for pool in self.pools)

    @property
    def capacity(self) -> int | None:
        """Requests the engine runs at once (configured, else reported on its ``/health``,
        else learned; None: unknown)."""
        return self.config.max_num_seqs or self.reported_capacity or self.learned_capacity

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

    @property
    def max_adapters(self) -> int:
        """The adapters the gateway keeps loaded here: ``max_adapters`` configured, else the
        ``max_lora`` the engine reports, else 1 (vLLM's default ``--max-loras``)."""
        return self.config.max_adapters or self.adapters.reported_max or 1

    @property
    def adapters_full(self) -> bool:
        """Loading another adapter here would first unload one (``max_adapters`` taken)."""
        return len(self.adapters) >= self.max_adapters

    @property
    def slots(self) -> int:
        """The requests it runs at once as far as the gateway knows: its capacity where
        known, at most ``max_inflight``."""
        limit = self.config.max_inflight
        capacity = self.capacity
        return limit if capacity is None else min(limit, capacity)

    @property
    def reserve(self) -> int:
        """Its slots kept for tenants that hold few requests on it (``admits``):
        ``reserved_slots``, by default an eighth of ``slots`` (none below 8 slots); always
        fewer than ``slots``."""
        slots = self.slots
        wanted = self.config.reserved_slots
        if wanted is None:
            wanted = slots // 8
        return max(0, min(wanted, slots - 1))

    def admits(self, tenant_id: str) -> bool:
        """Whether a request of ``tenant_id`` may take a slot here, room permitting
        (``has_room``): the last ``reserve`` of its running slots go only to a tenant that
        holds fewer than ``reserve`` requests here. So a tenant whose requests run for
        minutes cannot take every slot: the next tenant's request starts at once instead of
        waiting for one of them to end. At most ``reserve`` slots stay idle, while no
        waiting tenant may have them. A few attribute reads and a dict lookup."""
        reserve = self.reserve
        return not self._outside_full(reserve) or self.by_tenant.get(tenant_id, 0) < reserve

    def _outside_full(self, reserve: int) -> bool:
        """Whether the next request here would take one of the ``reserve`` reserved slots
        (every slot outside them is taken)."""
        return bool(reserve) and self.inflight - self.in_reserve + 1 + reserve > self.slots

    def dispatched(self, tenant_id: str) -> bool:
        """A request of ``tenant_id`` was given a slot here; True: one of the reserved
        slots (give it back with ``released(tenant_id, True)``)."""
        in_reserve = self._outside_full(self.reserve)
        self.inflight += 1
        self.in_reserve += in_reserve
        self.by_tenant[tenant_id] = self.by_tenant.get(tenant_id, 0) + 1
        self._dispatched_since_reading += 1
        return in_reserve

    def released(self, tenant_id: str, in_reserve: bool) -> None:
        """A request of ``tenant_id`` gave its slot here back (``in_reserve``: what
        ``dispatched`` said of it)."""
        self.inflight -= 1
        self.in_reserve -= in_reserve
        held = self.by_tenant.get(tenant_id, 0) - 1
        if held > 0:
            self.by_tenant[tenant_id] = held
        else:
            self.by_tenant.pop(tenant_id, None)

    def connect_ok(self) -> None:
        """A request reached the engine: its run of refused connections ends (one store
        per request; ``Fleet.connect_failed`` counts them)."""
        self.connect_failures = 0

    def forget_load(self) -> None:
        """Drop the last gauge reading (the engine went down): a restarted engine starts
        empty, and a reading from before its death must not hold requests back from it."""
        self.engine_waiting = self.engine_running = self.kv_cache_usage = None
        self._dispatched_since_reading = self._fresh_at_reading = 0

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
