"""The engine's pacing on its own ``/metrics``: ``tokenpace_engine_*`` after vLLM's series.

Pacing runs in the engine-core process and vLLM's ``/metrics`` is served by the API server,
whose Prometheus registry the engine process does not share. So a scrape asks the engine
for its counters the way rate control asks it to change a rate (``_control``): a utility
call, run in the engine loop between two steps, on every data-parallel rank. The API
server's middleware (``RequestGuard``) lets vLLM render its page, asks for the counters,
and appends them; the scrape's path, port and authentication (the engine key under
``--trusted-gateway``) are vLLM's own. Nothing is pushed per step: the step only counts
(``pacing.PacingStats``).

The series (``user`` labels bounded by ``metrics_users``, the rest under ``__other__``):

- ``tokenpace_engine_output_tokens_total{user}``: tokens charged and dispatched to sample
  (charges minus refunds): what the user's clients receive, up to async scheduling's step
  past a stop (accepted drafts of a bulk window are added when it ends, ``pacing._drafts``);
- ``tokenpace_engine_refunded_tokens_total{user}``: charges returned at the refund point;
- ``tokenpace_engine_throttled_request_steps_total{user}``: request-steps skipped for
  lack of quota;
- ``tokenpace_engine_throttled_seconds_total{user}``: time during which the user had work
  waiting for quota;
- ``tokenpace_engine_rate_tokens_per_second{user}``: the rate in force (no sample for an
  unpaced user);
- ``tokenpace_engine_idle_waits_total``, ``tokenpace_engine_idle_wait_seconds_total``: the
  engine loop's waits for quota instead of steps;
- ``tokenpace_engine_folded_users``: distinct users counted under ``__other__``.

Lanes (``priority`` labels: the first 32 priority levels seen, the rest under ``other``):

- ``tokenpace_engine_lane_held_request_steps_total{priority}``: running request-steps held
  for a better-priority request (KV kept; not throttled);
- ``tokenpace_engine_lane_yielded_prompt_steps_total{priority}``: prompt chunks that sat
  out a better lane's prefill;
- ``tokenpace_engine_lane_admitted_total{priority}``: requests admitted past the active
  limit by holding lower-priority ones;
- ``tokenpace_engine_lane_held_requests{priority}``: requests held in the last step.

With data parallelism each user is paced on one rank; the figures are summed over the
ranks (a user's are its rank's), and the idle waits are every rank's together.

What a scrape costs: the engine's answer and its text are kept for ``CACHE_S`` (1 s), so
however many clients poll ``/metrics`` (a gateway reads vLLM's gauges there every 25-500
ms) the engine is asked at most once a second. A request with Prometheus's ``name[]``
filter gets only the ``tokenpace_engine_*`` names it lists (the gateway's poll lists
vLLM's gauges only, and gets none).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs

from ._asgi import ASGIApp, Message, Receive, Scope, Send
from ._control import install_utility

logger = logging.getLogger("vllm.tokenpace.engine")

UTILITY_METHOD = "tokenpace_pacing_stats"
METRICS_PATHS = ("/metrics", "/metrics/")
STATS_TIMEOUT_S = 5.0
"""How long a scrape waits for the engine's counters (a step in progress finishes first);
past it, the page goes out with vLLM's series only."""
CACHE_S = 1.0
"""How long one reading of the engine's counters serves every scrape."""
PREFIX = "tokenpace_engine_"

_COUNTERS = (
    ("output_tokens", "Output tokens charged and dispatched to sample (charges minus "
     "refunds), per user.", 0),
    ("refunded_tokens", "Charges returned at the refund point (not dispatched to sample).", 1),
    ("throttled_request_steps", "Request-steps skipped because the user had no quota.", 2),
    ("throttled_seconds", "Seconds during which the user had work waiting for quota.", 3),
)
_LANE_SERIES = (
    ("lane_held_request_steps_total", "counter",
     "Running request-steps held for a better-priority request (KV kept).", 0),
    ("lane_yielded_prompt_steps_total", "counter",
     "Prompt chunks that sat out a better-priority prefill.", 1),
    ("lane_admitted_total", "counter",
     "Requests admitted past the active limit by holding lower-priority ones.", 2),
    ("lane_held_requests", "gauge", "Requests held for a better priority in the last step.", 3),
)


# -- the engine process -------------------------------------------------------------------


def tokenpace_pacing_stats(core: Any) -> dict[str, Any]:
    """Runs in the engine process (as ``EngineCoreProc.tokenpace_pacing_stats``)."""
    stats = getattr(core.scheduler, "pacing_stats", None)
    result = stats() if stats is not None else None
    return {"pacing": result}


def install_pacing_stats(engine_core_proc_cls: type) -> bool:
    """Add ``tokenpace_pacing_stats`` to vLLM's engine-core class (once); True if added."""
    return install_utility(engine_core_proc_cls, UTILITY_METHOD, tokenpace_pacing_stats)


# -- the API server ------------------------------------------------------------------------


def merge(answers: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """One figure per user over the data-parallel ranks' answers (None: pacing is off)."""
    merged: dict[str, Any] | None = None
    for answer in answers:
        pacing = answer.get("pacing")
        if pacing is None:
            continue
        if merged is None:
            merged = {"users": {}, "idle_waits": 0, "idle_wait_seconds": 0.0,
                      "folded_users": 0, "lanes": {}}
        for priority, values in pacing.get("lanes", {}).items():
            have = merged["lanes"].setdefault(priority, [0, 0, 0, 0])
            for i, v in enumerate(values):
                have[i] += v
        for user, (tokens, refunds, steps, seconds, rate) in pacing["users"].items():
            have = merged["users"].get(user)
            if have is None:
                merged["users"][user] = [tokens, refunds, steps, seconds, rate]
            else:
                have[0] += tokens
                have[1] += refunds
                have[2] += steps
                have[3] += seconds
                have[4] = rate if have[4] is None else have[4]
        merged["idle_waits"] += pacing["idle_waits"]
        merged["idle_wait_seconds"] += pacing["idle_wait_seconds"]
        merged["folded_users"] += pacing["folded_users"]
    return merged


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def exposition(stats: dict[str, Any], names: set[str] | None = None) -> bytes:
    """Prometheus text format of the merged counters (``names``: only these families,
    as Prometheus's ``name[]`` filter names them; None: all)."""
    users = sorted(stats["users"].items())
    families: list[tuple[str, str, str, list[str]]] = []
    for name, help_text, index in _COUNTERS:
        full = f"{PREFIX}{name}_total"
        families.append((full, help_text, "counter",
                         [f'{full}{{user="{_label(u)}"}} {float(v[index])!r}' for u, v in users]))
    full = f"{PREFIX}rate_tokens_per_second"
    families.append((full, "The user's output rate in force (no sample: not paced).", "gauge",
                     [f'{full}{{user="{_label(u)}"}} {float(v[4])!r}' for u, v in users
                      if v[4] is not None]))
    for name, help_text, value in (
            ("idle_waits_total", "Waits of the engine loop for quota instead of a step.",
             stats["idle_waits"]),
            ("idle_wait_seconds_total", "Seconds the engine loop waited for quota.",
             stats["idle_wait_seconds"])):
        families.append((PREFIX + name, help_text, "counter",
                         [f"{PREFIX}{name} {float(value)!r}"]))
    families.append((PREFIX + "folded_users", "Distinct users counted under the \"__other__\" "
                     "label (past metrics_users).", "gauge",
                     [f"{PREFIX}folded_users {float(stats['folded_users'])!r}"]))
    lanes = sorted(stats.get("lanes", {}).items())
    for name, kind, help_text, index in _LANE_SERIES:
        full = PREFIX + name
        families.append((full, help_text, kind,
                         [f'{full}{{priority="{_label(p)}"}} {float(v[index])!r}'
                          for p, v in lanes]))
    lines: list[str] = []
    for full, help_text, kind, samples in families:
        if names is None or full in names or full.removesuffix("_total") in names:
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", *samples]
    return ("\n".join(lines) + "\n").encode() if lines else b""


class _Cache:
    """The last reading of the engine's counters, for ``CACHE_S``."""

    def __init__(self) -> None:
        self.at = -CACHE_S
        self.stats: dict[str, Any] | None = None
        self.page: bytes = b""
        self.lock: asyncio.Lock | None = None


_cache = _Cache()


def wanted_names(scope: Scope) -> set[str] | None:
    """The ``name[]`` filter of the request's query (None: no filter)."""
    query = scope.get("query_string", b"")
    if not query:
        return None
    names = parse_qs(query.decode("latin-1")).get("name[]")
    return set(names) if names else None


async def pacing_page(scope: Scope) -> bytes:
    """The ``tokenpace_engine_*`` lines the request asks for (b"" when pacing is off, the
    filter names none of them, or the engine does not answer in time), from a reading of
    the engine at most ``CACHE_S`` old."""
    names = wanted_names(scope)
    if names is not None and not any(n.startswith(PREFIX) for n in names):
        return b""  # e.g. a gateway reading vLLM's gauges: nothing to ask the engine
    cache = _cache
    if cache.lock is None:
        cache.lock = asyncio.Lock()
    async with cache.lock:  # concurrent scrapes share one call to the engine
        if time.monotonic() - cache.at >= CACHE_S:
            cache.stats = await _read_engine(scope)
            cache.page = b"" if cache.stats is None else exposition(cache.stats)
            cache.at = time.monotonic()
    if cache.stats is None:
        return b""
    return cache.page if names is None else exposition(cache.stats, names)


async def _read_engine(scope: Scope) -> dict[str, Any] | None:
    state = getattr(scope.get("app"), "state", None)
    client = getattr(getattr(state, "engine_client", None), "engine_core", None)
    if client is None:
        return None
    every = getattr(client, "call_utility_all_async", None)
    try:
        call = (every(UTILITY_METHOD) if every is not None
                else _one(client.call_utility_async(UTILITY_METHOD)))
        async with asyncio.timeout(STATS_TIMEOUT_S):  # not wait_for: it loses cancels on 3.11
            answers = await call
    except Exception as exc:  # the page must still go out: vLLM's series are worth having
        logger.warning("tokenpace: the engine's pacing counters were not read for /metrics: "
                       "%s", exc)
        return None
    return merge(answers)


async def _one(call: Any) -> list[dict[str, Any]]:
    return [await call]


async def handle_metrics(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /metrics``: vLLM's page, then the pacing series.

    vLLM's page is asked for uncompressed and in the classic text format: a gzip body
    cannot be appended to, and OpenMetrics ends with ``# EOF`` (Prometheus asks for both
    but takes the plain text format). It goes out with the new length."""
    inner = dict(scope)
    inner["headers"] = [(k, v) for k, v in scope.get("headers", ())
                        if k.lower() not in (b"accept-encoding", b"accept")]
    start: Message | None = None
    body: list[bytes] = []

    async def capture(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    await app(inner, receive, capture)
    if start is None:
        return
    content = b"".join(body)
    if start.get("status") == 200:
        content += await pacing_page(scope)
    headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(content)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": content})
