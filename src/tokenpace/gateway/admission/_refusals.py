"""The refusals that admission and the queue answer with: their status, message and headers.

One place for the wording and OpenAI's ``retry-after`` and ``x-ratelimit-*`` headers of
each refusal, so the HTTP stages and the dispatcher refuse alike.
"""

from __future__ import annotations

import math
import time

from ...fairness import BudgetRefusal, RequestLimit, iso
from ..tenants import ApplicationState, LimitState, TenantState
from ..wire import GatewayError, refusal_headers


def queue_full(tenant: TenantState, waiting: int | None = None) -> GatewayError:
    """429 for a full queue; ``waiting``: the count on every replica (shared slots)."""
    cfg = tenant.config
    wait = tenant.slot_wait_s()
    where = (f"{tenant.inflight} requests running here (max_concurrency {cfg.max_concurrency}) "
             f"and {waiting} waiting on all replicas" if waiting is not None else
             f"{tenant.inflight} requests running (max_concurrency {cfg.max_concurrency}) "
             f"and {tenant.queued} waiting")
    return GatewayError(
        429, f"tenant {tenant.id!r} has {where} "
        f"(max_queued {cfg.max_queued}); a slot frees in about {wait:.1f} s",
        reason="queue_full", code="queue_full", headers=retry_headers(wait))


def body_rate_limited(tenant: TenantState, wait_s: float) -> GatewayError:
    """429 for a tenant over its ``max_body_bytes_per_second`` (``tenants._body_rate``)."""
    return GatewayError(
        429, f"tenant {tenant.id!r} sends request bodies faster than its "
        f"max_body_bytes_per_second ({tenant.config.max_body_bytes_per_second} bytes a "
        f"second); the next body may start in about {wait_s:.1f} s",
        reason="body_rate", code="rate_limit_exceeded", headers=retry_headers(wait_s))


def retry_headers(wait_s: float) -> dict[str, str]:
    return {"retry-after": str(max(1, math.ceil(wait_s))),
            "retry-after-ms": str(max(1, math.ceil(wait_s * 1000)))}


def state_unavailable() -> GatewayError:
    """The shared state store did not answer a decision (``on_state_failure: closed``)."""
    return GatewayError(503, "the gateway's state store does not answer; retry shortly",
                        reason="state_unavailable", code="state_unavailable",
                        headers={"retry-after": "1"})


def _whose(level: LimitState | None) -> str:
    """`` of application 'bot' of tenant 'acme'`` in a refusal's message, or nothing."""
    return "" if level is None else f" of {level.label}"


def budget_error(refusal: BudgetRefusal, level: LimitState | None = None) -> GatewayError:
    """400 for a request larger than a whole budget, else 429 with OpenAI's token headers.
    ``level``: whose budget, when the message should say (a tenant with applications)."""
    budget = refusal.budget
    whose = _whose(level)
    if math.isinf(refusal.retry_after_s):
        return GatewayError(
            400, f"this request reserves {refusal.cost:g} tokens of cost, more than the whole "
            f"budget {budget.key}{whose}; lower max_tokens or shorten the prompt",
            reason="larger_than_budget", code="budget_too_small", param="max_tokens")
    # A calendar budget says when its period ends (``retry-after`` and
    # ``x-ratelimit-reset-tokens`` count the seconds to it): one clock read, one format.
    when = (f"it resets at {iso(round(time.time() + refusal.reset_s))}"
            if budget.calendar is not None else f"retry in {refusal.retry_after_s:.3f} s")
    return GatewayError(
        429, f"token budget {budget.key}{whose} exhausted: this request needs "
        f"{refusal.cost:g}, {math.floor(refusal.remaining)} remain; {when}",
        reason="budget", code="rate_limit_exceeded",
        headers=refusal_headers(refusal, "tokens", int(budget.tokens)))


def request_limit_error(refusal: BudgetRefusal, level: LimitState | None = None) -> GatewayError:
    """429 for a ``max_requests`` limit, with OpenAI's request headers: the limit, the
    requests left now (0 when refused) and how long until the limit is whole again."""
    limit = refusal.budget
    assert isinstance(limit, RequestLimit)
    whose = _whose(level) if isinstance(level, ApplicationState) else ""
    return GatewayError(
        429, f"request rate limit {limit.requests} per {limit.figures.rsplit('/', 1)[1]}"
        f"{whose} reached; retry in {refusal.retry_after_s:.3f} s",
        reason="requests", code="rate_limit_exceeded",
        headers=refusal_headers(refusal, "requests", limit.requests))
