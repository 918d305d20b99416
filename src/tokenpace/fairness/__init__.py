"""Pure fairness and quota policy: token budgets, cost model, dispatch order.

Nothing here imports vLLM or a web stack; time is passed in, so tests and simulations
drive it exactly.
"""

from ._budget import (
    Bucket,
    BudgetRefusal,
    BudgetSpec,
    CalendarBucket,
    Headroom,
    RequestLimit,
    TenantBudgets,
    TokenBucket,
    make_bucket,
    parse_duration,
    resets_at,
    tightest,
)
from ._calendar import PERIODS, iso, nominal_seconds, period_end, period_start
from ._cost import CostModel, cached_part
from ._vtc import FairQueue, LaneSpec

__all__ = [
    "Bucket",
    "BudgetRefusal",
    "CalendarBucket",
    "BudgetSpec",
    "CostModel",
    "cached_part",
    "FairQueue",
    "Headroom",
    "LaneSpec",
    "RequestLimit",
    "TenantBudgets",
    "TokenBucket",
    "iso",
    "make_bucket",
    "nominal_seconds",
    "parse_duration",
    "period_end",
    "period_start",
    "PERIODS",
    "resets_at",
    "tightest",
]
