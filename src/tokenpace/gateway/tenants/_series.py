"""Which tenants have series on /metrics: those with traffic lately.

A platform with ten thousand configured tenants has a few hundred active at a time, and a
scrape's size and render time grow with the series on it; so a tenant's series appear with
its first request and go once it has had nothing in flight and nothing queued for
``metrics_idle_after`` (default 15 minutes): a scrape costs O(active tenants), not
O(configured tenants). A counter that goes and comes back starts again from zero, which
Prometheus's ``rate`` and ``increase`` read as a counter reset: nothing is lost but the
increments before the first scrape of the new series, as for any new series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from .. import metrics
from ._would_reject import forget as forget_would_reject

if TYPE_CHECKING:
    from ._levels import TenantState


class TenantSeries:
    """The tenants whose series are on /metrics, and when each was last active."""

    def __init__(self, idle_after_s: float, clock: Callable[[], float]) -> None:
        self.idle_after_s = idle_after_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._states: dict[str, TenantState] = {}

    def touch(self, state: TenantState) -> None:
        """A request of the tenant arrived or ended (per request: a clock read and a dict
        store; its first one also creates the tenant's gauges)."""
        tenant = state.id
        if tenant not in self._last:
            self._states[tenant] = state
            metrics.child(metrics.INFLIGHT, tenant).set(state.inflight)
            metrics.child(metrics.QUEUED, tenant).set(state.queued)
            metrics.publish_output_rate(tenant, state.config.output_tokens_per_second)
        self._last[tenant] = self._clock()

    def active(self) -> Iterator[TenantState]:
        """The tenants with series now. O(active tenants)."""
        return iter(list(self._states.values()))

    def replace(self, state: TenantState) -> None:
        """A reload changed the tenant's configuration (its rate series follows)."""
        if state.id in self._states:
            self._states[state.id] = state
            metrics.publish_output_rate(state.id, state.config.output_tokens_per_second)

    def forget(self, tenant: str) -> None:
        """Drop the tenant's series now (a reload removed it)."""
        self._last.pop(tenant, None)
        self._states.pop(tenant, None)
        metrics.forget_tenant(tenant)
        forget_would_reject(tenant)

    def clear(self) -> None:
        """Drop every tenant's series (the gateway stops)."""
        for tenant in list(self._last):
            self.forget(tenant)

    def sweep(self) -> list[str]:
        """Drop the series of every tenant idle for ``idle_after_s`` with nothing in flight
        or queued; returns their ids. O(active tenants), every ``sweep_interval_s``."""
        horizon = self._clock() - self.idle_after_s
        gone = [tenant for tenant, last in self._last.items()
                if last <= horizon and not self._states[tenant].inflight
                and not self._states[tenant].queued]
        for tenant in gone:
            self.forget(tenant)
        return gone

    @property
    def sweep_interval_s(self) -> float:
        """How often to sweep: a quarter of the idle time, at most a minute."""
        return max(0.05, min(60.0, self.idle_after_s / 4))
