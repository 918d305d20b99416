"""Limits in observe mode: they refuse nothing and count what they would have refused.

For rolling out a new limit: a budget, a request-rate limit or ``max_concurrency`` with
``mode: observe`` is kept exactly as if it were enforced (its bucket takes a request's
reservation and is settled to the actual cost, in this process or in the shared store),
except that where it would refuse, the request goes on, is counted in
``tokenpace_gateway_would_reject_total{tenant, reason}`` and, at most once a minute per
tenant and reason, logged. A request an observed limit would have refused is not charged
to it, as it would not have run; for ``max_concurrency``, which makes requests wait rather
than refusing them, what is counted is a dispatch past the limit (one that would have
waited in the queue), per gateway replica.

Enforced limits come first: a request they refuse is never seen here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..fairness import BudgetRefusal, BudgetSpec, TenantBudgets
from . import _metrics as metrics
from ._state import Reservation, StateUnavailable

if TYPE_CHECKING:  # they import the dispatcher and the series, which call this module
    from ._runtime import Runtime
    from ._settle import Exchange
    from ._tenants import TenantState

logger = logging.getLogger("tokenpace.gateway")

LOG_EVERY_S = 60.0
"""At most one log line per tenant and reason in this many seconds (with the count since
the last line): a limit that would refuse every request must not flood the log."""


class WouldRejectLog:
    """When each (tenant, reason) was last logged, and how many were counted since."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}
        self._since: dict[tuple[str, str], int] = {}

    def note(self, tenant: str, reason: str, limit: str, now: float) -> None:
        key = (tenant, reason)
        self._since[key] = self._since.get(key, 0) + 1
        last = self._last.get(key)
        if last is not None and now - last < LOG_EVERY_S:
            return
        count = self._since.pop(key)
        self._last[key] = now
        logger.warning(
            "tenant %r: %s in observe mode would have %s %d request(s)%s", tenant, limit,
            "held back" if reason == "max_concurrency" else "refused", count,
            "" if last is None else f" in the last {now - last:.0f} s")

    def forget(self, tenant: str) -> None:
        for key in [k for k in self._last if k[0] == tenant]:
            self._last.pop(key, None)
            self._since.pop(key, None)


_log = WouldRejectLog()


def would_reject(tenant: TenantState, reason: str, limit: str, now: float) -> None:
    """Count (and maybe log) one request that the observed ``limit`` would have refused."""
    metrics.child(metrics.WOULD_REJECT, tenant.id, reason).inc()
    _log.note(tenant.id, reason, limit, now)


async def _take(rt: Runtime, tenant: TenantState, specs: Sequence[BudgetSpec], cost: float,
                local: TenantBudgets) -> Reservation | BudgetRefusal | float | None:
    """Reserve ``cost`` on observed buckets: a ``Reservation`` in the shared store, the
    cost taken in process (``local``: the tenant's buckets of them), or the refusal. None
    when the shared store does not answer: an observed limit never refuses, not even then,
    and counts nothing."""
    if rt.store is not None:
        try:
            return await rt.store.reserve(tenant.id, specs, cost)
        except StateUnavailable:
            return None
    refusal = local.try_reserve(cost, rt.clock())
    return cost if refusal is None else refusal


async def requests(rt: Runtime, tenant: TenantState) -> None:
    """The request against the tenant's observed ``max_requests`` (never refused)."""
    result = await _take(rt, tenant, tenant.config.observed_requests, 1.0,
                         tenant.observed_requests)
    if isinstance(result, BudgetRefusal):
        would_reject(tenant, "requests", f"max_requests {result.budget.figures}", rt.clock())


async def budgets(rt: Runtime, ex: Exchange, cost: float) -> None:
    """Reserve the admitted request's ``cost`` on the tenant's observed budgets (settled
    with its enforced ones when it ends: ``Exchange.finish``)."""
    tenant = ex.tenant
    result = await _take(rt, tenant, tenant.config.observed_budgets, cost,
                         tenant.observed_budgets)
    if isinstance(result, BudgetRefusal):
        would_reject(tenant, "budget", f"budget {result.budget.figures}", rt.clock())
    elif isinstance(result, Reservation):
        ex.observed_reservation = result
    elif result is not None:
        ex.observed_reserved = result


def dispatched(tenant: TenantState, now: float) -> None:
    """A request of ``tenant`` started running (``inflight`` counts it): count it when an
    observed ``max_concurrency`` would have held it in the queue. Per dispatch: one
    attribute read when no such limit is set."""
    limit = tenant.config.observed_concurrency
    if limit is not None and tenant.inflight > limit:
        would_reject(tenant, "max_concurrency", f"max_concurrency {limit}", now)


def forget(tenant: str) -> None:
    """A tenant's series went (idle or removed): its log state goes too."""
    _log.forget(tenant)
