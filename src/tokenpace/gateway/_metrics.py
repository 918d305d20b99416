"""The gateway's Prometheus metrics, declared once.

Label values are bounded: ``tenant`` is a configured tenant id (or ``""`` for requests
without a valid key), ``lane`` a configured lane, ``model`` a name an engine serves (or
``""`` for a request refused before it was routed), ``reason`` and ``outcome`` come from
small fixed sets in the code. A reload that removes a tenant removes its series.
Every name here is documented once, in docs/gateway.md; the dashboard and alert rules in
deploy/ read them by name, and tests/monitoring fails when a name they use is gone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# `_created` series double every counter and histogram and nothing here reads them.
disable_created_metrics()

REGISTRY = CollectorRegistry(auto_describe=True)
# process_cpu_seconds_total, process_resident_memory_bytes, ...: the gateway's own cost.
ProcessCollector(registry=REGISTRY)

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
    "Tokens of served requests by model and kind (prompt, completion).",
    ["model", "kind"], registry=REGISTRY,
)
REJECTIONS = Counter(
    "tokenpace_gateway_rejections", "Requests refused by the gateway, by reason.",
    ["tenant", "reason"], registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "tokenpace_gateway_prompt_tokens", "Prompt tokens of requests that reached an engine.",
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
    "tokenpace_gateway_service_cost", "Service cost charged (cost.prompt x prompt + "
    "cost.completion x completion).", ["tenant", "lane"], registry=REGISTRY,
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


class LiveGauge(Collector):
    """A gauge whose samples are read from live state when Prometheus scrapes.

    A gauge set on change shows the value of the last change: a token budget refills
    continuously, so a pushed level was stale between requests, and series of a tenant a
    reload removed came back with the next push. Read at scrape time, the value is the
    bucket's level now and only configured tenants appear.
    """

    def __init__(self, name: str, documentation: str, labels: list[str]) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.source: Callable[[], Iterable[tuple[tuple[str, ...], float]]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labels)
        if self.source is not None:
            for values, value in self.source():
                family.add_metric(list(values), value)
        yield family

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=self.labels)]


BUDGET_REMAINING = LiveGauge(
    "tokenpace_gateway_budget_remaining_tokens", "Cost units left in a tenant's token budget.",
    ["tenant", "budget"],
)
REGISTRY.register(BUDGET_REMAINING)
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
    "tokenpace_gateway_ledger_dropped_rows", "Usage-ledger rows thrown away (queue full, or "
    "unwritten at shutdown).", registry=REGISTRY,
)
ENGINE_INFLIGHT = Gauge(
    "tokenpace_gateway_engine_inflight_requests", "Requests in flight per engine.",
    ["engine"], registry=REGISTRY,
)

_LABELS: dict[Counter | Gauge | Histogram, tuple[str, ...]] = {
    REQUESTS: ("tenant", "lane", "outcome"),
    REJECTIONS: ("tenant", "reason"),
    PROMPT_TOKENS: ("tenant", "lane"),
    COMPLETION_TOKENS: ("tenant", "lane"),
    SERVICE: ("tenant", "lane"),
    QUEUE_SECONDS: ("tenant",),
    TTFT_SECONDS: ("tenant",),
    E2E_SECONDS: ("tenant",),
    INFLIGHT: ("tenant",),
    QUEUED: ("tenant",),
    FAIRNESS_DEBT: ("tenant",),
    QUEUED_COST: ("tenant",),
    OUTPUT_RATE: ("tenant",),
}


# (metric, label values) -> bound child. ``metric.labels(...)`` validates its arguments,
# builds a key and takes the metric's lock on every call; the request path binds the same
# few children for every request of a tenant, so it binds them once here. Bounded like the
# series themselves: forget_tenant prunes a removed tenant's entries.
_CHILDREN: dict[tuple[Counter | Gauge | Histogram, tuple[str, ...]], Any] = {}


def child(metric: Counter | Gauge | Histogram, *values: str) -> Any:
    """``metric.labels(*values)``, bound once (one dict lookup per call afterwards).

    Only for metrics listed in ``_LABELS`` (whose series forget_tenant prunes together with
    the cache) or whose series are never removed (the per-model ones), and never for a
    series that is removed elsewhere (OUTPUT_RATE).
    """
    key = (metric, values)
    bound = _CHILDREN.get(key)
    if bound is None:
        bound = _CHILDREN[key] = metric.labels(*values)
    return bound


def forget_tenant(tenant: str) -> None:
    """Drop every series of a tenant that a reload removed, so labels stay bounded."""
    for metric, names in _LABELS.items():
        for values in _series_of(metric, names, tenant):
            _CHILDREN.pop((metric, values), None)  # a removed series' child no longer exports
            with suppress(KeyError):
                metric.remove(*values)


def _series_of(metric: Counter | Gauge | Histogram, names: tuple[str, ...],
               tenant: str) -> set[tuple[str, ...]]:
    """The label values of ``tenant``'s series of ``metric``: those it exports and those
    bound in the child cache (the same ones, unless a series was removed elsewhere)."""
    at = names.index("tenant")
    found = {values for m, values in _CHILDREN if m is metric and values[at] == tenant}
    for family in metric.collect():
        for sample in family.samples:
            if sample.labels.get("tenant") == tenant:
                found.add(tuple(sample.labels[n] for n in names))
    return found


def publish_output_rate(tenant: str, rate: float | None) -> None:
    """Set (or, without a rate, remove) a tenant's configured-rate series."""
    if rate is None:
        with suppress(KeyError):
            OUTPUT_RATE.remove(tenant)
    else:
        OUTPUT_RATE.labels(tenant).set(rate)
