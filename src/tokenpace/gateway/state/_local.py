"""State in this process: what one gateway replica needs, and the open-mode fallback.

As the fallback of a shared store (``on_state_failure: open``) it divides every limit by
the number of replicas, so that N replicas cut off from Redis together admit about what
one would with it. Every operation is a few dictionary operations: O(number of budgets)
for budgets, O(claims) for slots, O(tenants in the lane) for a lift.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Sequence

from ...fairness import Bucket, BudgetRefusal, BudgetSpec, TenantBudgets, make_bucket
from ._base import LANE_KEEP_S, Reservation, SlotClaim, SlotRefusal, StateStore, StoreLease


class LocalStore(StateStore):
    """In-process budgets, slots and counters. ``divisor`` scales every limit down."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, divisor: int = 1,
                 wall: Callable[[], float] = time.time) -> None:
        """``wall``: unix seconds, which calendar budgets' periods follow."""
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor}")
        self._clock = clock
        self._wall = wall
        self.divisor = divisor
        self._buckets: dict[tuple[str, str], Bucket] = {}
        self._slots: dict[str, set[str]] = {}
        self._counters: dict[str, dict[str, float]] = {}
        self._largest: dict[str, float] = {}  # lane -> its largest counter
        self._backlog: dict[str, set[str]] = {}  # lane -> tenants that entered its backlog
        self._dispatched: dict[str, deque[tuple[float, float]]] = {}

    def scaled(self, spec: BudgetSpec) -> BudgetSpec:
        return spec if self.divisor == 1 else dataclasses.replace(
            spec, tokens=spec.tokens / self.divisor)

    def scaled_limit(self, limit: int | None) -> int | None:
        """``limit / divisor``, at least 1 so that a small limit still lets work through."""
        return None if limit is None or self.divisor == 1 else max(1, limit // self.divisor)

    # -- budgets ---------------------------------------------------------------------

    def _tenant_budgets(self, tenant: str, budgets: Sequence[BudgetSpec]) -> TenantBudgets:
        now = self._clock()
        group = TenantBudgets([], now)
        for spec in budgets:
            key = (tenant, spec.key)
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = make_bucket(self.scaled(spec), now, None,
                                                          self._wall)
            group.buckets.append(bucket)
        return group

    def restore_levels(self, tenant: str, budgets: Sequence[BudgetSpec],
                       levels: dict[str, float]) -> None:
        """Start ``tenant``'s buckets at saved levels (budget key -> level), e.g. the levels
        the ledger kept across a restart of a single replica."""
        now = self._clock()
        for spec in budgets:
            if spec.key in levels:
                self._buckets[(tenant, spec.key)] = make_bucket(self.scaled(spec), now,
                                                                levels[spec.key], self._wall)

    async def reserve(self, tenant: str, budgets: Sequence[BudgetSpec],
                      cost: float) -> Reservation | BudgetRefusal:
        group, now = self._tenant_budgets(tenant, budgets), self._clock()
        refusal = group.try_reserve(cost, now)
        if refusal is not None:
            return refusal
        return Reservation(tenant, tuple(budgets), cost, self,
                           tuple(b.level(now) for b in group.buckets),
                           tuple(b.until_full(now) for b in group.buckets))

    async def settle(self, reservation: Reservation, actual: float) -> None:
        self._tenant_budgets(reservation.tenant, reservation.budgets).settle(
            reservation.cost, actual, self._clock())

    async def budget_levels(self, tenant: str, budgets: Sequence[BudgetSpec]) -> dict[str, float]:
        now = self._clock()
        group = self._tenant_budgets(tenant, budgets)
        return {spec.key: b.level(now) for spec, b in zip(budgets, group.buckets)}

    # -- slots -----------------------------------------------------------------------

    async def acquire(self, claims: Sequence[SlotClaim],
                      releasing: StoreLease | None = None) -> StoreLease | SlotRefusal:
        for claim in claims:
            limit = self.scaled_limit(claim.limit) if self.divisor > 1 else claim.limit
            held = len(self._slots.get(claim.key, ()))
            if limit is not None and held >= limit:
                return SlotRefusal(claim, held)
        lease = StoreLease(tuple(c.key for c in claims), self)
        for key in lease.keys:
            self._slots.setdefault(key, set()).add(lease.id)
        if releasing is not None:
            await releasing.store.release(releasing)
        return lease

    async def release(self, lease: StoreLease) -> None:
        if lease.released:
            return
        lease.released = True
        for key in lease.keys:
            holders = self._slots.get(key)
            if holders is not None:
                holders.discard(lease.id)
                if not holders:
                    del self._slots[key]

    async def held(self, keys: Sequence[str]) -> dict[str, int]:
        return {key: len(self._slots.get(key, ())) for key in keys}

    def lease_count(self) -> int:
        """Leases held now (as a fallback: those taken while the shared store was down and
        not yet given back). O(slots held)."""
        return len({lease for holders in self._slots.values() for lease in holders})

    # -- fair queue ------------------------------------------------------------------

    def charge(self, lane: str, tenant: str, amount: float) -> None:
        lane_counters = self._counters.setdefault(lane, {})
        counter = lane_counters[tenant] = lane_counters.get(tenant, 0.0) + amount
        if counter > self._largest.get(lane, 0.0):
            self._largest[lane] = counter

    async def counters(self, lane: str, tenants: Sequence[str]) -> dict[str, float]:
        lane_counters = self._counters.get(lane, {})
        return {t: lane_counters.get(t, 0.0) for t in tenants}

    async def lift(self, lane: str, tenant: str) -> float:
        """As the Redis store's: O(tenants that entered the backlog and may still be in it)."""
        lane_counters = self._counters.setdefault(lane, {})
        members = self._backlog.setdefault(lane, set())
        backlogged = []
        for other in list(members):
            if other == tenant:
                continue
            if self._slots.get(f"queued:{other}"):
                backlogged.append(lane_counters.get(other, 0.0))
            else:
                members.discard(other)
        members.add(tenant)
        floor = min(backlogged) if backlogged else self._largest.get(lane)
        current = lane_counters.get(tenant, 0.0)
        if floor is not None and floor > current:
            lane_counters[tenant] = current = floor
        return current

    async def record_dispatch(self, lane: str, cost: float) -> None:
        self.count_dispatch(lane, cost)

    def count_dispatch(self, lane: str, cost: float) -> None:
        now = self._clock()
        events = self._dispatched.setdefault(lane, deque())
        while events and events[0][0] < now - LANE_KEEP_S:  # bounded even if never read
            events.popleft()
        events.append((now, cost))

    async def lane_costs(self, lanes: Sequence[str], window_s: float) -> dict[str, float]:
        horizon = self._clock() - window_s
        out = {}
        for lane in lanes:
            events = self._dispatched.get(lane, deque())
            while events and events[0][0] < horizon:
                events.popleft()
            out[lane] = math.fsum(cost for _, cost in events)
        return out
