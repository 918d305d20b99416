"""What the gateway asks of its state store, whichever store it is.

Every operation is one call (one Redis round trip in the shared store), async so that a
shared store can wait on the network, and says what was decided rather than handing out
raw counters: "reserve 300 if all budgets allow it" instead of "read, compare, write",
which several replicas would interleave into overspending.
"""

from __future__ import annotations

import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ...fairness import BudgetRefusal, BudgetSpec, Headroom, tightest


class StateUnavailable(Exception):
    """The state store did not answer in time; nothing was decided."""


@dataclass(frozen=True)
class Reservation:
    """Cost taken from a tenant's budgets; settled once against the store that took it."""

    tenant: str
    budgets: tuple[BudgetSpec, ...]
    cost: float
    store: StateStore = field(compare=False, repr=False)
    # Each budget's level once the cost was taken (as ``budgets``): what is left, for the
    # rate-limit headers of the response. Empty from a store that did not say.
    levels: tuple[float, ...] = field(default=(), compare=False)
    # Each budget's seconds until it is whole again as the store saw it (as ``budgets``):
    # a calendar budget's period end. Empty: computed from the levels (sliding budgets).
    ends_in: tuple[float, ...] = field(default=(), compare=False)

    def headroom(self) -> Headroom | None:
        """The budget with the least left after this reservation (None: not known)."""
        ends = self.ends_in or (None,) * len(self.levels)
        return tightest(Headroom.of(b, level, end)
                        for b, level, end in zip(self.budgets, self.levels, ends))


@dataclass(frozen=True)
class SlotClaim:
    """One counted slot: ``key`` names the limit (``engine:<url>``, ``running:<tenant>``,
    ``queued:<tenant>``), ``limit`` how many may be held at once (None: not limited)."""

    key: str
    limit: int | None


@dataclass(frozen=True)
class SlotRefusal:
    """The first claim whose limit was reached; nothing was taken."""

    claim: SlotClaim
    held: int


@dataclass(frozen=True)
class Admission:
    """An admitted request: its budget reservation, its place in the (global) queue of its
    tenant, and the tenant's virtual counter after the lift."""

    reservation: Reservation
    queued: StoreLease
    counter: float


@dataclass(frozen=True)
class FairnessView:
    """What a replica's dispatch choice reads from the store, in one call: the virtual
    counters (lane -> tenant -> counter) and the cost dispatched per lane share key over
    the window (None: not read, or the store could not answer; the replica then goes by
    its own dispatches)."""

    counters: dict[str, dict[str, float]]
    lane_costs: dict[str, float] | None


_ids = itertools.count()

LANE_KEEP_S = 3600
"""Longest a dispatch is kept for the lane shares when nobody reads them (a read trims to
its own window)."""


@dataclass(eq=False)
class StoreLease:
    """Slots held together in a store until :meth:`StateStore.release`; the store renews
    them while held so that only a crashed holder's slots expire. (A request's own handle
    on its engine slot is ``dispatch.Lease``; with a shared store it holds one of these.)"""

    keys: tuple[str, ...]
    store: StateStore = field(repr=False)
    id: str = field(default_factory=lambda: f"{os.getpid()}-{os.urandom(4).hex()}-{next(_ids)}")
    released: bool = False


class StateStore(ABC):
    """Budgets, slot leases and fair-queue counters, in process or shared."""

    #: True while the store answers; a shared store reports False between a failed call and
    #: the next successful one.
    healthy: bool = True

    # -- budgets ---------------------------------------------------------------------

    @abstractmethod
    async def reserve(self, tenant: str, budgets: Sequence[BudgetSpec],
                      cost: float) -> Reservation | BudgetRefusal:
        """Take ``cost`` from every budget at once, or nothing and say which one refused
        (the one with the longest wait, with exact remaining and reset figures). A
        reservation carries the budgets' levels after it (``Reservation.levels``)."""

    @abstractmethod
    async def settle(self, reservation: Reservation, actual: float) -> None:
        """Replace a reservation by the actual cost (give back or take the difference)."""

    @abstractmethod
    async def budget_levels(self, tenant: str, budgets: Sequence[BudgetSpec]) -> dict[str, float]:
        """Budget key -> cost units available now (for metrics)."""

    # -- slots -----------------------------------------------------------------------

    @abstractmethod
    async def acquire(self, claims: Sequence[SlotClaim],
                      releasing: StoreLease | None = None) -> StoreLease | SlotRefusal:
        """Take one slot of every claim, all or none; on success also give ``releasing``
        back in the same step (a queued place traded for running slots)."""

    @abstractmethod
    async def release(self, lease: StoreLease) -> None:
        """Give a lease's slots back at once (idempotent)."""

    @abstractmethod
    async def held(self, keys: Sequence[str]) -> dict[str, int]:
        """Slots currently held under each key, by every replica."""

    # -- fair queue ------------------------------------------------------------------

    @abstractmethod
    def charge(self, lane: str, tenant: str, amount: float) -> None:
        """Add ``amount`` (service / weight) to a tenant's virtual counter. Not awaited:
        a shared store batches charges and sends them with its next flush."""

    @abstractmethod
    async def counters(self, lane: str, tenants: Sequence[str]) -> dict[str, float]:
        """The virtual counters of ``tenants`` (missing ones are 0)."""

    @abstractmethod
    async def lift(self, lane: str, tenant: str) -> float:
        """A tenant becomes backlogged: raise its counter to the smallest counter among the
        lane's other backlogged tenants, or when none is backlogged to the lane's largest
        counter, so idle time banks no credit. Returns its counter. The store keeps which
        tenants entered the backlog, so this costs O(tenants waiting), never O(tenants of
        the lane).

        (The VTC paper lifts to the counter of the tenant that left the backlog last;
        replicas do not see who left last, and the largest counter of an idle lane is that
        counter or above it, which forfeits the same banked credit.)"""

    # Lane shares: ``lane`` here is the name the shares are counted under, opaque to the
    # store; the dispatcher counts each engine's lanes apart (``lane_share_key``), as the
    # in-process fair queue of each engine does.

    @abstractmethod
    async def record_dispatch(self, lane: str, cost: float) -> None:
        """Count ``cost`` dispatched in ``lane`` for the lane shares."""

    @abstractmethod
    def count_dispatch(self, lane: str, cost: float) -> None:
        """``record_dispatch`` not awaited: a shared store sends it with its next flush
        (for a dispatch that made no other store call to carry it)."""

    @abstractmethod
    async def lane_costs(self, lanes: Sequence[str], window_s: float) -> dict[str, float]:
        """Each lane's cost dispatched in the last ``window_s`` seconds, by every replica."""

    async def read_fairness(self, counters: Mapping[str, Sequence[str]], lanes: Sequence[str],
                            window_s: float) -> FairnessView:
        """The counters of ``counters[lane]``'s tenants per lane and, when ``lanes`` is not
        empty, their ``lane_costs`` over ``window_s``: one round trip in the shared store.
        This default composes the primitives."""
        values = {lane: await self.counters(lane, tenants) for lane, tenants in counters.items()}
        costs = await self.lane_costs(lanes, window_s) if lanes else None
        return FairnessView(values, costs)

    # -- one call per gateway stage ------------------------------------------------------
    # Each is one round trip in the shared store; these defaults compose the primitives.

    async def admit(self, tenant: str, budgets: Sequence[BudgetSpec], cost: float,
                    queued: SlotClaim, lane: str) -> Admission | BudgetRefusal | SlotRefusal:
        """Admission: a full queue refuses first, then the budgets; otherwise reserve
        ``cost``, take a queued place, and lift the tenant's counter if it was not
        backlogged."""
        waiting = (await self.held([queued.key]))[queued.key]
        if queued.limit is not None and waiting >= queued.limit:
            return SlotRefusal(queued, waiting)
        reservation = await self.reserve(tenant, budgets, cost)
        if isinstance(reservation, BudgetRefusal):
            return reservation
        if waiting == 0:
            counter = await self.lift(lane, tenant)
        else:
            counter = (await self.counters(lane, [tenant]))[tenant]
        place = await self.acquire([queued])
        if isinstance(place, SlotRefusal):  # raced by another task of this process
            await self.settle(reservation, 0.0)
            return place
        return Admission(reservation, place, counter)

    async def dispatch(self, claims: Sequence[SlotClaim], queued: StoreLease, lane: str,
                       cost: float) -> StoreLease | SlotRefusal:
        """Dispatch: trade the queued place for running slots (all ``claims`` or none) and
        count ``cost`` in the lane's dispatched share."""
        lease = await self.acquire(claims, releasing=queued)
        if isinstance(lease, StoreLease):
            await self.record_dispatch(lane, cost)
        return lease

    async def finish(self, lease: StoreLease | None, reservation: Reservation | None,
                     actual: float) -> None:
        """Settlement: give the slots back and settle the reservation to ``actual``."""
        if lease is not None:
            await lease.store.release(lease)
        if reservation is not None:
            await reservation.store.settle(reservation, actual)

    # -- conversations' engines (``locality: conversation``) ---------------------------

    async def home_read(self, key: str, ttl_s: float) -> str | None:
        """The engine url conversation ``key`` was last granted on by any replica (None:
        unknown, or not heard of for ``ttl_s``); the read keeps it another ``ttl_s``. In
        process: None, the dispatcher's own table is the only one."""
        return None

    def home_write(self, key: str, url: str, ttl_s: float) -> None:
        """Conversation ``key`` runs on ``url`` now, for every replica, kept ``ttl_s``
        (sent with the store's next flush: no round trip of its own). In process:
        nothing to share."""

    # -- LoRA adapters on engines (``dispatch``'s adapter share) -------------------------

    def adapter_note(self, url: str, field: str, value: str) -> None:
        """Set ``field`` of engine ``url``'s adapter notes to ``value`` for every replica
        (sent with the store's next flush: no round trip of its own; the notes of an
        engine nobody wrote for a day expire). In process: nothing to share."""

    async def adapters_read(self, urls: Sequence[str]) -> dict[str, dict[str, str]]:
        """Every replica's adapter notes on each of ``urls`` (one round trip). In
        process: none."""
        return {}

    # -- a paced tenant's rate split over engines (shared stores only) -----------------

    async def split_read(self, tenant: str, replica: str, token: str,
                         lock_ms: int) -> dict[str, str] | None:
        """Take the lock of ``tenant``'s split for ``lock_ms`` under ``token`` and read it:
        its fields (``n|<replica>|<url>`` counts of live replicas, ``a|<url>`` shares,
        ``v`` the last version), or None while another change holds the lock. Also marks
        ``replica`` alive for a lease time."""
        raise NotImplementedError("the rate split keeps its state in a shared store only")

    async def split_write(self, tenant: str, replica: str, token: str, body: str) -> None:
        """Apply one change read with ``split_read`` and release its lock: ``body`` is
        JSON ``{"d": {url: streams added}, "a": {url: share}, "v": version}``."""
        raise NotImplementedError("the rate split keeps its state in a shared store only")

    async def split_alive(self, replica: str) -> None:
        """Mark ``replica`` alive for another lease time (its stream counts stay)."""
        raise NotImplementedError("the rate split keeps its state in a shared store only")

    #: How often a replica marks itself alive (a third of the lease time).
    split_renew_s: float = 1.0

    # -- life cycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Start background work (lease renewal, charge flushing)."""

    async def close(self) -> None:
        """Stop background work and close connections."""

    def describe(self) -> dict[str, object]:
        """What /health shows about the store."""
        return {"backend": "memory", "healthy": self.healthy}


def engine_slot(url: str, max_inflight: int) -> SlotClaim:
    """A request running on engine ``url`` (its ``max_inflight`` is global)."""
    return SlotClaim(f"engine:{url}", max_inflight)


def running_slot(tenant: str, max_concurrency: int | None) -> SlotClaim:
    """A request of ``tenant`` running on any engine (``max_concurrency``)."""
    return SlotClaim(f"running:{tenant}", max_concurrency)


def lane_share_key(pool: str, lane: str) -> str:
    """The name ``lane``'s dispatches in the pool of model ``pool`` count under: lane shares
    are per pool (one fair queue per model and lane over its engines), because strict
    priority starves a lane in the pool it shares with a busier one, whatever other pools
    do."""
    return f"{lane}@model:{pool}"


def queued_slot(tenant: str, max_queued: int | None) -> SlotClaim:
    """A request of ``tenant`` waiting in any replica's queue (``max_queued``); a tenant
    holding one is backlogged, which is what :meth:`StateStore.lift` looks at."""
    return SlotClaim(f"queued:{tenant}", max_queued)
