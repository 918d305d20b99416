"""Live per-tenant state: counters and budgets that outlive a configuration reload.

A reload swaps each tenant's ``config`` in place, so requests in flight keep counting
against the same state object and nothing is dropped; budgets whose definition did not
change keep their level.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator

from ..fairness import BudgetRefusal, TenantBudgets
from . import _metrics as metrics
from ._config import GatewayConfig, TenantConfig


TOKENIZE_SLOTS_PER_TENANT = 2


class TenantState:
    """Counters the admission checks read, and the tenant's budgets."""

    def __init__(self, config: TenantConfig, now: float,
                 saved: dict[str, tuple[float, float]] | None = None) -> None:
        self.config = config
        saved = saved or {}
        levels = {b.key: saved[b.key][0] + saved[b.key][1] * b.refill_per_s
                  for b in config.budgets if b.key in saved}
        self.budgets = TenantBudgets(list(config.budgets), now, levels)
        self.inflight = 0
        self.queued = 0
        self.service_s: float | None = None  # moving average of time on the engine
        # Prompt counts in flight at the engine's /tokenize: a tenant's huge prompts wait
        # for each other here instead of taking every tokenizer slot of the engine.
        self.tokenize_slots = asyncio.Semaphore(TOKENIZE_SLOTS_PER_TENANT)

    @property
    def id(self) -> str:
        return self.config.id

    def at_concurrency_limit(self) -> bool:
        limit = self.config.max_concurrency
        return limit is not None and self.inflight >= limit

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

    def try_reserve(self, cost: float, now: float) -> BudgetRefusal | None:
        return self.budgets.try_reserve(cost, now)

    def settle(self, reserved: float, actual: float, now: float) -> None:
        self.budgets.settle(reserved, actual, now)


class Tenants:
    """Tenant id -> state, rebuilt on reload without losing live counters."""

    def __init__(self, config: GatewayConfig, clock: Callable[[], float],
                 saved_levels: dict[str, dict[str, tuple[float, float]]] | None = None) -> None:
        """``saved_levels``: tenant -> budget key -> (level, seconds since it was saved)."""
        self._clock = clock
        now = clock()
        saved_levels = saved_levels or {}
        self._states = {t.id: TenantState(t, now, saved_levels.get(t.id)) for t in config.tenants}
        for state in self._states.values():
            metrics.publish_output_rate(state.id, state.config.output_tokens_per_second)
            metrics.INFLIGHT.labels(state.id).set(0)
            metrics.QUEUED.labels(state.id).set(0)

    def get(self, tenant_id: str) -> TenantState | None:
        return self._states.get(tenant_id)

    def __iter__(self) -> Iterable[TenantState]:
        return iter(list(self._states.values()))

    def apply(self, config: GatewayConfig) -> None:
        """Take a reloaded configuration: update, add and remove tenants.

        A removed tenant's requests in flight still finish against their own state object;
        only its metrics series go, since it can no longer send requests.
        """
        now = self._clock()
        new_states: dict[str, TenantState] = {}
        for tenant in config.tenants:
            state = self._states.get(tenant.id)
            if state is None:
                state = TenantState(tenant, now)
                metrics.INFLIGHT.labels(state.id).set(0)
                metrics.QUEUED.labels(state.id).set(0)
            else:
                old_budgets = state.budgets
                state.config = tenant
                state.budgets = TenantBudgets(list(tenant.budgets), now)
                state.budgets.carry_over(old_budgets, now)
            metrics.publish_output_rate(tenant.id, tenant.output_tokens_per_second)
            new_states[tenant.id] = state
        for tenant_id in set(self._states) - set(new_states):
            metrics.forget_tenant(tenant_id)
        self._states = new_states

    def budget_samples(self) -> Iterator[tuple[tuple[str, str], float]]:
        """``((tenant, budget), level)`` now, for the budget gauge at scrape time."""
        now = self._clock()
        for state in self._states.values():
            for key, level in state.budgets.levels(now).items():
                yield (state.id, key), level

    def budget_levels(self) -> dict[str, dict[str, float]]:
        now = self._clock()
        return {s.id: s.budgets.levels(now) for s in self._states.values()}
