"""The ledger against the engines' books, per request: pure (no HTTP, no database).

An engine's book lists each request it ended with the tokens it generated
(``engine._ended``), by the API server's id; the gateway's request X is one or more of
them (``relay``: ``chatcmpl-X``, ``cmpl-X-p``, ``resp_X_t``, ``{i}_`` + those with
``n`` > 1), so ``gateway_id`` finds X in any of them and ``group`` sums a gateway
request's engine requests. ``compare`` sets each gateway request the engines ended
against its ledger row (or its missing row) and totals the differences per tenant.

What counts, per gateway request compared:

- no row: *unrecorded*, all its engine tokens;
- a row whose ``completion_tokens`` differ from the engine's sum: *differs*; the engine's
  tokens beyond the row's are unrecorded, the row's beyond the engine's overcharged;
- a row marked ``estimated`` (the gateway's estimate, not the engine's count): listed, and
  counted as above when its count differs.

When a request is not compared yet (``pending``): while its last engine request ended less
than ``grace_s`` ago (its row may be on its way: a settlement in the background, the
ledger's flush, a restarted gateway recording what it left in flight); and, without a
row, while it may have engine requests still running that the book has not listed (more
than one choice, several prompts, Responses turns): until ``hold_s`` after its last one
ended, the gateway's ``request_timeout`` and the grace, by which time a gateway has ended
it. A chat or Messages request with one choice (``chatcmpl-X``) has only one engine
request, so the grace alone applies.

Cost: O(entries) to group, O(requests) to compare.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..config import APPLICATION_SEPARATOR
from ..ledger import UsageRecord

GATEWAY_ID = re.compile(r"tpg-[0-9a-f]{32}")
"""The gateway's request id (``x-request-id``) inside an engine request's id."""

UNRECORDED, DIFFERS, ESTIMATED = "unrecorded", "differs", "estimated"


def gateway_id(engine_request_id: str) -> str | None:
    """The gateway request id inside ``engine_request_id``; None for a request that did
    not come through a gateway."""
    match = GATEWAY_ID.search(engine_request_id)
    return match.group(0) if match else None


def alone(engine_request_id: str, request_id: str) -> bool:
    """Whether ``engine_request_id`` is the only engine request gateway request
    ``request_id`` can have: chat or Messages with one choice."""
    return engine_request_id == f"chatcmpl-{request_id}"


def tenant_of_user(user: str, is_tenant: Callable[[str], bool]) -> str:
    """The configured tenant a pacing user (or a tenant id) belongs to: the user itself,
    or its part before ``APPLICATION_SEPARATOR``, when ``is_tenant`` says it is one;
    ``""`` for any other."""
    tenant = user.partition(APPLICATION_SEPARATOR)[0]
    return tenant if tenant and is_tenant(tenant) else ""


@dataclass(frozen=True)
class EngineEntry:
    """One request an engine ended, as its book lists it."""

    engine: str  # the engine's url
    request_id: str  # the API server's id
    user: str  # its pacing user ("" without one)
    prompt_tokens: int
    output_tokens: int
    ended_at: float  # unix seconds, the engine's clock


@dataclass
class EngineRequests:
    """A gateway request's engine requests seen so far."""

    request_id: str
    entries: list[EngineEntry] = field(default_factory=list)
    output_tokens: int = 0
    last_ended_at: float = float("-inf")
    alone: bool = False  # its one engine request is all it can have

    def add(self, entry: EngineEntry) -> None:
        self.entries.append(entry)
        self.output_tokens += entry.output_tokens
        self.last_ended_at = max(self.last_ended_at, entry.ended_at)
        self.alone = len(self.entries) == 1 and alone(entry.request_id, self.request_id)

    @property
    def user(self) -> str:
        return next((e.user for e in self.entries if e.user), "")

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.engine for e in self.entries))


def group(entries: Iterable[EngineEntry],
          into: dict[str, EngineRequests] | None = None) -> tuple[dict[str, EngineRequests], int]:
    """The entries by gateway request (added to ``into`` when given), and how many came
    from no gateway (no ``tpg-`` id: sent to the engine directly)."""
    requests = {} if into is None else into
    other = 0
    for entry in entries:
        request_id = gateway_id(entry.request_id)
        if request_id is None:
            other += 1
            continue
        seen = requests.get(request_id)
        if seen is None:
            seen = requests[request_id] = EngineRequests(request_id)
        seen.add(entry)
    return requests, other


@dataclass
class TenantDrift:
    """One tenant's figures over the requests compared. ``drift``: ledger minus engine."""

    tenant: str
    requests: int = 0
    engine_tokens: int = 0
    ledger_tokens: int = 0
    unrecorded_requests: int = 0
    unrecorded_tokens: int = 0  # the engine's tokens with no row, or beyond the row's
    overcharged_tokens: int = 0  # the row's tokens beyond the engine's
    differing_rows: int = 0
    estimated_rows: int = 0

    @property
    def drift(self) -> int:
        return self.ledger_tokens - self.engine_tokens

    @property
    def drifted(self) -> bool:
        return bool(self.unrecorded_requests or self.differing_rows)


@dataclass(frozen=True)
class Discrepancy:
    """One gateway request whose row is missing, differs from the engines, or is an
    estimate (``kind``: ``UNRECORDED``, ``DIFFERS``, ``ESTIMATED``; an estimated row that
    differs is ``DIFFERS`` with ``estimated`` set)."""

    request_id: str
    tenant: str
    kind: str
    engine_tokens: int
    ledger_tokens: int | None  # None: no row
    engines: tuple[str, ...]
    ended_at: float  # when its last engine request ended
    estimated: bool = False


@dataclass
class Reconciliation:
    """The outcome of one comparison: per tenant, the requests at fault, and the gateway
    requests not compared yet (``pending``, see the module)."""

    tenants: dict[str, TenantDrift] = field(default_factory=dict)
    discrepancies: list[Discrepancy] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)

    @property
    def drifted(self) -> bool:
        return any(t.drifted for t in self.tenants.values())

    def of(self, tenant: str) -> TenantDrift:
        figures = self.tenants.get(tenant)
        if figures is None:
            figures = self.tenants[tenant] = TenantDrift(tenant)
        return figures


def due(request: EngineRequests, row: UsageRecord | None, now: float, grace_s: float,
        hold_s: float) -> bool:
    """Whether ``request`` may be compared now (see the module)."""
    waited = now - request.last_ended_at
    if waited < grace_s:
        return False
    return row is not None or request.alone or waited >= hold_s


def compare(requests: Mapping[str, EngineRequests], rows: Mapping[str, UsageRecord], *,
            now: float, grace_s: float, hold_s: float,
            tenant_of: Callable[[str], str]) -> Reconciliation:
    """``requests`` (gateway id -> its engine requests) against ``rows`` (gateway id ->
    ledger row, those the ledger has). ``tenant_of``: a pacing user's tenant, for a
    request without a row (one with a row is its row's tenant)."""
    out = Reconciliation()
    for request_id, request in requests.items():
        row = rows.get(request_id)
        if not due(request, row, now, grace_s, hold_s):
            out.pending.append(request_id)
            continue
        engine = request.output_tokens
        tenant = row.tenant if row is not None else tenant_of(request.user)
        figures = out.of(tenant)
        figures.requests += 1
        figures.engine_tokens += engine
        if row is None:
            figures.unrecorded_requests += 1
            figures.unrecorded_tokens += engine
            out.discrepancies.append(Discrepancy(request_id, tenant, UNRECORDED, engine,
                                                 None, request.engines,
                                                 request.last_ended_at))
            continue
        ledger = row.completion_tokens
        figures.ledger_tokens += ledger
        figures.estimated_rows += row.estimated
        if ledger != engine:
            figures.differing_rows += 1
            figures.unrecorded_tokens += max(0, engine - ledger)
            figures.overcharged_tokens += max(0, ledger - engine)
        if ledger != engine or row.estimated:
            out.discrepancies.append(Discrepancy(
                request_id, tenant, DIFFERS if ledger != engine else ESTIMATED, engine,
                ledger, request.engines, request.last_ended_at, row.estimated))
    return out
