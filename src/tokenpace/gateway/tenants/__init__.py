"""Live tenant and application state: what outlives a request and a reload.

Each tenant (and each application inside it) has one state object: its counters
(in flight, queued), its budget and request-limit buckets in this process, and its
configuration, swapped in place by a reload (``Tenants.plan`` / ``commit``). Beside them:
which tenants have series on /metrics (``TenantSeries``), what limits in observe mode would
have refused (``would_reject``, ``dispatched``), the cost a request holds besides its
tenant's budgets (``Hold``), and shared budget levels read back from Redis for the gauges
(``SharedBudgetLevels``).
"""

from ._hold import Hold
from ._levels import TOKENIZE_SLOTS_PER_TENANT, ApplicationState, LimitState, TenantState
from ._series import TenantSeries
from ._shared_levels import SharedBudgetLevels
from ._tenants import ReloadPlan, Tenants
from ._would_reject import dispatched, would_reject

__all__ = [
    "ApplicationState",
    "dispatched",
    "Hold",
    "LimitState",
    "ReloadPlan",
    "SharedBudgetLevels",
    "Tenants",
    "TenantSeries",
    "TenantState",
    "TOKENIZE_SLOTS_PER_TENANT",
    "would_reject",
]
