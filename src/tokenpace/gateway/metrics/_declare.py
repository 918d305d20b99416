"""The gateway's metrics, declared once: every counter, gauge and histogram in
``REGISTRY``, the live gauges read at scrape time, and which of them carry a ``tenant``
label (``_LABELS``: their series are bound through ``child`` and rendered in slices).
Declaring costs nothing per request; ``render`` turns them into the page.
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
from prometheus_client.registry import Collector

from ._live import LiveGauge

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


BUDGET_REMAINING = LiveGauge(
    "tokenpace_gateway_budget_remaining_tokens", "Cost units left in a tenant's token budget "
    "(active tenants).", ["tenant", "budget"],
)
APPLICATION_BUDGET_REMAINING = LiveGauge(
    "tokenpace_gateway_application_budget_remaining_tokens", "Cost units left in an "
    "application's own token budget (the applications of active tenants).",
    ["tenant", "application", "budget"],
)
BUDGET_USED_RATIO = LiveGauge(
    "tokenpace_gateway_budget_used_ratio", "Fraction of a tenant's token budget used: of "
    "its period for a calendar budget (per: month or week), of the bucket for a sliding "
    "one; above 1 in debt (active tenants).", ["tenant", "budget"],
)
APPLICATION_BUDGET_USED_RATIO = LiveGauge(
    "tokenpace_gateway_application_budget_used_ratio", "Fraction of an application's own "
    "token budget used, as tokenpace_gateway_budget_used_ratio (the applications of active "
    "tenants).", ["tenant", "application", "budget"],
)
LIVE: tuple[LiveGauge, ...] = (BUDGET_REMAINING, APPLICATION_BUDGET_REMAINING,
                               BUDGET_USED_RATIO, APPLICATION_BUDGET_USED_RATIO)
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
ADAPTER_DISPATCHES = Counter(
    "tokenpace_gateway_adapter_dispatches", "Requests for a LoRA adapter sent to an engine, "
    "by whether the engine held the adapter (loaded=\"true\") or the gateway loaded it "
    "there first.", ["adapter", "loaded"], registry=REGISTRY,
)
ADAPTER_LOADS = Counter(
    "tokenpace_gateway_adapter_loads", "LoRA adapters the gateway loaded on an engine "
    "(vLLM's /v1/load_lora_adapter), by outcome (ok, failed).",
    ["engine", "outcome"], registry=REGISTRY,
)
ADAPTER_UNLOADS = Counter(
    "tokenpace_gateway_adapter_unloads", "LoRA adapters the gateway unloaded from an engine "
    "to make room for another (the least recently used one).",
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


def register(collector: Collector) -> None:
    """Add a collector to the page (``tokenpace_gateway_state_*``: read at scrape time)."""
    REGISTRY.register(collector)
    _EXTRA.append(collector)


_EXTRA: list[Collector] = []
# Every metric declared here without a tenant label: few series, rendered in one piece.
_UNSLICED: tuple[Counter | Gauge | Histogram, ...] = tuple(
    m for m in list(globals().values())
    if isinstance(m, (Counter, Gauge, Histogram)) and m not in _TENANT_AT)
