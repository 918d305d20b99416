"""The budget gauge when budgets live in the shared state store.

With ``state: redis://...`` a tenant's buckets are in Redis and every replica spends from
them; the process's own buckets are unused. The gauges ``budget_remaining_tokens`` and
``budget_used_ratio`` must then show the shared level, as every replica sees it. Prometheus collectors are synchronous and
a scrape must not wait on the network, so the levels are read in the background every
``REFRESH_S`` and the scrape publishes the last reading: a level is at most ``REFRESH_S``
(plus one round trip) old, which is finer than any budget window worth alerting on.

Only the active tenants' levels are read (those with series on /metrics, ``_series``):
one store call (one Redis script) per active tenant with budgets per refresh, and one per
application of theirs with budgets of its own, off every request's path; about 2 store
calls a second with 4 active budgeted tenants, however many are configured.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from ..state import StateStore, StateUnavailable
from ._series import TenantSeries
from ._tenants import used_ratio

logger = logging.getLogger("tokenpace.gateway")

REFRESH_S = 2.0


class SharedBudgetLevels:
    """The last levels read from the store, for the gauge at scrape time."""

    def __init__(self, tenants: TenantSeries, store: StateStore) -> None:
        self._tenants = tenants
        self._store = store
        self._levels: dict[tuple[str, str], float] = {}
        self._application_levels: dict[tuple[str, str, str], float] = {}
        # The same readings as fractions used (the threshold gauge).
        self._used: dict[tuple[str, str], float] = {}
        self._application_used: dict[tuple[str, str, str], float] = {}

    async def refresh(self) -> None:
        """Read every active budgeted tenant's levels and its applications'. A store that
        does not answer leaves no series rather than stale ones (its outage shows in
        ``state_up``); a tenant removed by a reload, or gone idle, drops out with the next
        reading."""
        levels: dict[tuple[str, str], float] = {}
        application_levels: dict[tuple[str, str, str], float] = {}
        used: dict[tuple[str, str], float] = {}
        application_used: dict[tuple[str, str, str], float] = {}
        try:
            for state in self._tenants.active():
                budgets = state.config.budgets
                if budgets:
                    read = await self._store.budget_levels(state.id, budgets)
                    for b in budgets:
                        levels[(state.id, b.key)] = read[b.key]
                        used[(state.id, b.key)] = used_ratio(read[b.key], b.tokens)
                for app in state.applications.values():
                    if app.config.budgets:
                        read = await self._store.budget_levels(app.owner, app.config.budgets)
                        for b in app.config.budgets:
                            labels = (state.id, app.config.id, b.key)
                            application_levels[labels] = read[b.key]
                            application_used[labels] = used_ratio(read[b.key], b.tokens)
        except StateUnavailable:
            levels, application_levels, used, application_used = {}, {}, {}, {}
        self._levels, self._application_levels = levels, application_levels
        self._used, self._application_used = used, application_used

    def samples(self) -> Iterable[tuple[tuple[str, ...], float]]:
        return list(self._levels.items())

    def application_samples(self) -> Iterable[tuple[tuple[str, ...], float]]:
        return list(self._application_levels.items())

    def used_samples(self) -> Iterable[tuple[tuple[str, ...], float]]:
        return list(self._used.items())

    def application_used_samples(self) -> Iterable[tuple[tuple[str, ...], float]]:
        return list(self._application_used.items())

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a failed reading must not end the loop
                logger.exception("reading the shared budget levels failed")
            await asyncio.sleep(REFRESH_S)
