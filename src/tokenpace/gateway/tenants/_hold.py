"""Cost a request holds in buckets besides its tenant's enforced budgets.

The tenant's enforced reservation has its own fast path (settled with the slot's release in
one store call); everything else a request reserves (its application's budgets, limits in
observe mode) is a ``Hold``, given back to the actual cost when the request ends, in
process or in the shared store, the same way whatever took it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...fairness import TenantBudgets
from ..state import Reservation

if TYPE_CHECKING:
    from ._levels import LimitState


@dataclass
class Hold:
    """``reserved`` cost units taken from ``buckets`` in process, or ``reservation`` in
    the shared store. ``level``: the tenant or application whose enforced budgets these
    are (its levels go to the ledger's snapshot); None for buckets in observe mode."""

    buckets: TenantBudgets
    reserved: float
    reservation: Reservation | None
    level: LimitState | None = None

    def settle_local(self, actual: float, now: float) -> None:
        """Give back (or take) the difference to ``actual`` in process."""
        if self.level is not None:
            self.level.settle(self.reserved, actual, now)
        else:
            self.buckets.settle(self.reserved, actual, now)
        self.reserved = actual
