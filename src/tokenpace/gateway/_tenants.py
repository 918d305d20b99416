"""Live per-tenant state: counters and budgets that outlive a configuration reload.

A reload swaps each tenant's ``config`` in place, so requests in flight keep counting
against the same state object and nothing is dropped; budgets whose definition did not
change keep their level. The reload is built in two steps so that thousands of tenants
never stall the event loop: ``plan`` (any thread) pairs the new configuration with the
live states and makes the new tenants' states; ``commit`` (the event loop) swaps it in,
touching only the tenants whose configuration changed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..fairness import BudgetRefusal, TenantBudgets
from ._config import ApplicationConfig, GatewayConfig, TenantConfig
from ._series import TenantSeries


TOKENIZE_SLOTS_PER_TENANT = 2


C = TypeVar("C", TenantConfig, ApplicationConfig)


class LimitState(Generic[C]):
    """What a tenant and an application inside it both keep: the counters the admission
    checks read and the buckets of their limits (``C``: its configuration's type)."""

    def __init__(self, config: C, now: float,
                 saved: dict[str, tuple[float, float]] | None = None) -> None:
        self.config = config
        saved = saved or {}
        levels = {b.key: saved[b.key][0] + saved[b.key][1] * b.refill_per_s
                  for b in config.budgets if b.key in saved}
        self.budgets = TenantBudgets(list(config.budgets), now, levels)
        # max_requests, in process (the shared store keeps its own with state: redis).
        self.request_limits = TenantBudgets(list(config.max_requests), now)
        # Limits in observe mode (``_observe``), kept as if enforced.
        self.observed_budgets = TenantBudgets(list(config.observed_budgets), now)
        self.observed_requests = TenantBudgets(list(config.observed_requests), now)
        self.inflight = 0
        # Budget levels changed since the last snapshot to the ledger: the snapshot writes
        # these only (an untouched tenant's saved level still refills correctly on restore).
        self.dirty = False

    @property
    def owner(self) -> str:
        """The name its limits are kept under in the shared store and the ledger."""
        raise NotImplementedError

    @property
    def tenant_id(self) -> str:
        raise NotImplementedError

    @property
    def application_id(self) -> str:
        """The application's id; ``""`` for the tenant itself (a metric label)."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        """How refusals name it: ``tenant 'acme'``, ``application 'bot' of tenant 'acme'``."""
        raise NotImplementedError

    def at_concurrency_limit(self) -> bool:
        limit = self.config.max_concurrency
        return limit is not None and self.inflight >= limit

    def try_reserve(self, cost: float, now: float) -> BudgetRefusal | None:
        self.dirty = True
        return self.budgets.try_reserve(cost, now)

    def settle(self, reserved: float, actual: float, now: float) -> None:
        self.dirty = True
        self.budgets.settle(reserved, actual, now)

    def take_request(self, now: float) -> BudgetRefusal | None:
        """Count one request against every ``max_requests`` limit, or the refusal."""
        return self.request_limits.try_reserve(1.0, now)

    def reconfigure(self, config: C, now: float) -> None:
        """Take a reloaded configuration: buckets whose definition did not change keep
        their levels (``TenantBudgets.carry_over``), the others start full."""
        if self.config.budgets != config.budgets:
            old_budgets = self.budgets
            self.budgets = TenantBudgets(list(config.budgets), now)
            self.budgets.carry_over(old_budgets, now)
            self.dirty = True
        for attr, specs in (("request_limits", "max_requests"),
                            ("observed_budgets", "observed_budgets"),
                            ("observed_requests", "observed_requests")):
            if getattr(self.config, specs) != getattr(config, specs):
                old_buckets = getattr(self, attr)
                buckets = TenantBudgets(list(getattr(config, specs)), now)
                buckets.carry_over(old_buckets, now)
                setattr(self, attr, buckets)
        self.config = config


class ApplicationState(LimitState[ApplicationConfig]):
    """An application inside a tenant: its limits apply inside the tenant's."""

    def __init__(self, config: ApplicationConfig, tenant_id: str, now: float,
                 saved: dict[str, tuple[float, float]] | None = None) -> None:
        super().__init__(config, now, saved)
        self._tenant_id = tenant_id
        self._owner = config.owner(tenant_id)

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def tenant_id(self) -> str:
        return self._tenant_id

    @property
    def application_id(self) -> str:
        return self.config.id

    @property
    def owner(self) -> str:
        return self._owner

    @property
    def label(self) -> str:
        return f"application {self.config.id!r} of tenant {self._tenant_id!r}"


class TenantState(LimitState[TenantConfig]):
    """A tenant's counters and buckets, and its applications'."""

    def __init__(self, config: TenantConfig, now: float,
                 saved: dict[str, tuple[float, float]] | None = None,
                 saved_applications: dict[str, dict[str, tuple[float, float]]] | None = None,
                 ) -> None:
        """``saved_applications``: application owner -> its saved budget levels."""
        super().__init__(config, now, saved)
        saved_applications = saved_applications or {}
        self.applications = {
            a.id: ApplicationState(a, config.id, now, saved_applications.get(a.owner(config.id)))
            for a in config.applications}
        self.queued = 0
        self.service_s: float | None = None  # moving average of time on the engine
        # Prompt counts in flight at the engine's /tokenize: a tenant's huge prompts wait
        # for each other here instead of taking every tokenizer slot of the engine.
        self.tokenize_slots = asyncio.Semaphore(TOKENIZE_SLOTS_PER_TENANT)

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def owner(self) -> str:
        return self.config.id

    @property
    def tenant_id(self) -> str:
        return self.config.id

    @property
    def application_id(self) -> str:
        return ""

    @property
    def label(self) -> str:
        return f"tenant {self.config.id!r}"

    def record_service(self, seconds: float) -> None:
        """A dispatched request ended after ``seconds`` on the engine (moving average)."""
        self.service_s = seconds if self.service_s is None else 0.8 * self.service_s + 0.2 * seconds

    def slot_wait_s(self) -> float:
        """Expected seconds until one of the tenant's running requests ends and a slot
        frees (its recent service time spread over what runs; 1 s before any is known):
        the ``retry-after`` of a full queue or a queue timeout."""
        if self.service_s is None:
            return 1.0
        return max(0.001, self.service_s / max(1, self.inflight))

    def queue_full(self) -> bool:
        limit = self.config.max_queued
        return limit is not None and self.queued >= limit

    def reconfigure(self, config: TenantConfig, now: float) -> None:
        """The tenant's and its applications' new configuration. An application that stays
        keeps its state (levels, requests in flight); a removed one's requests in flight
        finish against their own state object."""
        apps: dict[str, ApplicationState] = {}
        for app in config.applications:
            state = self.applications.get(app.id)
            if state is None:
                state = ApplicationState(app, config.id, now)
            elif state.config != app:
                state.reconfigure(app, now)
            apps[app.id] = state
        self.applications = apps
        super().reconfigure(config, now)

    def levels(self, now: float) -> Iterator[tuple[str, dict[str, float]]]:
        """(owner, budget key -> level now) of the tenant and of each application with
        budgets: what the ledger's snapshot keeps."""
        yield self.owner, self.budgets.levels(now)
        for app in self.applications.values():
            if app.config.budgets:
                yield app.owner, app.budgets.levels(now)

    def take_dirty(self) -> bool:
        """Whether the tenant's or an application's levels changed since the last call."""
        dirty = self.dirty or any(a.dirty for a in self.applications.values())
        self.dirty = False
        for app in self.applications.values():
            app.dirty = False
        return dirty


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
                 saved_levels: dict[str, dict[str, tuple[float, float]]] | None = None) -> None:
        """``saved_levels``: tenant -> budget key -> (level, seconds since it was saved).
        O(tenants), no metrics: a tenant's series appear with its first request."""
        self._clock = clock
        now = clock()
        saved_levels = saved_levels or {}
        self._states = {t.id: TenantState(t, now, saved_levels.get(t.id),
                                          _saved_applications(t, saved_levels))
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
                state = TenantState(tenant, now)
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
        scrape time."""
        now = self._clock()
        for state in self.series.active():
            for key, level in state.budgets.levels(now).items():
                yield (state.id, key), level

    def application_budget_samples(self) -> Iterator[tuple[tuple[str, str, str], float]]:
        """``((tenant, application, budget), level)`` now of the active tenants'
        applications with budgets of their own, for their gauge at scrape time."""
        now = self._clock()
        for state in self.series.active():
            for app in state.applications.values():
                for key, level in app.budgets.levels(now).items():
                    yield (state.id, app.config.id, key), level

    def changed_levels(self) -> dict[str, dict[str, float]]:
        """The budget levels now of the tenants whose levels changed since the last call
        (the snapshot to the ledger). O(tenants) flag reads, once a second."""
        now = self._clock()
        out: dict[str, dict[str, float]] = {}
        for state in self._states.values():
            if state.take_dirty():
                out.update(state.levels(now))
        return out


def _saved_applications(tenant: TenantConfig, saved: dict[str, dict[str, tuple[float, float]]],
                        ) -> dict[str, dict[str, tuple[float, float]]] | None:
    """The saved levels of the tenant's applications (kept under their owner names)."""
    if not tenant.applications:
        return None
    return {owner: saved[owner] for a in tenant.applications
            if (owner := a.owner(tenant.id)) in saved}
