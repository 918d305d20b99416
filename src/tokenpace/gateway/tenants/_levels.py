"""The live state of a tenant and of each application inside it: counters and buckets.

One object per tenant (and per application) for the gateway's life: a reload swaps its
``config`` in place (``reconfigure``), so requests in flight keep counting against the
same object and budgets whose definition did not change keep their level.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from ...fairness import BudgetRefusal, BudgetSpec, TenantBudgets, period_start
from ..config import ApplicationConfig, TenantConfig
from ._body_rate import BodyRate

TOKENIZE_SLOTS_PER_TENANT = 2


C = TypeVar("C", TenantConfig, ApplicationConfig)


class LimitState(Generic[C]):
    """What a tenant and an application inside it both keep: the counters the admission
    checks read and the buckets of their limits (``C``: its configuration's type)."""

    def __init__(self, config: C, now: float,
                 saved: dict[str, tuple[float, float]] | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        """``saved``: budget key -> (level, seconds since it was saved); ``wall``: unix
        seconds, which calendar budgets' periods follow."""
        self.config = config
        self.wall = wall
        saved = saved or {}
        levels = {b.key: _restored(b, *saved[b.key], wall)
                  for b in config.budgets if b.key in saved}
        self.budgets = TenantBudgets(list(config.budgets), now, levels, wall)
        # max_requests, in process (the shared store keeps its own with state: redis).
        self.request_limits = TenantBudgets(list(config.max_requests), now)
        # Limits in observe mode (``admission._observe``), kept as if enforced.
        self.observed_budgets = TenantBudgets(list(config.observed_budgets), now, None, wall)
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
            self.budgets = TenantBudgets(list(config.budgets), now, None, self.wall)
            self.budgets.carry_over(old_budgets, now)
            self.dirty = True
        for attr, specs in (("request_limits", "max_requests"),
                            ("observed_budgets", "observed_budgets"),
                            ("observed_requests", "observed_requests")):
            if getattr(self.config, specs) != getattr(config, specs):
                old_buckets = getattr(self, attr)
                buckets = TenantBudgets(list(getattr(config, specs)), now, None, self.wall)
                buckets.carry_over(old_buckets, now)
                setattr(self, attr, buckets)
        self.config = config


def _restored(budget: BudgetSpec, level: float, age_s: float,
              wall: Callable[[], float]) -> float | None:
    """A saved level as it stands now: refilled for the time since it was saved, or for a
    calendar budget kept only if saved in the current period (None: whole)."""
    if budget.calendar is None:
        return level + age_s * budget.refill_per_s
    now = wall()
    return level if now - age_s >= period_start(budget.calendar, now) else None


class ApplicationState(LimitState[ApplicationConfig]):
    """An application inside a tenant: its limits apply inside the tenant's."""

    def __init__(self, config: ApplicationConfig, tenant_id: str, now: float,
                 saved: dict[str, tuple[float, float]] | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        super().__init__(config, now, saved, wall)
        self._tenant_id = tenant_id
        self._owner = config.owner(tenant_id)
        # An attribute, not a property of ``config``: read a dozen times per request, and a
        # reload pairs states by id, so it never changes.
        self.id = config.id

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
                 wall: Callable[[], float] = time.time) -> None:
        """``saved_applications``: application owner -> its saved budget levels."""
        super().__init__(config, now, saved, wall)
        saved_applications = saved_applications or {}
        self.applications = {
            a.id: ApplicationState(a, config.id, now, saved_applications.get(a.owner(config.id)),
                                   wall)
            for a in config.applications}
        self.queued = 0
        self.service_s: float | None = None  # moving average of time on the engine
        # Prompt counts in flight at the engine's /tokenize: a tenant's huge prompts wait
        # for each other here instead of taking every tokenizer slot of the engine.
        self.tokenize_slots = asyncio.Semaphore(TOKENIZE_SLOTS_PER_TENANT)
        rate = config.max_body_bytes_per_second
        self.body_rate: BodyRate | None = None if rate is None else BodyRate(rate)
        # An attribute, not a property of ``config``: read a dozen times per request, and a
        # reload pairs states by id, so it never changes.
        self.id = config.id

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
                state = ApplicationState(app, config.id, now, wall=self.wall)
            elif state.config != app:
                state.reconfigure(app, now)
            apps[app.id] = state
        self.applications = apps
        rate = config.max_body_bytes_per_second
        if rate is None:
            self.body_rate = None
        elif self.body_rate is None:
            self.body_rate = BodyRate(rate)
        else:
            self.body_rate.rate = rate  # the debt owed so far stands
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
