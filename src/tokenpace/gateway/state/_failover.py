"""What happens while the shared store does not answer: ``on_state_failure``.

``closed`` (the default): every decision that could overspend (reserve, acquire, lift)
raises :class:`StateUnavailable`, which the gateway answers with 503 and ``retry-after``.
Nothing is admitted that Redis did not approve.

``open``: those decisions go to a :class:`LocalStore` whose limits are each divided by the
number of replicas, so N replicas cut off from Redis together admit about what one replica
admits. Each fallback is counted (by operation) and the switch is logged once each way.

Either way, ending a request never fails: a settlement Redis misses leaves the tenant
charged its full reservation (never less than it used), a release Redis misses expires
with the lease. Settlements and releases always go to the store that made the
reservation or lease, so fallback reservations are settled in the fallback.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from ...fairness import BudgetRefusal, BudgetSpec
from ._base import (
    Admission,
    FairnessView,
    Reservation,
    SlotClaim,
    SlotRefusal,
    StateStore,
    StateUnavailable,
    StoreLease,
)
from ._local import LocalStore
from ._redis import RedisStore

logger = logging.getLogger("tokenpace.gateway.state")

T = TypeVar("T")


class FailoverStore(StateStore):
    """A :class:`RedisStore` with the configured behaviour when it fails."""

    def __init__(self, primary: RedisStore, on_failure: str, fallback: LocalStore) -> None:
        if on_failure not in ("closed", "open"):
            raise ValueError(f"on_failure must be 'closed' or 'open', got {on_failure!r}")
        self.primary = primary
        self.on_failure = on_failure
        self.fallback = fallback
        self.fallbacks: Counter[str] = Counter()
        self.lost_settlements = 0
        self._falling_back = False

    @property
    def healthy(self) -> bool:  # type: ignore[override]
        return self.primary.healthy

    async def _decide(self, operation: str, shared: Callable[[], Awaitable[T]],
                      local: Callable[[], Awaitable[T]]) -> T:
        try:
            result = await shared()
        except StateUnavailable:
            if self.on_failure == "closed":
                raise
            self.fallbacks[operation] += 1
            if not self._falling_back:
                self._falling_back = True
                logger.warning("state store unreachable: admitting under per-replica fallback "
                               "limits (each limit / %d) until it answers", self.fallback.divisor)
            return await local()
        if self._falling_back:
            self._falling_back = False
            logger.warning("state store answers again: shared limits apply")
        return result

    # -- budgets ---------------------------------------------------------------------

    async def reserve(self, tenant: str, budgets: Sequence[BudgetSpec],
                      cost: float) -> Reservation | BudgetRefusal:
        return await self._decide("reserve", lambda: self.primary.reserve(tenant, budgets, cost),
                                  lambda: self.fallback.reserve(tenant, budgets, cost))

    async def settle(self, reservation: Reservation, actual: float) -> None:
        try:
            await reservation.store.settle(reservation, actual)
        except StateUnavailable:
            self.lost_settlements += 1

    async def budget_levels(self, tenant: str, budgets: Sequence[BudgetSpec]) -> dict[str, float]:
        return await self._decide("levels", lambda: self.primary.budget_levels(tenant, budgets),
                                  lambda: self.fallback.budget_levels(tenant, budgets))

    # -- slots -----------------------------------------------------------------------

    async def acquire(self, claims: Sequence[SlotClaim],
                      releasing: StoreLease | None = None) -> StoreLease | SlotRefusal:
        async def local() -> StoreLease | SlotRefusal:
            lease = await self.fallback.acquire(claims)
            if isinstance(lease, StoreLease) and releasing is not None:
                await self.release(releasing)
            return lease
        return await self._decide("acquire", lambda: self.primary.acquire(claims, releasing), local)

    async def release(self, lease: StoreLease) -> None:
        try:
            await lease.store.release(lease)
        except StateUnavailable:
            pass  # the lease expires by itself

    async def held(self, keys: Sequence[str]) -> dict[str, int]:
        return await self._decide("held", lambda: self.primary.held(keys),
                                  lambda: self.fallback.held(keys))

    # -- fair queue ------------------------------------------------------------------

    def charge(self, lane: str, tenant: str, amount: float) -> None:
        self.primary.charge(lane, tenant, amount)
        self.fallback.charge(lane, tenant, amount)

    async def home_read(self, key: str, ttl_s: float) -> str | None:
        # No fallback: the dispatcher's own table is the answer while Redis is away.
        return await self.primary.home_read(key, ttl_s)

    def home_write(self, key: str, url: str, ttl_s: float) -> None:
        self.primary.home_write(key, url, ttl_s)

    def adapter_note(self, url: str, field: str, value: str) -> None:
        self.primary.adapter_note(url, field, value)

    async def adapters_read(self, urls: Sequence[str]) -> dict[str, dict[str, str]]:
        # No fallback: each replica goes by what it knows itself while Redis is away.
        return await self.primary.adapters_read(urls)

    async def counters(self, lane: str, tenants: Sequence[str]) -> dict[str, float]:
        return await self._decide("counters", lambda: self.primary.counters(lane, tenants),
                                  lambda: self.fallback.counters(lane, tenants))

    async def lift(self, lane: str, tenant: str) -> float:
        return await self._decide("lift", lambda: self.primary.lift(lane, tenant),
                                  lambda: self.fallback.lift(lane, tenant))

    async def record_dispatch(self, lane: str, cost: float) -> None:
        await self.fallback.record_dispatch(lane, cost)
        try:
            await self.primary.record_dispatch(lane, cost)
        except StateUnavailable:
            pass  # lane shares only steer; a missed second is not worth a refusal

    def count_dispatch(self, lane: str, cost: float) -> None:
        # Not in the fallback: without Redis a dispatcher goes by its own queue's window.
        self.primary.count_dispatch(lane, cost)

    async def lane_costs(self, lanes: Sequence[str], window_s: float) -> dict[str, float]:
        return await self._decide("lane_costs", lambda: self.primary.lane_costs(lanes, window_s),
                                  lambda: self.fallback.lane_costs(lanes, window_s))

    async def read_fairness(self, counters: Mapping[str, Sequence[str]], lanes: Sequence[str],
                            window_s: float) -> FairnessView:
        """Open: the fallback's counters and no lane costs (the dispatcher then goes by
        its own queues' windows, which hold every dispatch of this replica)."""
        return await self._decide("counters",
                                  lambda: self.primary.read_fairness(counters, lanes, window_s),
                                  lambda: self.fallback.read_fairness(counters, (), window_s))

    # -- one call per gateway stage ------------------------------------------------------

    async def admit(self, tenant: str, budgets: Sequence[BudgetSpec], cost: float,
                    queued: SlotClaim, lane: str) -> Admission | BudgetRefusal | SlotRefusal:
        return await self._decide(
            "admit", lambda: self.primary.admit(tenant, budgets, cost, queued, lane),
            lambda: self.fallback.admit(tenant, budgets, cost, queued, lane))

    async def dispatch(self, claims: Sequence[SlotClaim], queued: StoreLease, lane: str,
                       cost: float) -> StoreLease | SlotRefusal:
        async def local() -> StoreLease | SlotRefusal:
            lease = await self.fallback.acquire(claims)
            if isinstance(lease, StoreLease):
                await self.release(queued)
                await self.fallback.record_dispatch(lane, cost)
            return lease
        return await self._decide("dispatch",
                                  lambda: self.primary.dispatch(claims, queued, lane, cost), local)

    async def finish(self, lease: StoreLease | None, reservation: Reservation | None,
                     actual: float) -> None:
        stores = {x.store for x in (lease, reservation) if x is not None}
        if len(stores) != 1:
            if lease is not None:
                await self.release(lease)
            if reservation is not None:
                await self.settle(reservation, actual)
            return
        try:
            await stores.pop().finish(lease, reservation, actual)
        except StateUnavailable:
            if reservation is not None and reservation.cost != actual:
                self.lost_settlements += 1

    # -- rate split: no fallback (StateUnavailable goes to the caller, see _shared_split)

    async def split_read(self, tenant: str, replica: str, token: str,
                         lock_ms: int) -> dict[str, str] | None:
        return await self.primary.split_read(tenant, replica, token, lock_ms)

    async def split_write(self, tenant: str, replica: str, token: str, body: str) -> None:
        await self.primary.split_write(tenant, replica, token, body)

    async def split_alive(self, replica: str) -> None:
        await self.primary.split_alive(replica)

    @property
    def split_renew_s(self) -> float:  # type: ignore[override]
        return self.primary.split_renew_s

    # -- life cycle ------------------------------------------------------------------

    async def start(self) -> None:
        await self.primary.start()

    async def close(self) -> None:
        await self.primary.close()

    def describe(self) -> dict[str, object]:
        return {**self.primary.describe(), "on_state_failure": self.on_failure,
                "fallback_divisor": self.fallback.divisor,
                "fallback_leases": self.fallback.lease_count()}
