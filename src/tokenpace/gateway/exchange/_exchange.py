"""The end of one request: slot back, budget settled, metrics counted, one ledger row.

Every request that got past authentication ends in exactly one call of
``Exchange.finish``: it gives the engine slot back, settles the budget reservation to the
cost actually incurred, counts the outcome in the metrics and writes one ledger row. That
single exit is what makes "nothing leaked" checkable whatever went wrong (client gone,
engine gone, timeout, refusal).

How a request ended is one ``Outcome``; the strings it becomes (the ledger's
``finish_reason``, the ``outcome`` label of ``tokenpace_gateway_requests``) are made in one
place, ``Outcome.finish_reason``, and are the ones users' ledgers and the dashboard in
deploy/ already read: do not change them.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from ...fairness import CostModel, Headroom, cached_part
from .. import metrics
from ..dispatch import Lease
from ..engines import Learned
from ..ledger import UsageRecord
from ..state import Reservation
from ..tenants import ApplicationState, Hold, TenantState
from ..wire import ROUTES, Kind
from ._runtime import Runtime


class Outcome(enum.Enum):
    """How a request ended. The value is the ledger's finish_reason, except for FINISHED
    (the engine's own finish reason) and REJECTED (``rejected:<reason>``)."""

    FINISHED = "stop"  # the engine answered; its finish reason ("stop", "length", ...) is kept
    REJECTED = "rejected"  # refused by the gateway, with the refusal's reason
    CANCELLED = "cancelled"  # the client went away after its body arrived
    CLIENT_DISCONNECTED = "client_disconnected"  # ... while it was still sending its body
    TIMEOUT = "timeout"  # request_timeout ran out
    UPSTREAM_ERROR = "upstream_error"  # the engine failed or refused
    ERROR = "error"  # a bug in the gateway

    def finish_reason(self, detail: str | None = None) -> str:
        """The ledger's finish_reason: the engine's reason (FINISHED), ``rejected:<reason>``
        (REJECTED), else the outcome's own name."""
        if self is Outcome.FINISHED:
            return detail or self.value
        if self is Outcome.REJECTED:
            return f"rejected:{detail}"
        return self.value


@dataclass
class Exchange:
    """The book-keeping of one request, from arrival to its ledger row."""

    rt: Runtime
    id: str
    kind: Kind
    tenant: TenantState
    arrived: float
    started_at: float
    model: str = ""  # the served name once routed (aliases resolved), else as the client sent it
    routed: bool = False  # ``model`` is a name an engine serves (a bounded metric label)
    cost: CostModel = field(default_factory=CostModel)  # the model's coefficients
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Of the prompt, the tokens the engine found in its prefix cache, once its final usage
    # said so (0: none, or not reported); priced by ``cost.cached_prompt`` at settlement.
    cached_prompt_tokens: int = 0
    reserved: float = 0.0
    reservation: Reservation | None = None  # taken in the shared store (state: redis://)
    # What else it reserved: its application's budgets, limits in observe mode.
    holds: list[Hold] = field(default_factory=list)
    application: ApplicationState | None = None  # the application its key names
    # The tightest request limit and token budget once admission took this request's
    # share (the response's x-ratelimit-* headers); None: no enforced limit of that kind.
    requests_headroom: Headroom | None = None
    tokens_headroom: Headroom | None = None
    max_completion_tokens: int = 0
    charged_tokens: int = 0  # completion tokens already charged to the fair queue
    charge_usage: bool = True
    prompt_counted: bool = False  # the prompt's cost is in the fair queue's counter
    cache_credited: bool = False  # the cached discount is in the fair queue's counter
    # Admitted on the prompt's byte bound (no /tokenize): the bound, until the engine's
    # usage brings the exact count; and where the bound came from, to report a violation.
    prompt_bound: int | None = None
    bound_source: Learned | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    lease: Lease | None = None  # set once an engine slot was granted
    split_on: str | None = None  # the engine whose share of a split rate this stream holds
    finished: bool = field(default=False)
    # A line of a batch (``/v1/batches``): its batch's id, and the lane it runs in (the
    # ledger's and the metrics' lane, the engine's priority); "" and None for a live request.
    batch_id: str = ""
    batch_lane: str | None = None

    @property
    def lane(self) -> str:
        return self.batch_lane or self.tenant.config.lane

    def learn_prompt(self, tokens: int) -> None:
        """The engine's own count of the prompt, from its usage (once per request).

        After an admission on the byte bound: check that the bound held, and correct the
        reservation to the exact count now, so the over-reservation goes back to the
        tenant's budgets while the request still runs (budgets in this process; a shared
        store's reservation is replaced by the exact cost at ``finish``). Cost: a compare,
        and one bucket update per budget when the request was admitted on the bound.
        """
        self.prompt_tokens = tokens
        bound = self.prompt_bound
        if bound is None:
            return
        self.prompt_bound = None
        if tokens > bound and self.bound_source is not None:
            self.bound_source.violated(bound, tokens)
        if self.finished:
            return
        corrected = self.cost.of(tokens, self.max_completion_tokens)
        if self.reservation is None and self.reserved:
            self.tenant.settle(self.reserved, corrected, self.rt.clock())
            self.reserved = corrected
        for hold in self.holds:
            if hold.reservation is None and hold.reserved:
                hold.settle_local(corrected, self.rt.clock())

    def learn_cached(self, tokens: int | None) -> None:
        """The engine's count of the prompt's tokens it found in its prefix cache (None:
        not reported, e.g. an engine without ``--enable-prompt-tokens-details``; the prompt
        is then charged in full). Read from the final usage, so it is known only after the
        prompt ran: admission reserved the whole prompt at ``cost.prompt`` and the fair
        queue charged it so at dispatch; ``charge_progress`` and ``finish`` apply the
        discount."""
        if tokens is not None and not self.finished:
            self.cached_prompt_tokens = max(tokens, 0)

    def charge_progress(self) -> None:
        """Grow the tenant's fair-queue counter by the tokens generated since last time
        (and by the prompt, once the engine's usage gave its size if it was not counted);
        once the cached count is known, take the cached discount off the prompt charged in
        full (a negative charge of ``cost.cache_credit``, once)."""
        if self.lease is None or not self.charge_usage:
            return
        cost = 0.0
        if not self.prompt_counted and self.prompt_tokens:
            cost += self.prompt_tokens * self.cost.prompt
            self.prompt_counted = True
        if self.cached_prompt_tokens and self.prompt_counted and not self.cache_credited:
            cost -= self.cost.cache_credit(self.prompt_tokens, self.cached_prompt_tokens)
            self.cache_credited = True
        delta = self.completion_tokens - self.charged_tokens
        if delta > 0:
            cost += delta * self.cost.completion
            self.charged_tokens = self.completion_tokens
        if cost:
            self.lease.charge(cost)

    def finish(self, outcome: Outcome, detail: str | None = None) -> None:
        """Settle the request (idempotent). ``detail``: the engine's finish reason for
        FINISHED, the refusal's reason for REJECTED."""
        if self.finished:
            return
        self.finished = True
        rt = self.rt
        if self.prompt_bound is not None and self.charge_usage and self.lease is not None:
            # Sent to the engine, which never reported the prompt (the client left or the
            # time ran out before the first usage): its bound is charged, as the output's
            # reservation is for a non-streamed request that timed out.
            self.prompt_tokens, self.prompt_bound = self.prompt_bound, None
        # The settlement: the cached discount applies to the reservation made in full.
        actual = (self.cost.of(self.prompt_tokens, self.completion_tokens,
                               self.cached_prompt_tokens)
                  if self.charge_usage else 0.0)
        settled = False
        if self.split_on is not None and rt.rate_split is not None:
            rt.rate_split.end(self.tenant.id, self.tenant.config.output_tokens_per_second,
                              self.split_on)
        if self.lease is not None:
            self.charge_progress()
            # With shared slots the release and the settlement go in one store call.
            settled = self.lease.release(
                None if self.reservation is None else (self.reservation, actual))
        if settled:
            pass
        elif self.reservation is not None:
            # One script, off the request's path; a failure leaves the reservation charged.
            settle_in_store(rt, self.reservation, actual)
        elif self.reserved:
            self.tenant.settle(self.reserved, actual, rt.clock())
        for hold in self.holds:
            if hold.reservation is not None:
                settle_in_store(rt, hold.reservation, actual)
            elif hold.reserved:
                hold.settle_local(actual, rt.clock())
        e2e = rt.clock() - self.arrived
        if self.lease is not None:
            self.tenant.record_service(e2e - (self.queue_s or 0.0))
        reason = outcome.finish_reason(detail)
        rt.tenants.touch(self.tenant)  # the series stay for metrics_idle_after from here
        tenant, lane = self.tenant.id, self.lane
        # An engine's finish reason is passed on as it is; its label is the part before a
        # colon, as for "rejected:<reason>".
        outcome_label = reason.split(":", 1)[0]
        metrics.child(metrics.REQUESTS, tenant, lane, outcome_label).inc()
        model = self.model if self.routed else ""  # a served name: bounded labels
        # Per request: one cached child lookup (a dict get) per series, as for the tenant's.
        metrics.child(metrics.MODEL_REQUESTS, model, outcome_label).inc()
        if outcome is Outcome.REJECTED:
            metrics.child(metrics.REJECTIONS, tenant, reason.split(":", 1)[1]).inc()
        application = self.application.id if self.application is not None else ""
        served = self.charge_usage and self.lease is not None
        # The clamped count, the one that was priced.
        cached = cached_part(self.prompt_tokens, self.cached_prompt_tokens) \
            if served and self.cached_prompt_tokens else 0
        if application:
            # Per request of an application: two more cached child lookups (three on a hit).
            metrics.child(metrics.APPLICATION_REQUESTS, tenant, application, outcome_label).inc()
            if served:
                metrics.child(metrics.APPLICATION_TOKENS, tenant, application,
                              "prompt").inc(self.prompt_tokens)
                metrics.child(metrics.APPLICATION_TOKENS, tenant, application,
                              "completion").inc(self.completion_tokens)
                if cached:
                    metrics.child(metrics.APPLICATION_TOKENS, tenant, application,
                                  "cached_prompt").inc(cached)
        if served:
            metrics.child(metrics.PROMPT_TOKENS, tenant, lane).inc(self.prompt_tokens)
            if cached:
                metrics.child(metrics.CACHED_PROMPT_TOKENS, tenant, lane).inc(cached)
                metrics.child(metrics.MODEL_TOKENS, model, "cached_prompt").inc(cached)
            metrics.child(metrics.COMPLETION_TOKENS, tenant, lane).inc(self.completion_tokens)
            metrics.child(metrics.SERVICE, tenant, lane).inc(actual)
            metrics.child(metrics.MODEL_TOKENS, model, "prompt").inc(self.prompt_tokens)
            metrics.child(metrics.MODEL_TOKENS, model, "completion").inc(self.completion_tokens)
            metrics.child(metrics.E2E_SECONDS, tenant).observe(e2e)
        if self.ttft_s is not None:
            metrics.child(metrics.TTFT_SECONDS, tenant).observe(self.ttft_s)
        # The row's model is the metrics' label: a served name, "" for a model the gateway
        # does not serve (the client's string, unbounded and unvetted, is not kept).
        rt.ledger.record(UsageRecord(
            request_id=self.id, tenant=tenant, model=model, lane=lane,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens if self.charge_usage else 0,
            cost=actual,
            queue_ms=None if self.queue_s is None else self.queue_s * 1000.0,
            ttft_ms=None if self.ttft_s is None else self.ttft_s * 1000.0,
            e2e_ms=e2e * 1000.0, finish_reason=reason,
            started_at=self.started_at, ended_at=time.time(),
            served=self.charge_usage and self.lease is not None,
            route=ROUTES[self.kind], application=application,
            cached_prompt_tokens=(cached_part(self.prompt_tokens, self.cached_prompt_tokens)
                                  if self.charge_usage else 0),
            batch_id=self.batch_id,
        ))


def settle_in_store(rt: Runtime, reservation: Reservation, actual: float) -> None:
    """Settle a shared-store reservation in the background (kept in ``rt.settling``)."""
    task = asyncio.get_running_loop().create_task(
        rt.store.settle(reservation, actual))  # type: ignore[union-attr]
    rt.settling.add(task)
    task.add_done_callback(rt.settling.discard)
