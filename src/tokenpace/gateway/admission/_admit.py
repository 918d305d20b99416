"""Admission: whether a request may wait for an engine slot.

The stages before the queue, once the tenant is known (``_identity``): the body (size
limit), the per-request caps, and the budget reservation (in this process, or in the
shared state store with ``state: redis://``). Refusals that need no prompt count come
first, so a prompt its limits refuse never reaches the engine's tokenizer; then a prompt
whose byte bound (``engines.prompt_bound``) proves every limit holds is admitted without a
round trip, and only the rest wait for the engine's exact count. ``admit`` returns an
``Admission``; it records on the ``Exchange`` what it learnt on the way (prompt size,
reservation), so a refusal's ledger row shows it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from starlette.requests import ClientDisconnect
from starlette.types import Receive

from ...fairness import BudgetRefusal, Headroom, TenantBudgets, tightest
from ..engines import prompt_bound
from ..exchange import Exchange, Runtime, settle_in_store
from ..state import Reservation, StateStore, StateUnavailable
from ..tenants import ApplicationState, Hold, LimitState, TenantState
from ..wire import (
    POOLING_KINDS,
    GatewayError,
    ParsedRequest,
    count_calls,
    pooling_prompt_bytes,
    prompt_token_ids,
)
from . import _observe as observe
from ._refusals import (
    body_rate_limited,
    budget_error,
    queue_full,
    request_limit_error,
    state_unavailable,
)


@dataclass(frozen=True)
class Admission:
    """An admitted request's sizes: what is reserved and what the engine is asked for."""

    prompt_tokens: int  # counted (or given as ids); 0 when no decision needed the count
    max_tokens: int  # per choice, sent to the engine
    reserved: float  # cost units reserved: prompt + max_tokens x n


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The request body from the ASGI ``receive`` channel, at most ``limit`` bytes
    (``declared``: the ``Content-Length`` header, refused at once when over the limit).
    Raises ``ClientDisconnect`` if the client leaves while sending it."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"request body larger than {limit} bytes", reason="body_too_large",
                           code="body_too_large")
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"request body larger than {limit} bytes",
                               reason="body_too_large", code="body_too_large")
        if not message.get("more_body", False):
            if not chunks:
                return chunk  # the usual case: the whole body in one message
            chunks.append(chunk)
            return b"".join(chunks)
        chunks.append(chunk)


async def read_paced_body(tenant: TenantState, receive: Receive, declared: str | None,
                          limit: int, clock: Callable[[], float]) -> bytes:
    """``read_body`` within the tenant's ``max_body_bytes_per_second``: a 429 before any
    byte is read while the tenant owes too much (``tenants._body_rate``); a declared length
    is charged before the body is read, an undeclared one once it is. Cost: a few float
    operations per request."""
    pace = tenant.body_rate
    if pace is None:
        return await read_body(receive, declared, limit)
    now = clock()
    wait = pace.wait_s(now)
    if wait > 0:
        raise body_rate_limited(tenant, wait)
    size = int(declared) if declared is not None and declared.isdigit() else None
    if size is not None and size <= limit:  # over the limit: read_body's 413, no charge
        pace.charge(size, now)
    raw = await read_body(receive, declared, limit)
    if size is None:
        pace.charge(len(raw), clock())
    return raw


async def admit(rt: Runtime, ex: Exchange, req: ParsedRequest, client: httpx.AsyncClient,
                engine: str | None = None) -> Admission:
    """Caps and budget: raise ``GatewayError`` for a refusal, else reserve and return the
    sizes. ``client`` reaches the engine's ``/tokenize`` when the prompt must be counted;
    ``engine`` (its URL, by default the client's) keys what is learned about its templates.

    The prompt's size is known in one of four ways, cheapest first: not needed (no cap,
    budget or missing ``max_tokens`` depends on it: the engine's usage brings it); token
    ids (their number); the byte bound (``engines.prompt_bound``), when it proves every limit
    holds and the budgets take a reservation on it; else the engine's exact count.
    """
    tenant, app = ex.tenant, ex.application
    _cheap_refusals(rt, ex, req)
    for level in (tenant,) if app is None else (app, tenant):
        if level.config.max_requests:
            ex.requests_headroom = tightest((ex.requests_headroom, await _take_request(rt, level)))
    for level in (tenant,) if app is None else (tenant, app):
        if level.config.observed_requests:
            await observe.requests(rt, level)
    ids = prompt_token_ids(req)
    if ids is not None:
        return await _admit_counted(rt, ex, req, sum(map(len, ids)), None, counted=True,
                                    longest=max(map(len, ids)))
    if not _needs_count(ex, req):
        # No decision depends on the prompt's size: it is counted by the engine, and
        # the engine's first usage chunk (or its answer) brings the exact number.
        return await _admit_counted(rt, ex, req, 0, None, counted=False)
    if rt.config.prompt_count == "bound":
        admission = await _admit_on_bound(rt, ex, req, client,
                                          engine or str(client.base_url).rstrip("/"))
        if admission is not None:
            return admission
    async with tenant.tokenize_slots:
        prompt_tokens, longest, max_model_len = await _count_prompt(client, req)
    return await _admit_counted(rt, ex, req, prompt_tokens, max_model_len, counted=True,
                                longest=longest)


async def _admit_counted(rt: Runtime, ex: Exchange, req: ParsedRequest, prompt_tokens: int,
                         max_model_len: int | None, *, counted: bool,
                         longest: int | None = None) -> Admission:
    """Caps and reservation with the prompt's size known exactly (``counted``), or not
    needed by any decision (0: the engine's usage brings it). ``prompt_tokens``: all the
    request's prompts together (a batch of completion prompts is capped and reserved as
    a whole); ``longest``: its longest prompt, which bounds the room left for output."""
    tenant = ex.tenant
    ex.prompt_counted = counted
    ex.prompt_tokens = prompt_tokens
    max_tokens = _admit_sizes(tenant, req, prompt_tokens, max_model_len,
                              prompt_tokens if longest is None else longest)
    reserved = ex.cost.of(prompt_tokens, max_tokens * req.sequences)
    refused = await _reserve(rt, ex, reserved)
    if refused is not None:
        raise budget_error(*refused)
    ex.reserved = reserved
    ex.max_completion_tokens = max_tokens * req.sequences
    await _observe_budgets(rt, ex, reserved)
    return Admission(prompt_tokens, max_tokens, reserved)


async def _observe_budgets(rt: Runtime, ex: Exchange, reserved: float) -> None:
    """The admitted cost on the budgets in observe mode of the tenant and its application."""
    for level in _levels(ex):
        if level.config.observed_budgets:
            await observe.budgets(rt, ex, level, reserved)


def _levels(ex: Exchange) -> tuple[LimitState, ...]:
    """The tenant, and its application when the key named one."""
    return (ex.tenant,) if ex.application is None else (ex.tenant, ex.application)


async def _admit_on_bound(rt: Runtime, ex: Exchange, req: ParsedRequest,
                          client: httpx.AsyncClient, engine: str) -> Admission | None:
    """Admit on the prompt's byte bound, or None when the exact count is needed.

    The bound decides when it proves the prompt within ``max_input_tokens``, when a
    missing ``max_tokens`` is filled in with ``max_output_tokens`` that fits the context
    beside the bound, and when the budgets take a reservation of the bound. Anything
    else may still pass with the exact count, so it is taken (a refusal is never given
    on the bound alone). Cost, once the engine and model are learned: a dict lookup and
    one pass over the prompt's strings (O(1) each when ASCII); no round trip.
    """
    tenant, cfg = ex.tenant, ex.tenant.config
    # The probes learn chat templates and plain prompts only; a pooling request's inputs
    # are plain prompts (``engines.prompt_bound`` says which it claims).
    probed = "completion" if req.kind in POOLING_KINDS else req.kind
    if probed not in ("chat", "completion") or (req.prompts > 1 and probed == req.kind):
        return None
    if req.max_tokens is None and cfg.max_output_tokens is None:
        return None  # the room left beside the prompt, sent as max_tokens, needs its size
    learned = await rt.prompt_bounds.learned(client, engine, req.model, probed,
                                             tenant.tokenize_slots)
    if learned is None or learned.overhead is None or not learned.trusted:
        return None
    bound = prompt_bound(req, learned.overhead)
    if bound is None:
        return None
    if cfg.max_input_tokens is not None and bound > cfg.max_input_tokens:
        return None
    if req.max_tokens is None:
        room = learned.overhead.max_model_len
        if cfg.max_output_tokens is None or room is None or bound + cfg.max_output_tokens > room:
            return None  # the room beside the prompt needs its exact size
        max_tokens = cfg.max_output_tokens
    else:
        max_tokens = _admit_sizes(tenant, req, 0, None, 0)  # max_output_tokens
    reserved = ex.cost.of(bound, max_tokens * req.sequences)
    if await _reserve(rt, ex, reserved) is not None:
        return None  # the bound does not fit; the exact count may
    ex.prompt_tokens, ex.prompt_counted = 0, False
    ex.prompt_bound, ex.bound_source = bound, learned
    ex.reserved = reserved
    ex.max_completion_tokens = max_tokens * req.sequences
    await _observe_budgets(rt, ex, reserved)
    return Admission(0, max_tokens, reserved)


async def _reserve(rt: Runtime, ex: Exchange,
                   cost: float) -> tuple[BudgetRefusal, LimitState | None] | None:
    """Take ``cost`` from the tenant's budgets and its application's (shared store or in
    process): both take it, or neither keeps it and the refusal is returned with whose
    budget refused (None: the tenant's, and it has no application to tell apart). The
    application's first: its refusal leaves the tenant's budgets untouched."""
    app = ex.application
    held: Hold | None = None
    if app is not None and app.config.budgets:
        result = await _reserve_level(rt, app, cost)
        if isinstance(result, BudgetRefusal):
            return result, app
        held = result
    refusal = await _reserve_tenant(rt, ex, cost)
    if held is not None:
        if refusal is None:
            ex.holds.append(held)
        else:
            _undo(rt, held)
    if refusal is None:
        ex.tokens_headroom = tightest((
            None if held is None else _left(rt, held.reservation, held.buckets),
            _left(rt, ex.reservation, ex.tenant.budgets)))
        return None
    return refusal, None if app is None else ex.tenant


def _left(rt: Runtime, reservation: Reservation | None, buckets: TenantBudgets) -> Headroom | None:
    """What a level's enforced budgets have left after this request's reservation: as
    the shared store answered it, else the buckets in process (None without budgets)."""
    if reservation is not None:
        return reservation.headroom()
    return buckets.headroom(rt.clock())


async def _reserve_tenant(rt: Runtime, ex: Exchange, cost: float) -> BudgetRefusal | None:
    """Take ``cost`` from the tenant's budgets (shared store or in process), or the refusal."""
    tenant = ex.tenant
    if rt.store is not None and tenant.config.budgets:
        result = await _reserve_shared(rt.store, tenant, cost)
        if isinstance(result, BudgetRefusal):
            return result
        ex.reservation = result
        return None
    return tenant.try_reserve(cost, rt.clock())


async def _reserve_level(rt: Runtime, level: LimitState, cost: float) -> Hold | BudgetRefusal:
    """Take ``cost`` from an application's budgets: the hold, or the refusal."""
    if rt.store is not None:
        try:
            result = await rt.store.reserve(level.owner, level.config.budgets, cost)
        except StateUnavailable:
            raise state_unavailable() from None
        if isinstance(result, BudgetRefusal):
            return result
        return Hold(level.budgets, 0.0, result, level)
    refusal = level.try_reserve(cost, rt.clock())
    return refusal if refusal is not None else Hold(level.budgets, cost, None, level)


def _undo(rt: Runtime, hold: Hold) -> None:
    """Give a hold back whole (the other level refused the request)."""
    if hold.reservation is not None:
        settle_in_store(rt, hold.reservation, 0.0)
    else:
        hold.settle_local(0.0, rt.clock())


async def _take_request(rt: Runtime, level: LimitState) -> Headroom | None:
    """Count the request against the ``max_requests`` of its tenant or its application
    (``level``), or refuse it (429); what the tightest of them has left.

    Checked after the refusals that need nothing (a full queue, a prompt too large by its
    bytes) and before the prompt count and the budgets: a request that gets this far
    counts, whether or not a later check refuses it, as OpenAI counts requests. Cost: a
    bucket update per limit in process; with ``state: redis`` one more script call (one
    round trip), only for tenants that have such limits.
    """
    if rt.store is not None:
        try:
            result = await rt.store.reserve(level.owner, level.config.max_requests, 1.0)
        except StateUnavailable:
            raise state_unavailable() from None
        if isinstance(result, BudgetRefusal):
            raise request_limit_error(result, level)
        return result.headroom()
    now = rt.clock()
    refusal = level.take_request(now)
    if refusal is not None:
        raise request_limit_error(refusal, level)
    return level.request_limits.headroom(now)


async def count_request(rt: Runtime, tenant: TenantState,
                        application: ApplicationState | None) -> None:
    """Count a request that is not a generation (the side routes: ``/tokenize`` and the
    like) against the ``max_requests`` of its application and its tenant, or refuse it
    (429), as ``admit`` counts a generation. Cost: ``_take_request`` per level with limits."""
    for level in (tenant,) if application is None else (application, tenant):
        if level.config.max_requests:
            await _take_request(rt, level)


def _needs_count(ex: Exchange, req: ParsedRequest) -> bool:
    """Whether a decision before dispatch depends on the prompt's size: a prompt cap, a
    budget reservation (the tenant's or its application's), or the ``max_tokens`` the
    gateway must fill in (it fits the context only with the prompt's size known)."""
    cfg = ex.tenant.config
    app = ex.application
    return cfg.max_input_tokens is not None or bool(cfg.budgets) or req.max_tokens is None \
        or (app is not None and bool(app.config.budgets))


MAX_BYTES_PER_TOKEN = 64
"""No tokenizer in use packs more text into one token on average (byte-level BPE vocabularies
have ~3-5 bytes per token on text; their longest tokens, runs of spaces or dashes, are
well below this): a prompt of more than 64 bytes per allowed token is certainly over the
limit, whatever the model, and is refused without asking the engine to count it."""


def _cheap_refusals(rt: Runtime, ex: Exchange, req: ParsedRequest) -> None:
    """Refusals that need no prompt count, checked before one is asked for.

    A tenant at its concurrency limit with a full queue; a prompt whose size in bytes
    proves it over ``max_input_tokens``; a budget that cannot take the request's lower-bound
    cost (the output part, ``max_tokens`` x n, plus the fewest tokens the prompt's bytes can
    make). A multi-megabyte prompt its limits refuse never reaches the engine's tokenizer,
    where it would delay every other tenant's requests.
    """
    tenant = ex.tenant
    cfg = tenant.config
    if tenant.at_concurrency_limit() and tenant.queue_full():
        raise queue_full(tenant)
    if cfg.max_output_tokens is not None and req.max_tokens is not None \
            and req.max_tokens > cfg.max_output_tokens:
        return  # refused with its own message by the size checks
    size = prompt_bytes(req)
    least_tokens = -(-size // MAX_BYTES_PER_TOKEN)
    if cfg.max_input_tokens is not None and least_tokens > cfg.max_input_tokens:
        raise GatewayError(
            400, f"the prompt has {size} bytes, at least {least_tokens} tokens; tenant "
            f"{tenant.id!r} may send at most {cfg.max_input_tokens} (max_input_tokens)",
            reason="max_input_tokens", code="max_input_tokens_exceeded",
            param=req.prompt_param)
    output = req.max_tokens if req.max_tokens is not None else cfg.max_output_tokens
    for level in reversed(_levels(ex)):  # the application's first, as in ``_reserve``
        if level.config.budgets:
            least = ex.cost.of(least_tokens, (output or 0) * req.sequences)
            refusal = level.budgets.would_refuse(least, rt.clock())
            if refusal is not None:
                raise budget_error(refusal, level if ex.application is not None else None)


def prompt_bytes(req: ParsedRequest) -> int:
    """A lower bound of the prompt text's UTF-8 size: the characters of the completion
    prompts, of the messages' text content (and a Messages ``system``), of a Responses
    ``instructions`` and its input's text (images and other parts are not text and are
    left out), of a pooling request's inputs (``wire.pooling_prompt_bytes``). One pass
    over the messages, nothing encoded."""
    body = req.body
    if req.kind in POOLING_KINDS:
        return pooling_prompt_bytes(req.kind, body)
    if req.kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return len(prompt)
        # A batch of strings (one pass in C), or of token ids (no text).
        return sum(map(len, prompt)) if isinstance(prompt, list) and set(
            map(type, prompt)) == {str} else 0
    if req.kind == "responses":
        size = _text_size(body.get("instructions"))
        items = body.get("input")
        if isinstance(items, str):
            return size + len(items)
        return size + sum(_text_size(item.get("content")) for item in items or ()
                          if isinstance(item, dict))
    size = _text_size(body.get("system")) if req.kind == "messages" else 0
    for message in body.get("messages") or ():
        if isinstance(message, dict):
            size += _text_size(message.get("content"))
    return size


def _text_size(content: object) -> int:
    """Characters of a content: a string, or the ``text`` of its parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part["text"]) for part in content
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0


async def _count_prompt(client: httpx.AsyncClient,
                        req: ParsedRequest) -> tuple[int, int, int | None]:
    """The prompts' tokens as the engine counts them (its own ``/tokenize``, or the
    Messages API's ``count_tokens``): all together, the longest, and the context size
    when the engine reports it. The prompts of a batch are counted concurrently."""
    answers = await asyncio.gather(*(_count_one(client, path, body)
                                     for path, body in count_calls(req)))
    counts = [count for count, _ in answers]
    return sum(counts), max(counts), answers[0][1]


async def _count_one(client: httpx.AsyncClient, path: str,
                     body: dict[str, object]) -> tuple[int, int | None]:
    try:
        resp = await client.post(path, json=body, timeout=30.0)
    except httpx.HTTPError as exc:
        raise GatewayError(502, f"cannot count prompt tokens: engine unreachable ({type(exc).__name__})",
                           reason="engine_unavailable", code="engine_unavailable") from None
    if resp.status_code != 200:
        message = _engine_message(resp)
        raise GatewayError(400 if resp.status_code < 500 else 502,
                           f"the engine refused the prompt: {message}",
                           reason="bad_request" if resp.status_code < 500 else "engine_error",
                           code="invalid_prompt")
    data = resp.json()
    count = data["input_tokens"] if "input_tokens" in data else data["count"]
    return int(count), data.get("max_model_len")


def _engine_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message"))
    return str(body.get("message") if isinstance(body, dict) and body.get("message") else resp.text[:300])


def _admit_sizes(tenant: TenantState, req: ParsedRequest, prompt_tokens: int,
                 max_model_len: int | None, longest: int) -> int:
    """Check the per-request caps; return the ``max_tokens`` to reserve and send.
    ``longest``: the longest prompt's tokens (the output's room is what it leaves)."""
    cfg = tenant.config
    if cfg.max_input_tokens is not None and prompt_tokens > cfg.max_input_tokens:
        raise GatewayError(
            400, f"the prompt has {prompt_tokens} tokens; tenant {tenant.id!r} may send at most "
            f"{cfg.max_input_tokens} (max_input_tokens)", reason="max_input_tokens",
            code="max_input_tokens_exceeded", param=req.prompt_param)
    if req.max_tokens is not None:
        if cfg.max_output_tokens is not None and req.max_tokens > cfg.max_output_tokens:
            raise GatewayError(
                400, f"{req.max_tokens_field} is {req.max_tokens}; tenant {tenant.id!r} may ask "
                f"for at most {cfg.max_output_tokens} (max_output_tokens)",
                reason="max_output_tokens", code="max_output_tokens_exceeded",
                param=req.max_tokens_field)
        return req.max_tokens
    room = None if max_model_len is None else max(1, max_model_len - longest)
    if cfg.max_output_tokens is not None:
        return min(cfg.max_output_tokens, room) if room is not None else cfg.max_output_tokens
    if room is not None:
        return room
    raise GatewayError(400, f"{req.max_tokens_field} is required for prompts given as token ids "
                       "when the tenant has no max_output_tokens", reason="bad_request",
                       code="invalid_value", param=req.max_tokens_field)


async def _reserve_shared(store: StateStore, tenant: TenantState,
                          cost: float) -> Reservation | BudgetRefusal:
    """Reserve in the shared store (one script, at most its timeout, ~100 ms)."""
    try:
        result = await store.reserve(tenant.id, tenant.config.budgets, cost)
    except StateUnavailable:
        # on_state_failure: closed: nothing is admitted that could overspend.
        raise state_unavailable() from None
    return result
