"""Prometheus view of the state store, read at scrape time (nothing is pushed per request)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ._base import StateStore
from ._failover import FailoverStore
from ._redis import RedisStore


class StateCollector(Collector):
    """``tokenpace_gateway_state_up`` and, for a shared store, its failures and fallbacks."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        store = self.store
        up = GaugeMetricFamily("tokenpace_gateway_state_up",
                               "1 while the state store answers (always 1 in process).",
                               labels=["backend"])
        shared = store.primary if isinstance(store, FailoverStore) else store
        backend = "redis" if isinstance(shared, RedisStore) else "memory"
        up.add_metric([backend], 1.0 if store.healthy else 0.0)
        yield up
        if not isinstance(shared, RedisStore):
            return
        failures = CounterMetricFamily("tokenpace_gateway_state_failures",
                                       "State store calls that failed or timed out.")
        failures.add_metric([], float(shared.failures))
        yield failures
        lost = CounterMetricFamily("tokenpace_gateway_state_lost_leases",
                                   "Slot leases found missing at renewal and taken again.")
        lost.add_metric([], float(shared.lost_leases))
        yield lost
        if isinstance(store, FailoverStore):
            fallbacks = CounterMetricFamily(
                "tokenpace_gateway_state_fallbacks",
                "Decisions taken under per-replica fallback limits (on_state_failure: open).",
                labels=["operation"])
            for operation, n in sorted(store.fallbacks.items()):
                fallbacks.add_metric([operation], float(n))
            yield fallbacks
