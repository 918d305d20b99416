"""The values the ledger stores and returns, and its one error.

The URL parser, the schema, both databases, the writer and the queries all use them; kept
in a module of their own, none of those has to import another for them.
"""

from __future__ import annotations

from dataclasses import dataclass


class LedgerError(RuntimeError):
    """The ledger URL is malformed, or its database cannot be opened, created or written."""


@dataclass(frozen=True)
class UsageRecord:
    """What one request used and how long it took; one row of the ``requests`` table.

    ``model`` is the served name the request was routed to (aliases resolved), or ``""``
    when the gateway does not serve the model the client asked for (``rejected:
    model_not_found``) or refused the request before reading it: a client's own string
    never becomes a row's model, as it never becomes a metric label.

    Whatever the fields hold, the row written is one every database accepts and of
    bounded size: :func:`._schema.record_row` removes NUL characters, replaces lone
    surrogates, caps each text field (:data:`._schema.MAX_ID_CHARS`,
    :data:`._schema.MAX_NAME_CHARS`) and makes NaN or infinite numbers finite, so a row
    read back may differ from the record given in exactly those ways.
    """

    request_id: str
    tenant: str
    model: str
    lane: str
    prompt_tokens: int
    completion_tokens: int
    cost: float
    queue_ms: float | None
    ttft_ms: float | None
    e2e_ms: float
    finish_reason: str
    started_at: float
    ended_at: float
    # Whether the request reached the engine and is charged: the same rule as the
    # gateway's token metrics. A refused request, or one cancelled while queued, keeps
    # its counted prompt size in ``prompt_tokens`` but is not served.
    served: bool = True
    route: str = ""  # the path the client called, e.g. "/v1/responses"
    # The application whose key the request came with; "" for a tenant-level key, or a
    # request refused before authentication. Unique only inside its tenant.
    application: str = ""
    # Of ``prompt_tokens``, those the engine found in its prefix cache and that were
    # charged at ``cost.cached_prompt`` (0: none, or the engine did not report them).
    cached_prompt_tokens: int = 0
    # The batch (``/v1/batches``) whose input line this request was; "" for a live request.
    batch_id: str = ""
    # The completion count (and, if the engine never reported it, the prompt count) is the
    # gateway's estimate, not the engine's: the engine could not say what a request that
    # died in flight generated (plain vLLM keeps no count of an aborted request).
    estimated: bool = False


@dataclass(frozen=True)
class BudgetState:
    """A tenant's bucket level for one budget (e.g. ``"20000/10s"``) at unix time ``at``."""

    tenant: str
    budget: str
    level: float
    at: float


@dataclass(frozen=True)
class UsageTotal:
    """Totals for one tenant, model, lane, route or application. ``requests`` counts every
    row, rejected ones included; ``rejected`` counts the rows whose finish reason starts
    with ``rejected:``. ``prompt_tokens`` are those of served requests only (what the
    gateway's ``tokenpace_gateway_prompt_tokens`` metric counts); ``unserved_prompt_tokens``
    those counted for requests that never ran (refused, cancelled while queued, engine
    error). ``cached_prompt_tokens``: the part of ``prompt_tokens`` the engines found in
    their prefix cache (priced by ``cost.cached_prompt``). ``estimated_rows``: the rows whose
    counts are the gateway's estimate rather than the engine's (``UsageRecord.estimated``).

    Grouped by application, ``key`` is the application id (``""``: the tenant's own keys)
    and ``tenant`` its tenant, in a field of its own: an application id is unique only
    inside its tenant, and both ids may contain ``/`` or any other printable separator a
    joined key could use. ``tenant`` is ``None`` for every other grouping."""

    key: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost: float
    rejected: int
    unserved_prompt_tokens: int = 0
    tenant: str | None = None
    cached_prompt_tokens: int = 0  # of ``prompt_tokens``: those served from the prefix cache
    estimated_rows: int = 0  # of ``requests``: rows whose counts are the gateway's estimate
