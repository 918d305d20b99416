"""Limits in observe mode, the counting half: what they would have refused.

A limit with ``mode: observe`` refuses nothing; where it would have refused, the request
goes on and is counted in ``tokenpace_gateway_would_reject_total{tenant, application,
reason}`` and, at most once a minute per tenant (or application) and reason, logged. An
application's limits count under their tenant with the application's id (``""``: the
tenant's own). For ``max_concurrency``, which makes requests wait rather than refusing
them, what is counted is a dispatch past the limit (one that would have waited in the
queue), per gateway replica. The reserving half (observed budgets and request limits, kept
as if enforced) is admission's (``gateway.admission``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .. import metrics
from ..config import APPLICATION_SEPARATOR

if TYPE_CHECKING:
    from ._levels import LimitState

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
