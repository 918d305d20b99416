"""``GET /v1/organization/usage/completions``: the ledger's usage in OpenAI's Usage API shape.

For billing and dashboards that already read OpenAI's: a page of time buckets
(``bucket_width`` 1m, 1h or 1d from ``start_time``), each with one result per group
(``group_by=project_id`` (a tenant), ``model``, both, or none). A result's figures are
``tokenpace usage``'s over the same rows: ``input_tokens`` its ``prompt_tokens`` (served
requests), ``input_cached_tokens`` its ``cached_prompt_tokens``, ``output_tokens`` its
``completion_tokens``, ``num_model_requests`` its ``requests`` less ``rejected``.

Cost, bounded before it is paid: a page spans at most ``limit`` buckets (OpenAI's
maximum per width: 1440 minutes, 168 hours or 31 days), so one call reads one index range
of ``ended_at`` of at most a day, a week or a month and returns at most buckets x groups
results; the query runs in a worker thread (never on the event loop), and on Postgres
within the ledger's read timeout. Rows still in the journal (written within the ledger's
``flush_interval``) are not counted yet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..exchange import Runtime
from ..ledger import LedgerError
from ..wire import clip, error_response

WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}
"""Buckets per page by width: (default, maximum), as OpenAI's."""
GROUPS = ("project_id", "model")
LISTS = ("group_by", "project_ids", "models")
KNOWN = ("start_time", "end_time", "bucket_width", "limit", "page", *LISTS)
UNSUPPORTED = ("user_ids", "api_key_ids", "batch")
"""OpenAI's filters this gateway cannot honour (its ledger has no user or key column)."""
MAX_FILTER_VALUES = 100
PAGE_PREFIX = "page_"
RESULT_OBJECT = "organization.usage.completions.result"


class BadParameter(Exception):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _int(params: dict[str, list[str]], name: str) -> int | None:
    values = params.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise BadParameter(name, f"{name} is given {len(values)} times; give it once")
    try:
        value = int(values[0])
    except ValueError:
        raise BadParameter(name, f"{name} must be a whole number, got {clip(values[0])!r}") from None
    if value < 0:
        raise BadParameter(name, f"{name} must not be negative, got {value}")
    return value


def _one(params: dict[str, list[str]], name: str) -> str | None:
    values = params.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise BadParameter(name, f"{name} is given {len(values)} times; give it once")
    return values[0]


def _list(values: Iterable[str]) -> tuple[str, ...]:
    """Repeated values, each possibly a comma-separated list; in order, once each."""
    return tuple(dict.fromkeys(v.strip() for value in values for v in value.split(",")
                               if v.strip()))


def parse(items: Iterable[tuple[str, str]], now: float) -> dict[str, Any]:
    """The query's parameters checked: a ``BadParameter`` naming the first bad one."""
    params: dict[str, list[str]] = {}
    for name, value in items:
        name = name[:-2] if name.endswith("[]") else name  # group_by[]=model, as some clients send
        if name in UNSUPPORTED:
            raise BadParameter(name, f"{name} is not supported by this gateway (its ledger "
                               "keeps tenants and models); filter with project_ids or models")
        if name not in KNOWN:
            raise BadParameter(name, f"unknown parameter {clip(name)!r}; known: "
                               f"{', '.join(KNOWN)}")
        params.setdefault(name, []).append(value)
    start = _int(params, "start_time")
    if start is None:
        raise BadParameter("start_time", "start_time is required (unix seconds, inclusive)")
    end = _int(params, "end_time")
    if end is None:
        end = int(now) + 1
    if end <= start:
        raise BadParameter("end_time", f"end_time ({end}) must be after start_time ({start})")
    width_name = _one(params, "bucket_width") or "1d"
    if width_name not in WIDTHS:
        raise BadParameter("bucket_width", f"bucket_width must be one of "
                           f"{', '.join(WIDTHS)}, got {clip(width_name)!r}")
    width = WIDTHS[width_name]
    default, most = LIMITS[width_name]
    limit = _int(params, "limit")
    if limit is None:
        limit = default
    if not 1 <= limit <= most:
        raise BadParameter("limit", f"limit must be 1 to {most} buckets with bucket_width "
                           f"{width_name}, got {limit}")
    group_by = _list(params.get("group_by", ()))
    for field in group_by:
        if field not in GROUPS:
            raise BadParameter("group_by", f"group_by takes {', '.join(GROUPS)} (a tenant is "
                               f"a project_id), got {clip(field)!r}")
    filters = {}
    for name in ("project_ids", "models"):
        filters[name] = _list(params.get(name, ()))
        if len(filters[name]) > MAX_FILTER_VALUES:
            raise BadParameter(name, f"{name} takes at most {MAX_FILTER_VALUES} values")
    page_start = start
    page = _one(params, "page")
    if page is not None:
        try:
            page_start = int(page.removeprefix(PAGE_PREFIX))
        except ValueError:
            page_start = -1
        if not (start <= page_start < end and (page_start - start) % width == 0):
            raise BadParameter("page", f"page {clip(page)!r} is not a cursor of this query "
                               "(pass next_page from the previous response)")
    return {"start": start, "end": end, "width": width, "limit": limit,
            "page_start": page_start, "group_by": group_by, **filters}


def page_body(q: dict[str, Any], rows: list[tuple[Any, ...]]) -> dict[str, Any]:
    """The response: every bucket of the page (those without usage with no results), each
    group's result in it, the cursor of the next page when the window goes on. ``rows``:
    the ledger's buckets counted from the page's start (index 0)."""
    width, group_by = q["width"], q["group_by"]
    page_end = min(q["end"], q["page_start"] + q["limit"] * width)
    buckets: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        index, groups = row[0], row[1:1 + len(group_by)]
        requests, rejected, prompt, cached, completion = row[1 + len(group_by):]
        if requests == rejected and not (prompt or cached or completion):
            continue  # only refusals: no model request, no tokens
        named = dict(zip(group_by, groups))
        buckets.setdefault(index, []).append({
            "object": RESULT_OBJECT, "input_tokens": prompt, "output_tokens": completion,
            "input_cached_tokens": cached, "input_audio_tokens": 0, "output_audio_tokens": 0,
            "num_model_requests": requests - rejected,
            "project_id": named.get("project_id"), "user_id": None, "api_key_id": None,
            "model": named.get("model"), "batch": None, "service_tier": None})
    data = []
    bucket_start, index = q["page_start"], 0
    while bucket_start < page_end:
        data.append({"object": "bucket", "start_time": bucket_start,
                     "end_time": min(bucket_start + width, q["end"]),
                     "results": buckets.get(index, [])})
        bucket_start, index = bucket_start + width, index + 1
    more = page_end < q["end"]
    return {"object": "page", "data": data, "has_more": more,
            "next_page": f"{PAGE_PREFIX}{page_end}" if more else None}


async def usage_completions(rt: Runtime, request: Request) -> Response:
    """The route (behind an admin key, checked by the caller)."""
    try:
        q = parse(request.query_params.multi_items(), time.time())
    except BadParameter as exc:
        return error_response(400, str(exc), code="invalid_request", param=exc.param)
    page_end = min(q["end"], q["page_start"] + q["limit"] * q["width"])
    try:
        rows = await asyncio.to_thread(
            rt.ledger.usage_buckets, q["page_start"], page_end, q["width"], q["group_by"],
            q["project_ids"], q["models"])
    except LedgerError as exc:
        return error_response(503, f"the usage ledger does not answer: {exc}",
                              code="ledger_unavailable", headers={"retry-after": "5"})
    return JSONResponse(page_body(q, rows))
