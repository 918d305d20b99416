"""The gateway's Prometheus metrics, declared once.

Label values are bounded: ``tenant`` is a configured tenant id (or ``""`` for requests
without a valid key), ``application`` a configured application id of that tenant (or
``""``), ``lane`` a configured lane, ``model`` a name an engine serves (or
``""`` for a request refused before it was routed), ``reason`` and ``outcome`` come from
small fixed sets in the code. A tenant's series exist while it is active: they appear with
its first request and go once it has been idle for ``metrics_idle_after`` (``tenants._series``), or
when a reload removes it; so a scrape's size follows the traffic, not the configuration.

A render builds the page on the event loop in slices (``render``): the text of thousands
of series takes tens of milliseconds to build and format, which requests in flight must not
wait out. The server renders at most once per ``metrics_cache`` and serves scrapes from
that page (``server._scrape``). A worker thread did not help: it held the GIL for its whole switch interval each
time the loop needed it, and a request (dozens of loop wake-ups) waited that out each time
(100+ ms at 1,000 active tenants, issue 42).
Every name here is documented once, in docs/gateway.md; the dashboard and alert rules in
deploy/ read them by name, and tests/monitoring fails when a name they use is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import suppress
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Metric,
    generate_latest,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.registry import Collector

# `_created` series double every counter and histogram and nothing here reads them.
disable_created_metrics()

REGISTRY = CollectorRegistry(auto_describe=True)
# process_cpu_seconds_total, process_resident_memory_bytes, ...: the gateway's own cost.
_PROCESS = ProcessCollector(registry=REGISTRY)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

REQUESTS = Counter(
    "tokenpace_gateway_requests", "Requests that ended, by outcome (finish reason or rejected).",
    ["tenant", "lane", "outcome"], registry=REGISTRY,
)
MODEL_REQUESTS = Counter(
    "tokenpace_gateway_model_requests",
    "Requests that ended, by the model they were routed to (a served name; \"\" before "
    "routing) and outcome.", ["model", "outcome"], registry=REGISTRY,
)
MODEL_TOKENS = Counter(
    "tokenpace_gateway_model_tokens",
    "Tokens of served requests by model and kind (prompt, completion; cached_prompt: the "
    "part of prompt found in the engine's prefix cache).",
    ["model", "kind"], registry=REGISTRY,
)
REJECTIONS = Counter(
    "tokenpace_gateway_rejections", "Requests refused by the gateway, by reason.",
    ["tenant", "reason"], registry=REGISTRY,
)
WOULD_REJECT = Counter(
    "tokenpace_gateway_would_reject", "Requests that a limit in observe mode would have "
    "refused (or, for max_concurrency, held in the queue), by reason; none was refused. "
    "application: whose limit (\"\": the tenant's own).",
    ["tenant", "application", "reason"], registry=REGISTRY,
)
APPLICATION_REQUESTS = Counter(
    "tokenpace_gateway_application_requests", "Requests of a tenant's applications that "
    "ended, by outcome (requests of the tenant's own keys are not counted here).",
    ["tenant", "application", "outcome"], registry=REGISTRY,
)
APPLICATION_TOKENS = Counter(
    "tokenpace_gateway_application_tokens", "Tokens of a tenant's applications' served "
    "requests, by kind (prompt, completion; cached_prompt: the part of prompt found in the "
    "engine's prefix cache).",
    ["tenant", "application", "kind"], registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "tokenpace_gateway_prompt_tokens", "Prompt tokens of requests that reached an engine.",
    ["tenant", "lane"], registry=REGISTRY,
)
CACHED_PROMPT_TOKENS = Counter(
    "tokenpace_gateway_cached_prompt_tokens", "Of the prompt tokens of requests that reached "
    "an engine, those the engine found in its prefix cache (charged at cost.cached_prompt; "
    "counted only where the engine reports them: --enable-prompt-tokens-details).",
    ["tenant", "lane"], registry=REGISTRY,
)
PROMPT_BOUND_VIOLATIONS = Counter(
    "tokenpace_gateway_prompt_bound_violations", "Prompts with more tokens than the byte bound "
    "they were admitted on (the bound is then off for that engine and model).",
    ["engine"], registry=REGISTRY,
)
COMPLETION_TOKENS = Counter(
    "tokenpace_gateway_completion_tokens", "Output tokens generated for a tenant.",
    ["tenant", "lane"], registry=REGISTRY,
)
SERVICE = Counter(
    "tokenpace_gateway_service_cost", "Service cost charged (cost.prompt x uncached prompt + "
    "cost.cached_prompt x cached prompt + cost.completion x completion).",
    ["tenant", "lane"], registry=REGISTRY,
)
QUEUE_SECONDS = Histogram(
    "tokenpace_gateway_queue_seconds", "Time from admission to dispatch to an engine.",
    ["tenant"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
TTFT_SECONDS = Histogram(
    "tokenpace_gateway_time_to_first_token_seconds",
    "Time from arrival at the gateway to the first output token (streaming requests).",
    ["tenant"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
E2E_SECONDS = Histogram(
    "tokenpace_gateway_request_seconds", "Time from arrival at the gateway to the end of the response.",
    ["tenant"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
INFLIGHT = Gauge(
    "tokenpace_gateway_inflight_requests", "Requests dispatched to an engine and not finished.",
    ["tenant"], registry=REGISTRY,
)
QUEUED = Gauge(
    "tokenpace_gateway_queued_requests", "Admitted requests waiting in the gateway for dispatch.",
    ["tenant"], registry=REGISTRY,
)
BATCH_LINES = Counter(
    "tokenpace_gateway_batch_lines", "Lines of batches (/v1/batches) by how they ended: output "
    "(a 2xx answer), error (another answer), expired (never ran before the batch expired), "
    "retried (a 429 or 5xx, run again).",
    ["tenant", "outcome"], registry=REGISTRY,
)


class LiveGauge(Collector):
    """A gauge whose samples are read from live state when Prometheus scrapes.

    A gauge set on change shows the value of the last change: a token budget refills
    continuously, so a pushed level was stale between requests, and series of a tenant a
    reload removed came back with the next push. Read at scrape time, the value is the
    bucket's level now and only active configured tenants appear.

    Not in ``REGISTRY``: its source reads the gateway's live state, which only the event
    loop may touch, so a scrape reads it there (``family``) and renders the page in a
    worker thread (``render``).
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


BUDGET_REMAINING = LiveGauge(
    "tokenpace_gateway_budget_remaining_tokens", "Cost units left in a tenant's token budget "
    "(active tenants).", ["tenant", "budget"],
)
APPLICATION_BUDGET_REMAINING = LiveGauge(
    "tokenpace_gateway_application_budget_remaining_tokens", "Cost units left in an "
    "application's own token budget (the applications of active tenants).",
    ["tenant", "application", "budget"],
)
LIVE: tuple[LiveGauge, ...] = (BUDGET_REMAINING, APPLICATION_BUDGET_REMAINING)


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
"""Samples built and formatted between two turns of the event loop during a scrape: 0.65 ms
of this machine's CPU (median; 3.3 ms at 500), and a request waits about one slice per step
it takes on the loop while a scrape runs (docs/benchmarks.md, bench tenants)."""


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
    request in flight waits about one slice per step it takes (0.65 ms here), not the page;
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
FAIRNESS_DEBT = Gauge(
    "tokenpace_gateway_fairness_debt", "A tenant's virtual counter minus the smallest counter "
    "among its lane's backlogged tenants (cost units / weight; 0: nobody is behind it).",
    ["tenant"], registry=REGISTRY,
)
QUEUED_COST = Gauge(
    "tokenpace_gateway_queued_tokens", "Estimated cost (prompt + max output, in cost units) "
    "of a tenant's requests waiting in the gateway.", ["tenant"], registry=REGISTRY,
)
LANE_SHARE = Gauge(
    "tokenpace_gateway_lane_dispatch_share", "A lane's share of the cost dispatched over the "
    "sliding window (lane_share_window).", ["lane"], registry=REGISTRY,
)
OUTPUT_RATE = Gauge(
    "tokenpace_gateway_tenant_output_rate_tokens_per_second", "A tenant's configured "
    "output_tokens_per_second (paced in the engine); no series when it has none.",
    ["tenant"], registry=REGISTRY,
)
LEDGER_WRITE_FAILURES = Counter(
    "tokenpace_gateway_ledger_write_failures", "Usage-ledger flushes that failed (the rows "
    "stay queued and are retried).", registry=REGISTRY,
)
LEDGER_DROPPED_ROWS = Counter(
    "tokenpace_gateway_ledger_dropped_rows", "Usage-ledger rows thrown away: the journal "
    "was full (on_ledger_full: drop) or the ledger closed.", registry=REGISTRY,
)
LEDGER_DEAD_LETTER_ROWS = Counter(
    "tokenpace_gateway_ledger_dead_letter_rows", "Usage-ledger rows the database refused "
    "for their values while it answered, moved to the journal's dead-letter.jsonl.",
    registry=REGISTRY,
)
LEDGER_UNJOURNALED = Counter(
    "tokenpace_gateway_ledger_unjournaled_requests", "Requests sent to an engine without a "
    "journal entry (journal full, on_ledger_full: drop): a crash loses them.",
    registry=REGISTRY,
)
LEDGER_JOURNAL_BYTES = Gauge(
    "tokenpace_gateway_ledger_journal_bytes", "Bytes in the usage ledger's journal: rows "
    "not yet written to the database and requests in flight.", registry=REGISTRY,
)
LEDGER_JOURNAL_MAX_BYTES = Gauge(
    "tokenpace_gateway_ledger_journal_max_bytes", "The journal's bound (ledger_journal_max_"
    "bytes); at it, on_ledger_full applies.", registry=REGISTRY,
)
LEDGER_RECOVERED = Counter(
    "tokenpace_gateway_ledger_recovered_requests", "Requests found in flight in the journal "
    "at start-up (the process before died) and recorded; source: engine (its count) or "
    "estimate (the engine could not tell: the reservation is charged).", ["source"],
    registry=REGISTRY,
)
LEDGER_UNRECORDED_TOKENS = Counter(
    "tokenpace_gateway_ledger_unrecorded_tokens", "Output tokens the engines generated that "
    "the usage ledger does not hold: requests without a row, and a row's shortfall against "
    "the engines' count (the periodic check against the engines' books, reconcile_interval; "
    "every replica checks the whole fleet). tenant: the row's, else the pacing user's "
    "configured tenant, else \"\".", ["tenant"], registry=REGISTRY,
)
LEDGER_OVERCHARGED_TOKENS = Counter(
    "tokenpace_gateway_ledger_overcharged_tokens", "Output tokens ledger rows hold beyond "
    "what the engines generated for those requests (the periodic check, as "
    "tokenpace_gateway_ledger_unrecorded_tokens).", ["tenant"], registry=REGISTRY,
)
LEDGER_UNRECORDED_REQUESTS = Counter(
    "tokenpace_gateway_ledger_unrecorded_requests", "Requests the engines ended that have no "
    "usage-ledger row past the grace (the periodic check, as "
    "tokenpace_gateway_ledger_unrecorded_tokens).", ["tenant"], registry=REGISTRY,
)
ENGINE_INFLIGHT = Gauge(
    "tokenpace_gateway_engine_inflight_requests", "Requests in flight per engine.",
    ["engine"], registry=REGISTRY,
)
ENGINE_UP = Gauge(
    "tokenpace_gateway_engine_up", "1 while the engine is in dispatch as healthy; 0 once its "
    "health checks failed or it refused a connection, until a probe answers.",
    ["engine"], registry=REGISTRY,
)
ENGINE_DRAINING = Gauge(
    "tokenpace_gateway_engine_draining", "1 while the engine is drained or shutting down: "
    "no new dispatches, its requests in flight finish.", ["engine"], registry=REGISTRY,
)
ENGINE_REFUSED = Counter(
    "tokenpace_gateway_engine_refused_connections", "Requests whose connection the engine "
    "refused (nothing was sent; each went to another engine or got a 503).",
    ["engine"], registry=REGISTRY,
)

_LABELS: dict[Counter | Gauge | Histogram, tuple[str, ...]] = {
    REQUESTS: ("tenant", "lane", "outcome"),
    REJECTIONS: ("tenant", "reason"),
    WOULD_REJECT: ("tenant", "application", "reason"),
    APPLICATION_REQUESTS: ("tenant", "application", "outcome"),
    APPLICATION_TOKENS: ("tenant", "application", "kind"),
    PROMPT_TOKENS: ("tenant", "lane"),
    CACHED_PROMPT_TOKENS: ("tenant", "lane"),
    COMPLETION_TOKENS: ("tenant", "lane"),
    SERVICE: ("tenant", "lane"),
    QUEUE_SECONDS: ("tenant",),
    TTFT_SECONDS: ("tenant",),
    E2E_SECONDS: ("tenant",),
    INFLIGHT: ("tenant",),
    QUEUED: ("tenant",),
    BATCH_LINES: ("tenant", "outcome"),
    FAIRNESS_DEBT: ("tenant",),
    QUEUED_COST: ("tenant",),
    OUTPUT_RATE: ("tenant",),
    LEDGER_UNRECORDED_TOKENS: ("tenant",),
    LEDGER_OVERCHARGED_TOKENS: ("tenant",),
    LEDGER_UNRECORDED_REQUESTS: ("tenant",),
}
_TENANT_AT = {metric: names.index("tenant") for metric, names in _LABELS.items()}


# (metric, label values) -> bound child. ``metric.labels(...)`` validates its arguments,
# builds a key and takes the metric's lock on every call; the request path binds the same
# few children for every request of a tenant, so it binds them once here. Bounded like the
# series themselves: forget_tenant prunes a tenant's entries.
_CHILDREN: dict[tuple[Counter | Gauge | Histogram, tuple[str, ...]], Any] = {}
# tenant -> the keys of its bound series: what forget_tenant removes, without looking
# through any other tenant's series.
_OF_TENANT: dict[str, list[tuple[Counter | Gauge | Histogram, tuple[str, ...]]]] = {}


def child(metric: Counter | Gauge | Histogram, *values: str) -> Any:
    """``metric.labels(*values)``, bound once (one dict lookup per call afterwards).

    Every series with a ``tenant`` label (the metrics in ``_LABELS``) is made here, so that
    forget_tenant finds all of a tenant's series in its own index.
    """
    key = (metric, values)
    bound = _CHILDREN.get(key)
    if bound is None:
        bound = _CHILDREN[key] = metric.labels(*values)
        at = _TENANT_AT.get(metric)
        if at is not None:
            _OF_TENANT.setdefault(values[at], []).append(key)
    return bound


def forget_tenant(tenant: str) -> None:
    """Drop every series of a tenant (idle, or removed by a reload). O(its series)."""
    for key in _OF_TENANT.pop(tenant, ()):
        metric, values = key
        if _CHILDREN.pop(key, None) is not None:
            with suppress(KeyError):
                metric.remove(*values)


def has_series(tenant: str) -> bool:
    return tenant in _OF_TENANT


def publish_output_rate(tenant: str, rate: float | None) -> None:
    """Set (or, without a rate, remove) a tenant's configured-rate series."""
    if rate is not None:
        child(OUTPUT_RATE, tenant).set(rate)
        return
    key = (OUTPUT_RATE, (tenant,))
    if _CHILDREN.pop(key, None) is not None:
        with suppress(KeyError):
            OUTPUT_RATE.remove(tenant)
        keys = _OF_TENANT.get(tenant)
        if keys is not None:
            keys.remove(key)


def register(collector: Collector) -> None:
    """Add a collector to the page (``tokenpace_gateway_state_*``: read at scrape time)."""
    REGISTRY.register(collector)
    _EXTRA.append(collector)


_EXTRA: list[Collector] = []
# Every metric declared here without a tenant label: few series, rendered in one piece.
_UNSLICED: tuple[Counter | Gauge | Histogram, ...] = tuple(
    m for m in list(globals().values())
    if isinstance(m, (Counter, Gauge, Histogram)) and m not in _TENANT_AT)
