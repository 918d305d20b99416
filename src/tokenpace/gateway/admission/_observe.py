"""Limits in observe mode, the reserving half: kept exactly as if they were enforced.

For rolling out a new limit: a budget or a request-rate limit with ``mode: observe`` takes
a request's reservation and is settled to the actual cost (in this process or in the
shared store) like an enforced one, except that where it would refuse, the request goes on
and is counted (``tenants``' ``would_reject``). A request an observed limit would have
refused is not charged to it, as it would not have run. Observed ``max_concurrency`` is
counted at dispatch (``tenants``' ``dispatched``).

Enforced limits come first: a request they refuse is never seen here.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...fairness import BudgetRefusal, BudgetSpec, TenantBudgets
from ..exchange import Exchange, Runtime
from ..state import Reservation, StateUnavailable
from ..tenants import Hold, LimitState, would_reject


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


