"""Limits in observe mode: they refuse nothing and count what they would have refused.

For rolling out a new limit: a budget, a request-rate limit or ``max_concurrency`` with
``mode: observe`` is kept exactly as if it were enforced (its bucket takes a request's
reservation and is settled to the actual cost, in this process or in the shared store),
except that where it would refuse, the request goes on, is counted in
``tokenpace_gateway_would_reject_total{tenant, application, reason}`` and, at most once a
minute per tenant (or application) and reason, logged. An application's limits in observe
mode count under their tenant with the application's id (``""``: the tenant's own). A request an observed limit would have refused is not charged
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
from ._config import APPLICATION_SEPARATOR
from ._hold import Hold
from ._state import Reservation, StateUnavailable

if TYPE_CHECKING:  # they import the dispatcher and the series, which call this module
    from ._runtime import Runtime
    from ._settle import Exchange
    from ._tenants import LimitState

logger = logging.getLogger("tokenpace.gateway")

LOG_EVERY_S = 60.0
"""At most one log line per tenant and reason in this many seconds (with the count since
the last line): a limit that would refuse every request must not flood the log."""


class WouldRejectLog:
    """When each (tenant or application, reason) was last logged, and how many were
    counted since."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}
        self._since: dict[tuple[str, str], int] = {}

    def note(self, owner: str, label: str, reason: str, limit: str, now: float) -> None:
        """``owner``: whose limit (a tenant id or an application's owner name), ``label``:
        how the log line names it."""
        key = (owner, reason)
        self._since[key] = self._since.get(key, 0) + 1
        last = self._last.get(key)
        if last is not None and now - last < LOG_EVERY_S:
            return
        count = self._since.pop(key)
        self._last[key] = now
        logger.warning(
            "%s: %s in observe mode would have %s %d request(s)%s", label, limit,
            "held back" if reason == "max_concurrency" else "refused", count,
            "" if last is None else f" in the last {now - last:.0f} s")

    def forget(self, tenant: str) -> None:
        """Drop the tenant's entries and its applications'."""
        prefix = tenant + APPLICATION_SEPARATOR
        for key in [k for k in self._last if k[0] == tenant or k[0].startswith(prefix)]:
            self._last.pop(key, None)
            self._since.pop(key, None)


_log = WouldRejectLog()


def would_reject(level: LimitState, reason: str, limit: str, now: float) -> None:
    """Count (and maybe log) one request that the observed ``limit`` of a tenant or an
    application (``level``) would have refused."""
    metrics.child(metrics.WOULD_REJECT, level.tenant_id, level.application_id, reason).inc()
    _log.note(level.owner, level.label, reason, limit, now)


async def _take(rt: Runtime, level: LimitState, specs: Sequence[BudgetSpec], cost: float,
                local: TenantBudgets) -> Reservation | BudgetRefusal | float | None:
    """Reserve ``cost`` on observed buckets: a ``Reservation`` in the shared store, the
    cost taken in process (``local``: the tenant's buckets of them), or the refusal. None
    when the shared store does not answer: an observed limit never refuses, not even then,
    and counts nothing."""
    if rt.store is not None:
        try:
            return await rt.store.reserve(level.owner, specs, cost)
        except StateUnavailable:
            return None
    refusal = local.try_reserve(cost, rt.clock())
    return cost if refusal is None else refusal


async def requests(rt: Runtime, level: LimitState) -> None:
    """The request against the observed ``max_requests`` of a tenant or an application
    (never refused)."""
    result = await _take(rt, level, level.config.observed_requests, 1.0,
                         level.observed_requests)
    if isinstance(result, BudgetRefusal):
        would_reject(level, "requests", f"max_requests {result.budget.figures}", rt.clock())


async def budgets(rt: Runtime, ex: Exchange, level: LimitState, cost: float) -> None:
    """Reserve the admitted request's ``cost`` on the observed budgets of its tenant or
    its application (``level``), settled with the enforced ones when it ends
    (``Exchange.finish``)."""
    result = await _take(rt, level, level.config.observed_budgets, cost,
                         level.observed_budgets)
    if isinstance(result, BudgetRefusal):
        would_reject(level, "budget", f"budget {result.budget.figures}", rt.clock())
    elif isinstance(result, Reservation):
        ex.holds.append(Hold(level.observed_budgets, 0.0, result))
    elif result is not None:
        ex.holds.append(Hold(level.observed_budgets, result, None))


def dispatched(level: LimitState, now: float) -> None:
    """A request of a tenant or an application (``level``) started running (``inflight``
    counts it): count it when an observed ``max_concurrency`` would have held it in the
    queue. Per dispatch: one attribute read when no such limit is set."""
    limit = level.config.observed_concurrency
    if limit is not None and level.inflight > limit:
        would_reject(level, "max_concurrency", f"max_concurrency {limit}", now)


def forget(tenant: str) -> None:
    """A tenant's series went (idle or removed): its log state goes too."""
    _log.forget(tenant)
