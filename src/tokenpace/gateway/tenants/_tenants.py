"""All tenants' live states, and a configuration reload applied to them.

A reload swaps each tenant's ``config`` in place (``_levels``), so requests in flight keep
counting against the same state object and nothing is dropped; budgets whose definition
did not change keep their level. The reload is built in two steps so that thousands of tenants
never stall the event loop: ``plan`` (any thread) pairs the new configuration with the
live states and makes the new tenants' states; ``commit`` (the event loop) swaps it in,
touching only the tenants whose configuration changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..config import GatewayConfig, TenantConfig
from ._levels import TenantState
from ._series import TenantSeries


@dataclass
class ReloadPlan:
    """A reloaded configuration paired with the live states (``Tenants.plan``)."""

    config: GatewayConfig
    states: dict[str, TenantState]
    changed: list[tuple[TenantState, TenantConfig]]  # live states whose configuration changed
    removed: list[str]
    at: float


class Tenants:
    """Tenant id -> state, rebuilt on reload without losing live counters."""

    def __init__(self, config: GatewayConfig, clock: Callable[[], float],
                 saved_levels: dict[str, dict[str, tuple[float, float]]] | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        """``saved_levels``: tenant -> budget key -> (level, seconds since it was saved).
        ``wall``: unix seconds, which calendar budgets' periods follow. O(tenants), no
        metrics: a tenant's series appear with its first request."""
        self._clock = clock
        self.wall = wall
        now = clock()
        saved_levels = saved_levels or {}
        self._states = {t.id: TenantState(t, now, saved_levels.get(t.id),
                                          _saved_applications(t, saved_levels), wall)
                        for t in config.tenants}
        self.series = TenantSeries(config.metrics_idle_after_s, clock)

    def get(self, tenant_id: str) -> TenantState | None:
        return self._states.get(tenant_id)

    def __iter__(self) -> Iterator[TenantState]:
        return iter(list(self._states.values()))

    def __len__(self) -> int:
        return len(self._states)

    def touch(self, state: TenantState) -> None:
        """A request of the tenant arrived or ended: its series stay on /metrics (unless a
        reload removed it meanwhile). Per request: a dict lookup, a clock read, a store."""
        if self._states.get(state.id) is state:
            self.series.touch(state)

    def plan(self, config: GatewayConfig) -> ReloadPlan:
        """Pair a reloaded configuration with the live states: O(tenants), and safe to run
        in a worker thread while the event loop serves (it reads the live map and each
        state's ``config``, which only ``commit`` replaces, and creates the new tenants'
        states, which nothing else sees yet)."""
        now = self._clock()
        live = self._states
        states: dict[str, TenantState] = {}
        changed: list[tuple[TenantState, TenantConfig]] = []
        for tenant in config.tenants:
            state = live.get(tenant.id)
            if state is None:
                state = TenantState(tenant, now, wall=self.wall)
            elif state.config != tenant:
                changed.append((state, tenant))
            states[tenant.id] = state
        removed = [tenant_id for tenant_id in live if tenant_id not in states]
        return ReloadPlan(config, states, changed, removed, now)

    def commit(self, plan: ReloadPlan) -> None:
        """Swap a plan in (on the event loop): O(changed + removed tenants).

        A changed tenant keeps its state object, so its requests in flight go on counting
        against it; its budgets keep their levels where their definition did not change. A
        removed tenant's requests in flight still finish against their own state object;
        only its metrics series go, since it can no longer send requests.
        """
        now = self._clock()
        for state, tenant in plan.changed:
            state.reconfigure(tenant, now)
            self.series.replace(state)
        for tenant_id in plan.removed:
            self.series.forget(tenant_id)
        self.series.idle_after_s = plan.config.metrics_idle_after_s
        self._states = plan.states

    def apply(self, config: GatewayConfig) -> None:
        """``plan`` and ``commit`` in one go (tests, tools)."""
        self.commit(self.plan(config))

    def budget_samples(self) -> Iterator[tuple[tuple[str, str], float]]:
        """``((tenant, budget), level)`` now of the active tenants, for the budget gauge at
        scrape time (safe to consume across awaits: it walks copies)."""
        now = self._clock()
        for state in self.series.active():
            for key, level in state.budgets.levels(now).items():
                yield (state.id, key), level

    def application_budget_samples(self) -> Iterator[tuple[tuple[str, str, str], float]]:
        """``((tenant, application, budget), level)`` now of the active tenants'
        applications with budgets of their own, for their gauge at scrape time."""
        now = self._clock()
        for state in self.series.active():
            for app in list(state.applications.values()):  # a reload may change it meanwhile
                for key, level in app.budgets.levels(now).items():
                    yield (state.id, app.config.id, key), level

    def budget_used_samples(self) -> Iterator[tuple[tuple[str, str], float]]:
        """``((tenant, budget), fraction used)`` now of the active tenants' budgets: the
        threshold gauge (``used_ratio``), at scrape time."""
        now = self._clock()
        for state in self.series.active():
            for bucket in state.budgets.buckets:
                yield (state.id, bucket.spec.key), used_ratio(bucket.level(now), bucket.spec.tokens)

    def application_budget_used_samples(self) -> Iterator[tuple[tuple[str, str, str], float]]:
        """As ``budget_used_samples``, for the active tenants' applications' own budgets."""
        now = self._clock()
        for state in self.series.active():
            for app in list(state.applications.values()):
                for bucket in app.budgets.buckets:
                    yield ((state.id, app.config.id, bucket.spec.key),
                           used_ratio(bucket.level(now), bucket.spec.tokens))

    def changed_levels(self) -> dict[str, dict[str, float]]:
        """The budget levels now of the tenants whose levels changed since the last call
        (the snapshot to the ledger). O(tenants) flag reads, once a second."""
        now = self._clock()
        out: dict[str, dict[str, float]] = {}
        for state in self._states.values():
            if state.take_dirty():
                out.update(state.levels(now))
        return out


def used_ratio(level: float, tokens: float) -> float:
    """The fraction of a budget of ``tokens`` used at ``level`` (above 1: in debt)."""
    return (tokens - level) / tokens


def _saved_applications(tenant: TenantConfig, saved: dict[str, dict[str, tuple[float, float]]],
                        ) -> dict[str, dict[str, tuple[float, float]]] | None:
    """The saved levels of the tenant's applications (kept under their owner names)."""
    if not tenant.applications:
        return None
    return {owner: saved[owner] for a in tenant.applications
            if (owner := a.owner(tenant.id)) in saved}
