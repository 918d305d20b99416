"""``GET /tokenpace/v1/me``: what a tenant's own key may see of its tenant.

Who the key is (tenant, application), the limits that apply to it, and each budget's and
request limit's state now: what is left, what was used of it, when it is whole again (a
calendar budget: its period's start and end). The key's tenant only, never another's,
and nothing secret (no key, no digest).

Cost: identification as on every request (a SHA-256, dict lookups), then the levels: in
process a few float operations per limit; with ``state: redis`` one store call per level
(the tenant's, and its application's when the key is an application's) that has limits.
No ledger read: a tenant's polling costs the database nothing. Nothing is added to any
other route.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...fairness import BudgetSpec, Headroom, RequestLimit, iso, period_end, period_start
from ..admission import authorization_of, identify, tenant_models
from ..exchange import Runtime
from ..state import StateUnavailable
from ..tenants import LimitState, TenantState
from ..wire import GatewayError


async def me(rt: Runtime, request: Request) -> Response:
    try:
        tenant, app = identify(rt, authorization_of(request.headers))
    except GatewayError as exc:
        return exc.response()
    try:
        levels = [await _level(rt, tenant, "tenant")]
        if app is not None:
            levels.append(await _level(rt, app, "application"))
    except StateUnavailable:
        return GatewayError(503, "the gateway's state store does not answer; retry shortly",
                            reason="state_unavailable", code="state_unavailable",
                            headers={"retry-after": "1"}).response()
    return JSONResponse({
        "object": "tokenpace.me",
        "tenant": tenant.id,
        "application": None if app is None else app.config.id,
        "lane": tenant.config.lane,
        "models": tenant_models(rt, tenant),
        "limits": {name: limits for name, limits, _ in levels},
        "budgets": [b for _, _, states in levels for b in states["budgets"]],
        "max_requests": [b for _, _, states in levels for b in states["max_requests"]],
    })


def _limits(level: LimitState) -> dict[str, Any]:
    cfg = level.config
    out: dict[str, Any] = {
        "weight": cfg.weight,
        "output_tokens_per_second": cfg.output_tokens_per_second,
        "max_concurrency": cfg.max_concurrency,
    }
    if isinstance(level, TenantState):
        tc = level.config
        out.update(max_queued=tc.max_queued, max_input_tokens=tc.max_input_tokens,
                   max_output_tokens=tc.max_output_tokens, queue_timeout_s=tc.queue_timeout_s)
    return out


async def _level(rt: Runtime, level: LimitState, whose: str,
                 ) -> tuple[str, dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """(``whose``, its limits, its budgets' and request limits' states now)."""
    cfg = level.config
    budgets = [*cfg.budgets, *cfg.observed_budgets]
    requests = [*cfg.max_requests, *cfg.observed_requests]
    levels = await _levels(rt, level, budgets + requests)
    wall = level.wall()
    return whose, _limits(level), {
        "budgets": [_state(s, levels[s.key], wall, whose) for s in budgets],
        "max_requests": [_state(s, levels[s.key], wall, whose) for s in requests],
    }


async def _levels(rt: Runtime, level: LimitState, specs: Sequence[BudgetSpec]) -> dict[str, float]:
    """Each limit's level now: the shared store's (one call), or this process's buckets."""
    if not specs:
        return {}
    if rt.store is not None:
        return await rt.store.budget_levels(level.owner, specs)
    now = rt.clock()
    out: dict[str, float] = {}
    for buckets in (level.budgets, level.observed_budgets, level.request_limits,
                    level.observed_requests):
        out.update(buckets.levels(now))
    return out


def _state(spec: BudgetSpec, level: float, wall: float, whose: str) -> dict[str, Any]:
    """One limit: its figures, what is left and used of it, and when it is whole again."""
    ends_in = None if spec.calendar is None else period_end(spec.calendar, wall) - wall
    headroom = Headroom.of(spec, level, ends_in)
    limit = spec.requests if isinstance(spec, RequestLimit) else spec.tokens
    out: dict[str, Any] = {
        "owner": whose,
        "key": spec.key,
        "limit": limit,
        "per": spec.calendar or spec.figures.rsplit("/", 1)[1],
        "mode": "observe" if spec.observe else "enforce",
        "remaining": level,
        "used": limit - level,
        "resets_in_s": headroom.reset_s,
        "resets_at": iso(round(wall + headroom.reset_s)),
    }
    if spec.calendar is not None:
        out["period_start"] = iso(period_start(spec.calendar, wall))
        out["period_end"] = iso(period_end(spec.calendar, wall))
    return out
