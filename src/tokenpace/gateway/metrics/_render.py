"""The exposition: the declared metrics and the live gauges rendered as one Prometheus text
page, either at once on the calling thread (``exposition``) or on the event loop in slices
(``render_chunks``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from prometheus_client import Metric, generate_latest
from prometheus_client.samples import Sample

from ._children import _CHILDREN
from ._declare import LIVE, REGISTRY, _EXTRA, _LABELS, _PROCESS, _TENANT_AT, _UNSLICED


class _Page:
    """What one scrape exports: the registry, and the live gauges as read on the loop."""

    def __init__(self, live: list[Metric]) -> None:
        self._live = live

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()
        yield from self._live


class _Families:
    """Metric families already collected, in the shape ``generate_latest`` reads."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def exposition() -> bytes:
    """The whole page, rendered on the calling thread (tests, tools)."""
    return generate_latest(_Page([gauge.family() for gauge in LIVE]))  # type: ignore[arg-type]


SLICE_SAMPLES = 100
"""Samples built and formatted between two turns of the event loop during a scrape: a
request waits about one slice per step it takes on the loop while a scrape runs (a slice's
time is measured in docs/benchmarks/tenants.md)."""


LIVE_BATCH = 64
"""Live-gauge samples read between two checks of the slice's size."""
INDEX_SLICE = 5000
"""Entries of the series index grouped by family between two turns of the loop."""
CHUNK_BYTES = 1 << 16
"""A scrape's page goes out in pieces of at least this size."""


class _Slices:
    """The page as it is written, slice by slice: ``add`` a family's samples, and every
    ``SLICE_SAMPLES`` the samples so far are formatted and the loop gets a turn."""

    def __init__(self) -> None:
        self.page: list[bytes] = []
        self._head: Metric | None = None  # the family being written
        self._headed = False  # its HELP and TYPE lines are on the page
        self._samples: list[Any] = []
        self._since_yield = 0
        self._size = 0  # bytes in ``page``

    def ready(self) -> bool:
        """Whether the text formatted so far makes a piece to send."""
        return self._size >= CHUNK_BYTES

    def take(self) -> bytes:
        """The text formatted so far (and forget it)."""
        out = b"".join(self.page)
        self.page, self._size = [], 0
        return out

    def begin(self, head: Metric) -> None:
        self._head, self._headed, self._samples = head, False, []

    async def add(self, samples: Iterable[Any]) -> None:
        self._samples.extend(samples)
        if len(self._samples) >= SLICE_SAMPLES:
            self._format()
        if self._since_yield >= SLICE_SAMPLES:
            self._since_yield = 0
            await asyncio.sleep(0)

    def end(self) -> None:
        if self._samples or not self._headed:
            self._format()
        self._head = None

    def _format(self) -> None:
        head = self._head
        assert head is not None
        family = Metric(head.name, head.documentation, head.type, head.unit)
        family.samples = self._samples
        text = generate_latest(_Families([family]))  # type: ignore[arg-type]
        if self._headed:  # one HELP and TYPE per family: drop the repeated two lines
            text = text.split(b"\n", 2)[2]
        self.page.append(text)
        self._size += len(text)
        self._headed = True
        self._since_yield += len(self._samples)
        self._samples = []


async def render() -> bytes:
    """The whole page for a scrape (``render_chunks`` joined)."""
    return b"".join([chunk async for chunk in render_chunks()])


async def render_chunks() -> AsyncIterator[bytes]:
    """The page for a scrape, built and formatted on the event loop in slices of
    ``SLICE_SAMPLES`` samples with a turn for the loop's other work between two, so a
    request in flight waits about one slice per step it takes, not the page;
    given out in pieces of at least ``CHUNK_BYTES`` as they are ready (a page of tens of
    megabytes at 10,000 active tenants is never held whole, nor copied in one go).

    The families without a tenant label (engines, lanes, models, the process, the state
    store) are few series and go in one piece; the live gauges are read now; the families
    with a tenant label (O(active tenants) series each) are built child by child from the
    index of bound children (``child``), which every tenant series goes through. Cost: the
    same CPU as one ``generate_latest`` of the page, plus one pass over the index (itself
    sliced).
    """
    slices = _Slices()
    small = [family for collector in (_PROCESS, *_UNSLICED, *_EXTRA)
             for family in collector.collect()]
    slices.page.append(generate_latest(_Families(small)))  # type: ignore[arg-type]
    for gauge in LIVE:  # read now, a few samples at a time (O(active tenants) each)
        head = gauge.describe()[0]
        slices.begin(head)
        if gauge.source is not None:
            batch: list[Sample] = []
            for values, value in gauge.source():
                batch.append(Sample(head.name, dict(zip(gauge.labels, values)), value))
                if len(batch) == LIVE_BATCH:
                    await slices.add(batch)
                    batch = []
                    if slices.ready():
                        yield slices.take()
            await slices.add(batch)
        slices.end()
    children: dict[Any, list[tuple[tuple[str, ...], Any]]] = {m: [] for m in _TENANT_AT}
    index = list(_CHILDREN.items())  # a copy: requests bind and drop series meanwhile
    for i, ((metric, values), bound) in enumerate(index):
        series = children.get(metric)
        if series is not None:  # (a family without a tenant label is in ``small``)
            series.append((values, bound))
        if i % INDEX_SLICE == INDEX_SLICE - 1:
            await asyncio.sleep(0)
    del index
    for metric, series in children.items():
        names = _LABELS[metric]
        slices.begin(metric.describe()[0])
        for values, bound in series:
            labels = dict(zip(names, values))
            for family in bound.collect():
                await slices.add(sample._replace(labels={**labels, **sample.labels})
                                 for sample in family.samples)
            if slices.ready():
                yield slices.take()
        slices.end()
    yield slices.take()
