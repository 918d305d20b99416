"""The gateway's Prometheus metrics, declared once.

Label values are bounded: ``tenant`` is a configured tenant id (or ``""`` for requests
without a valid key), ``lane`` a configured lane, ``reason`` and ``outcome`` come from
small fixed sets in the code. A reload that removes a tenant removes its series.
Every name here is documented once, in docs/gateway.md; the dashboard and alert rules in
deploy/ read them by name, and tests/monitoring fails when a name they use is gone.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)

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
REJECTIONS = Counter(
    "tokenpace_gateway_rejections", "Requests refused by the gateway, by reason.",
    ["tenant", "reason"], registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "tokenpace_gateway_prompt_tokens", "Prompt tokens of requests that reached an engine.",
    ["tenant", "lane"], registry=REGISTRY,
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
BUDGET_REMAINING = Gauge(
    "tokenpace_gateway_budget_remaining_tokens", "Cost units left in a tenant's token budget.",
    ["tenant", "budget"], registry=REGISTRY,
)
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
    BUDGET_REMAINING: ("tenant", "budget"),
    OUTPUT_RATE: ("tenant",),
}


def forget_tenant(tenant: str) -> None:
    """Drop every series of a tenant that a reload removed, so labels stay bounded."""
    for metric, names in _LABELS.items():
        seen = set()
        for family in metric.collect():
            for sample in family.samples:
                if sample.labels.get("tenant") == tenant:
                    seen.add(tuple(sample.labels[n] for n in names))
        for values in seen:
            try:
                metric.remove(*values)
            except KeyError:
                pass


def publish_output_rate(tenant: str, rate: float | None) -> None:
    """Set (or, without a rate, remove) a tenant's configured-rate series."""
    if rate is None:
        try:
            OUTPUT_RATE.remove(tenant)
        except KeyError:
            pass
    else:
        OUTPUT_RATE.labels(tenant).set(rate)


def forget_budget(tenant: str, budget: str) -> None:
    try:
        BUDGET_REMAINING.remove(tenant, budget)
    except KeyError:
        pass
