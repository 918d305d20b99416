"""``LiveGauge``: a gauge whose samples a callback reads from live state at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class LiveGauge(Collector):
    """A gauge whose samples are read from live state when Prometheus scrapes.

    A sample is the value now (a token budget refills continuously: a level pushed on
    change would be stale between requests), and only what the source yields appears (the
    active configured tenants: a tenant a reload removed has no series).

    Not in ``REGISTRY``: its source reads the gateway's live state, which only the event
    loop may touch, so a scrape reads it there (``family``, or ``render_chunks`` a few
    samples at a time).
    """

    def __init__(self, name: str, documentation: str, labels: list[str]) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.source: Callable[[], Iterable[tuple[tuple[str, ...], float]]] | None = None

    def family(self) -> GaugeMetricFamily:
        """The samples now (on the event loop)."""
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labels)
        if self.source is not None:
            for values, value in self.source():
                family.add_metric(list(values), value)
        return family

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield self.family()

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=self.labels)]
