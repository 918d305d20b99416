"""The gateway's Prometheus metrics: declared once (``_declare``), rendered as a page for a
scrape (``_render``), as client_python splits ``metrics`` from ``exposition``.

Label values are bounded: ``tenant`` is a configured tenant id (or ``""`` for requests
without a valid key), ``application`` a configured application id of that tenant (or
``""``), ``lane`` a configured lane, ``model`` a name an engine serves (or
``""`` for a request refused before it was routed), ``reason`` and ``outcome`` come from
small fixed sets in the code. A tenant's series exist while it is active: they appear with
its first request and go once it has been idle for ``metrics_idle_after`` (``tenants._series``), or
when a reload removes it; so a scrape's size follows the traffic, not the configuration.

A render builds the page on the event loop in slices (``render_chunks``): a request in
flight waits about one slice per step it takes on the loop, never the whole page, which at
thousands of active tenants takes many slices to build and format. The server renders at
most once per ``metrics_cache`` and serves scrapes from that page (``server._scrape``).
Every name here is documented once, in docs/gateway/metrics.md; the dashboard and alert
rules in deploy/ read them by name, and tests/monitoring fails when a name they use is gone.
"""

from ._children import _CHILDREN, child, forget_tenant, has_series, publish_output_rate
from ._declare import (
    APPLICATION_BUDGET_REMAINING,
    APPLICATION_BUDGET_USED_RATIO,
    APPLICATION_REQUESTS,
    APPLICATION_TOKENS,
    BATCH_LINES,
    BUDGET_REMAINING,
    BUDGET_USED_RATIO,
    CACHED_PROMPT_TOKENS,
    COMPLETION_TOKENS,
    E2E_SECONDS,
    ENGINE_DRAINING,
    ENGINE_INFLIGHT,
    ENGINE_REFUSED,
    ADAPTER_DISPATCHES,
    ADAPTER_LOADS,
    ADAPTER_UNLOADS,
    ENGINE_UP,
    FAIRNESS_DEBT,
    INFLIGHT,
    LANE_SHARE,
    LEDGER_DEAD_LETTER_ROWS,
    LEDGER_DROPPED_ROWS,
    LEDGER_JOURNAL_BYTES,
    LEDGER_JOURNAL_MAX_BYTES,
    LEDGER_OVERCHARGED_TOKENS,
    LEDGER_RECOVERED,
    LEDGER_UNJOURNALED,
    LEDGER_UNRECORDED_REQUESTS,
    LEDGER_UNRECORDED_TOKENS,
    LEDGER_WRITE_FAILURES,
    LIVE,
    MODEL_REQUESTS,
    MODEL_TOKENS,
    OUTPUT_RATE,
    PROMPT_BOUND_VIOLATIONS,
    PROMPT_TOKENS,
    QUEUE_SECONDS,
    QUEUED,
    QUEUED_COST,
    REGISTRY,
    REJECTIONS,
    REQUESTS,
    SERVICE,
    TTFT_SECONDS,
    WOULD_REJECT,
    register,
)
from ._live import LiveGauge
from ._render import (
    CHUNK_BYTES,
    INDEX_SLICE,
    LIVE_BATCH,
    SLICE_SAMPLES,
    _Page,
    exposition,
    render,
    render_chunks,
)

__all__ = [
    "APPLICATION_BUDGET_REMAINING",
    "APPLICATION_BUDGET_USED_RATIO",
    "APPLICATION_REQUESTS",
    "APPLICATION_TOKENS",
    "BATCH_LINES",
    "BUDGET_REMAINING",
    "BUDGET_USED_RATIO",
    "CACHED_PROMPT_TOKENS",
    "CHUNK_BYTES",
    "COMPLETION_TOKENS",
    "E2E_SECONDS",
    "ENGINE_DRAINING",
    "ENGINE_INFLIGHT",
    "ENGINE_REFUSED",
    "ADAPTER_DISPATCHES",
    "ADAPTER_LOADS",
    "ADAPTER_UNLOADS",
    "ENGINE_UP",
    "FAIRNESS_DEBT",
    "INDEX_SLICE",
    "INFLIGHT",
    "LANE_SHARE",
    "LEDGER_DEAD_LETTER_ROWS",
    "LEDGER_DROPPED_ROWS",
    "LEDGER_JOURNAL_BYTES",
    "LEDGER_JOURNAL_MAX_BYTES",
    "LEDGER_OVERCHARGED_TOKENS",
    "LEDGER_RECOVERED",
    "LEDGER_UNJOURNALED",
    "LEDGER_UNRECORDED_REQUESTS",
    "LEDGER_UNRECORDED_TOKENS",
    "LEDGER_WRITE_FAILURES",
    "LIVE",
    "LIVE_BATCH",
    "LiveGauge",
    "MODEL_REQUESTS",
    "MODEL_TOKENS",
    "OUTPUT_RATE",
    "PROMPT_BOUND_VIOLATIONS",
    "PROMPT_TOKENS",
    "QUEUE_SECONDS",
    "QUEUED",
    "QUEUED_COST",
    "REGISTRY",
    "REJECTIONS",
    "REQUESTS",
    "SERVICE",
    "SLICE_SAMPLES",
    "TTFT_SECONDS",
    "WOULD_REJECT",
    "child",
    "exposition",
    "forget_tenant",
    "has_series",
    "publish_output_rate",
    "register",
    "render",
    "render_chunks",
]
