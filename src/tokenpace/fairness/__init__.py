"""Pure fairness and quota policy: token budgets, cost model, dispatch order.

Nothing here imports vLLM or a web stack; time is passed in, so tests and simulations
drive it exactly.
"""

from ._budget import (
    BudgetRefusal,
    BudgetSpec,
    Headroom,
    RequestLimit,
    TenantBudgets,
    TokenBucket,
    parse_duration,
    tightest,
)
from ._cost import CostModel, cached_part
from ._vtc import FairQueue, LaneSpec

__all__ = [
    "BudgetRefusal",
    "BudgetSpec",
    "CostModel",
    "cached_part",
    "FairQueue",
    "Headroom",
    "LaneSpec",
    "RequestLimit",
    "TenantBudgets",
    "TokenBucket",
    "parse_duration",
    "tightest",
]
