"""One proxied completion: identity -> admission -> queue -> engine -> settlement.

Every request that got past authentication ends in exactly one call of
``Exchange.finish``: it gives the engine slot back, settles the budget reservation to the
cost actually incurred, counts the outcome in the metrics and writes one ledger row. That
single exit is what makes "nothing leaked" checkable whatever went wrong (client gone,
engine gone, timeout, refusal).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio
import httpx
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..fairness import BudgetRefusal
from . import _metrics as metrics
from ._body import (
    Kind,
    ParsedRequest,
    engine_body,
    parse_json_body,
    parse_request,
    prompt_token_ids,
    tokenize_body,
)
from ._config import GatewayConfig
from ._dispatch import Dispatcher, EngineSlots, QueueFull, Waiter
from ._errors import GatewayError, error_body, error_response
from ._ledger import Ledger, UsageRecord
from ._state import Reservation, StateStore, StateUnavailable
from ._stream import ChunkRewriter, EventSplitter
from ._tenants import TenantState, Tenants
from ._upstream import Upstream, UpstreamError

logger = logging.getLogger("tokenpace.gateway")

PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@dataclass
class Runtime:
    """What every request handler shares; replaced piecemeal by a reload."""

    config: GatewayConfig
    tenants: Tenants
    dispatcher: Dispatcher
    clients: dict[str, httpx.AsyncClient]  # background calls: /tokenize, /health, gauges
    ledger: Ledger
    upstreams: dict[str, Upstream] = field(default_factory=dict)  # the hot path: completions
    clock: Callable[[], float] = time.monotonic
    # Budgets shared with other replicas (state: redis://...); None: in this process.
    store: StateStore | None = None
    # Settlements sent to the store in the background (finish is synchronous).
    settling: set[asyncio.Task[None]] = field(default_factory=set)


class ClientWatch:
    """Notices the client going away while the gateway waits on something else.

    After the body is read the only message the server can still deliver is
    ``http.disconnect``, so one task waits for it and cancels whatever is registered.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.gone = False
        self._scopes: list[anyio.CancelScope] = []
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                for scope in self._scopes:
                    scope.cancel()
                return

    def guard(self, scope: anyio.CancelScope) -> anyio.CancelScope:
        if self.gone:
            scope.cancel()
        self._scopes.append(scope)
        return scope

    def stop(self) -> None:
        self._task.cancel()


@dataclass
class Exchange:
    """The book-keeping of one request, from arrival to its ledger row."""

    rt: Runtime
    id: str
    kind: Kind
    tenant: TenantState
    arrived: float
    started_at: float
    model: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reserved: float = 0.0
    reservation: Reservation | None = None  # taken in the shared store (state: redis://)
    max_completion_tokens: int = 0
    charged_tokens: int = 0  # completion tokens already charged to the fair queue
    charge_usage: bool = True
    prompt_counted: bool = False  # the prompt's cost is in the fair queue's counter
    queue_s: float | None = None
    ttft_s: float | None = None
    waiter: Waiter | None = None
    finished: bool = field(default=False)

    @property
    def lane(self) -> str:
        return self.tenant.config.lane

    def charge_progress(self) -> None:
        """Grow the tenant's fair-queue counter by the tokens generated since last time
        (and by the prompt, once the engine's usage gave its size if it was not counted)."""
        if self.waiter is None or not self.charge_usage:
            return
        cost = 0.0
        if not self.prompt_counted and self.prompt_tokens:
            cost += self.prompt_tokens * self.rt.config.cost.prompt
            self.prompt_counted = True
        delta = self.completion_tokens - self.charged_tokens
        if delta > 0:
            cost += delta * self.rt.config.cost.completion
            self.charged_tokens = self.completion_tokens
        if cost:
            self.rt.dispatcher.charge(self.waiter, cost)

    def finish(self, outcome: str) -> None:
        if self.finished:
            return
        self.finished = True
        rt = self.rt
        if self.waiter is not None:
            self.charge_progress()
            rt.dispatcher.release(self.waiter)
        actual = (rt.config.cost.of(self.prompt_tokens, self.completion_tokens)
                  if self.charge_usage else 0.0)
        if self.reservation is not None:
            # One script, off the request's path; a failure leaves the reservation charged.
            task = asyncio.get_running_loop().create_task(
                rt.store.settle(self.reservation, actual))  # type: ignore[union-attr]
            rt.settling.add(task)
            task.add_done_callback(rt.settling.discard)
        elif self.reserved:
            self.tenant.settle(self.reserved, actual, rt.clock())
        e2e = rt.clock() - self.arrived
        if self.waiter is not None and self.waiter.granted:
            self.tenant.record_service(e2e - (self.queue_s or 0.0))
        tenant, lane = self.tenant.id, self.lane
        metrics.child(metrics.REQUESTS, tenant, lane, outcome.split(":", 1)[0]).inc()
        if outcome.startswith("rejected:"):
            metrics.child(metrics.REJECTIONS, tenant, outcome.split(":", 1)[1]).inc()
        if self.charge_usage and self.waiter is not None:
            metrics.child(metrics.PROMPT_TOKENS, tenant, lane).inc(self.prompt_tokens)
            metrics.child(metrics.COMPLETION_TOKENS, tenant, lane).inc(self.completion_tokens)
            metrics.child(metrics.SERVICE, tenant, lane).inc(actual)
            metrics.child(metrics.E2E_SECONDS, tenant).observe(e2e)
        if self.ttft_s is not None:
            metrics.child(metrics.TTFT_SECONDS, tenant).observe(self.ttft_s)
        rt.ledger.record(UsageRecord(
            request_id=self.id, tenant=tenant, model=self.model, lane=lane,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens if self.charge_usage else 0,
            cost=actual,
            queue_ms=None if self.queue_s is None else self.queue_s * 1000.0,
            ttft_ms=None if self.ttft_s is None else self.ttft_s * 1000.0,
            e2e_ms=e2e * 1000.0, finish_reason=outcome,
            started_at=self.started_at, ended_at=time.time(),
            served=self.charge_usage and self.waiter is not None,
        ))


def bearer_key(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    scheme, _, key = value.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def authenticate(rt: Runtime, request: Request) -> TenantState:
    key = bearer_key(request)
    tenant = rt.config.tenant_for_key(key) if key else None
    state = rt.tenants.get(tenant.id) if tenant else None
    if state is None:
        metrics.child(metrics.REJECTIONS, "", "unauthenticated").inc()
        raise GatewayError(
            401,
            "Missing API key: send 'Authorization: Bearer <key>'" if not key
            else "Incorrect API key provided",
            reason="unauthenticated", code="invalid_api_key")
    return state


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"request body larger than {limit} bytes", reason="body_too_large",
                           code="body_too_large")
    chunks = []
    size = 0
    async for chunk in request.stream():  # raises ClientDisconnect if the client leaves
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"request body larger than {limit} bytes",
                               reason="body_too_large", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def handle(rt: Runtime, kind: Kind, request: Request) -> Response | Callable[..., Awaitable[None]]:
    request_id = f"tpg-{uuid.uuid4().hex}"
    arrived = rt.clock()
    try:
        tenant = authenticate(rt, request)
    except GatewayError as exc:
        return exc.response(request_id)
    ex = Exchange(rt, request_id, kind, tenant, arrived, time.time())
    watch: ClientWatch | None = None
    try:
        raw = await read_body(request, rt.config.max_body_bytes)
        req = parse_request(kind, parse_json_body(raw))
        ex.model = req.model
        watch = ClientWatch(request.receive)
        engine = rt.dispatcher.engine_for(tenant.id)
        if not engine.healthy:
            raise GatewayError(503, f"the engine serving tenant {tenant.id!r} is unavailable",
                               reason="engine_unavailable", code="engine_unavailable")
        client, upstream = rt.clients[engine.url], rt.upstreams[engine.url]
        _cheap_refusals(rt, tenant, req)
        if _needs_count(tenant, req):
            async with tenant.tokenize_slots:
                prompt_tokens, max_model_len = await _count_prompt(client, req)
            ex.prompt_counted = True
        else:
            # No decision depends on the prompt's size: it is counted by the engine, and
            # the engine's first usage chunk (or its answer) brings the exact number.
            ids = prompt_token_ids(req)
            prompt_tokens, max_model_len = (0 if ids is None else len(ids)), None
            ex.prompt_counted = ids is not None
        ex.prompt_tokens = prompt_tokens
        max_tokens = _admit_sizes(tenant, req, prompt_tokens, max_model_len)
        reserved = rt.config.cost.of(prompt_tokens, max_tokens * req.n)
        if rt.store is not None and tenant.config.budgets:
            ex.reservation = await _reserve_shared(rt.store, tenant, reserved)
        else:
            refusal = tenant.try_reserve(reserved, rt.clock())
            if refusal is not None:
                raise _budget_error(refusal)
        ex.reserved = reserved
        ex.max_completion_tokens = max_tokens * req.n
        admitted = rt.clock()
        with watch.guard(anyio.CancelScope()):
            try:
                ex.waiter = await rt.dispatcher.acquire(
                    tenant, engine, tenant.config.queue_timeout_s,
                    prompt_cost=rt.config.cost.prompt * prompt_tokens, estimate=reserved)
            except QueueFull:
                raise _queue_full(tenant) from None
            except TimeoutError:
                if not engine.healthy:
                    raise GatewayError(
                        503, f"the engine serving tenant {tenant.id!r} went down while the "
                        "request waited", reason="engine_unavailable",
                        code="engine_unavailable") from None
                wait = tenant.slot_wait_s()
                raise GatewayError(
                    429, f"waited {tenant.config.queue_timeout_s:g} s in the queue without an "
                    f"engine slot (queue_timeout); a slot frees in about {wait:.1f} s",
                    reason="queue_timeout", code="queue_timeout",
                    headers=_retry_headers(wait)) from None
        if ex.waiter is None:
            ex.charge_usage = False
            ex.finish("cancelled")
            watch.stop()
            return Response(status_code=499)
        ex.queue_s = rt.clock() - admitted  # the wait for a slot, as the metric says
        metrics.child(metrics.QUEUE_SECONDS, tenant.id).observe(ex.queue_s)
        lane = rt.config.lane(tenant.config.lane)
        body = engine_body(
            req, user=tenant.id, rate=tenant.config.output_tokens_per_second,
            priority=lane.priority if engine.config.scheduling_policy == "priority" else 0,
            max_tokens=max_tokens, cache_salt=tenant.config.cache_salt)
        deadline = anyio.current_time() + rt.config.request_timeout_s
        if req.stream:
            return await _open_stream(ex, upstream, req, body, watch, deadline)
        return await _call(ex, upstream, body, watch, deadline)
    except GatewayError as exc:
        ex.charge_usage = False
        ex.finish(f"rejected:{exc.reason}")
        if watch is not None:
            watch.stop()
        return exc.response(request_id)
    except ClientDisconnect:
        # The client left while sending its body: nothing was asked of the engine.
        ex.charge_usage = False
        ex.finish("client_disconnected")
        return Response(status_code=499)
    except Exception:
        # A bug, not a refusal: logged here once with the request id the client receives.
        logger.exception("request %s failed", request_id)
        ex.charge_usage = ex.waiter is not None
        ex.finish("error")
        if watch is not None:
            watch.stop()
        return error_response(500, f"internal error in the gateway (request id {request_id})",
                              code="internal_error", headers={"x-request-id": request_id})
    except BaseException:
        ex.finish("error")
        if watch is not None:
            watch.stop()
        raise


def _needs_count(tenant: TenantState, req: ParsedRequest) -> bool:
    """Whether a decision before dispatch depends on the prompt's size: a prompt cap, a
    budget reservation, or the ``max_tokens`` the gateway must fill in (it fits the
    context only with the prompt's size known)."""
    cfg = tenant.config
    return cfg.max_input_tokens is not None or bool(cfg.budgets) or req.max_tokens is None


MAX_BYTES_PER_TOKEN = 64
"""No tokenizer in use packs more text into one token on average (byte-level BPE vocabularies
have ~3-5 bytes per token on text; their longest tokens, runs of spaces or dashes, are
well below this): a prompt of more than 64 bytes per allowed token is certainly over the
limit, whatever the model, and is refused without asking the engine to count it."""


def _cheap_refusals(rt: Runtime, tenant: TenantState, req: ParsedRequest) -> None:
    """Refusals that need no prompt count, checked before one is asked for.

    A tenant at its concurrency limit with a full queue; a prompt whose size in bytes
    proves it over ``max_input_tokens``; a budget that cannot take the request's lower-bound
    cost (the output part, ``max_tokens`` x n, plus the fewest tokens the prompt's bytes can
    make). A multi-megabyte prompt its limits refuse never reaches the engine's tokenizer,
    where it would delay every other tenant's requests.
    """
    cfg = tenant.config
    if tenant.at_concurrency_limit() and tenant.queue_full():
        raise _queue_full(tenant)
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
            param="messages" if req.kind == "chat" else "prompt")
    output = req.max_tokens if req.max_tokens is not None else cfg.max_output_tokens
    if cfg.budgets:
        least = rt.config.cost.of(least_tokens, (output or 0) * req.n)
        refusal = tenant.budgets.would_refuse(least, rt.clock())
        if refusal is not None:
            raise _budget_error(refusal)


def prompt_bytes(req: ParsedRequest) -> int:
    """A lower bound of the prompt text's UTF-8 size: the characters of the completion
    prompt, or of the messages' text content (images and other parts are not text and
    are left out). One pass over the messages, nothing encoded."""
    if req.kind != "chat":
        prompt = req.body.get("prompt")
        if isinstance(prompt, str):
            return len(prompt)
        return sum(len(p) for p in prompt if isinstance(p, str)) if isinstance(prompt, list) else 0
    size = 0
    for message in req.body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            size += sum(len(part["text"]) for part in content
                        if isinstance(part, dict) and isinstance(part.get("text"), str))
    return size


def _queue_full(tenant: TenantState) -> GatewayError:
    cfg = tenant.config
    wait = tenant.slot_wait_s()
    return GatewayError(
        429, f"tenant {tenant.id!r} has {tenant.inflight} requests running "
        f"(max_concurrency {cfg.max_concurrency}) and {tenant.queued} waiting "
        f"(max_queued {cfg.max_queued}); a slot frees in about {wait:.1f} s",
        reason="queue_full", code="queue_full", headers=_retry_headers(wait))


def _retry_headers(wait_s: float) -> dict[str, str]:
    return {"retry-after": str(max(1, math.ceil(wait_s))),
            "retry-after-ms": str(max(1, math.ceil(wait_s * 1000)))}


async def _count_prompt(client: httpx.AsyncClient, req: ParsedRequest) -> tuple[int, int | None]:
    """Prompt tokens as the engine counts them (its own ``/tokenize``), and its context size."""
    ids = prompt_token_ids(req)
    if ids is not None:
        return len(ids), None
    try:
        resp = await client.post("/tokenize", json=tokenize_body(req), timeout=30.0)
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
    return int(data["count"]), data.get("max_model_len")


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
                 max_model_len: int | None) -> int:
    """Check the per-request caps; return the ``max_tokens`` to reserve and send."""
    cfg = tenant.config
    if cfg.max_input_tokens is not None and prompt_tokens > cfg.max_input_tokens:
        raise GatewayError(
            400, f"the prompt has {prompt_tokens} tokens; tenant {tenant.id!r} may send at most "
            f"{cfg.max_input_tokens} (max_input_tokens)", reason="max_input_tokens",
            code="max_input_tokens_exceeded", param="messages" if req.kind == "chat" else "prompt")
    if req.max_tokens is not None:
        if cfg.max_output_tokens is not None and req.max_tokens > cfg.max_output_tokens:
            raise GatewayError(
                400, f"{req.max_tokens_field} is {req.max_tokens}; tenant {tenant.id!r} may ask "
                f"for at most {cfg.max_output_tokens} (max_output_tokens)",
                reason="max_output_tokens", code="max_output_tokens_exceeded",
                param=req.max_tokens_field)
        return req.max_tokens
    room = None if max_model_len is None else max(1, max_model_len - prompt_tokens)
    if cfg.max_output_tokens is not None:
        return min(cfg.max_output_tokens, room) if room is not None else cfg.max_output_tokens
    if room is not None:
        return room
    raise GatewayError(400, f"{req.max_tokens_field} is required for prompts given as token ids "
                       "when the tenant has no max_output_tokens", reason="bad_request",
                       code="invalid_value", param=req.max_tokens_field)


async def _reserve_shared(store: StateStore, tenant: TenantState, cost: float) -> Reservation:
    """Reserve in the shared store (one script, at most its timeout, ~100 ms)."""
    try:
        result = await store.reserve(tenant.id, tenant.config.budgets, cost)
    except StateUnavailable:
        # on_state_failure: closed: nothing is admitted that could overspend.
        raise GatewayError(503, "the gateway's state store does not answer; retry shortly",
                           reason="state_unavailable", code="state_unavailable",
                           headers={"retry-after": "1"}) from None
    if isinstance(result, BudgetRefusal):
        raise _budget_error(result)
    return result


def _budget_error(refusal: BudgetRefusal) -> GatewayError:
    budget = refusal.budget
    if math.isinf(refusal.retry_after_s):
        return GatewayError(
            400, f"this request reserves {refusal.cost:g} tokens of cost, more than the whole "
            f"budget {budget.key}; lower max_tokens or shorten the prompt",
            reason="larger_than_budget", code="budget_too_small", param="max_tokens")
    return GatewayError(
        429, f"token budget {budget.key} exhausted: this request needs {refusal.cost:g}, "
        f"{math.floor(refusal.remaining)} remain; retry in {refusal.retry_after_s:.3f} s",
        reason="budget", code="rate_limit_exceeded",
        headers={
            "retry-after": str(max(1, math.ceil(refusal.retry_after_s))),
            "retry-after-ms": str(max(1, math.ceil(refusal.retry_after_s * 1000))),
            "x-ratelimit-limit-tokens": str(int(budget.tokens)),
            "x-ratelimit-remaining-tokens": str(math.floor(refusal.remaining)),
            "x-ratelimit-reset-tokens": _go_duration(refusal.reset_s),
        })


def _go_duration(seconds: float) -> str:
    """OpenAI's reset format: ``1.5s``, ``6m0s``, ``20ms``."""
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


def _upstream_headers(ex: Exchange) -> dict[str, str]:
    return {"content-type": "application/json", "x-request-id": ex.id}


async def _call(ex: Exchange, upstream: Upstream, body: bytes, watch: ClientWatch,
                deadline: float) -> Response:
    """A non-streaming request: the engine's answer is passed on as it is."""
    outcome = "cancelled"
    resp = None
    try:
        with watch.guard(anyio.CancelScope(deadline=deadline)) as scope:
            try:
                resp = await upstream.post(PATHS[ex.kind], body, _upstream_headers(ex))
                content = await resp.read()
            except UpstreamError as exc:
                ex.charge_usage = False
                outcome = "upstream_error"
                raise GatewayError(502, f"engine failed: {type(exc).__name__}",
                                   reason="engine_error", code="engine_error") from None
        if scope.cancelled_caught:
            # A non-streaming answer never arrived, so the engine's count is unknown: the
            # reservation (max_tokens) stands as the charge.
            ex.completion_tokens = ex.max_completion_tokens
            if watch.gone:
                return Response(status_code=499)
            outcome = "timeout"
            return _timeout_response(ex)
        assert resp is not None
        if resp.status != 200:
            ex.charge_usage = False
            outcome = "upstream_error"
            return Response(content, status_code=resp.status,
                            media_type=resp.headers.get("content-type"),
                            headers={"x-request-id": ex.id})
        try:
            data = json.loads(content)
            usage = data.get("usage") or {}
            ex.completion_tokens = int(usage.get("completion_tokens") or 0)
            ex.prompt_tokens = int(usage.get("prompt_tokens") or ex.prompt_tokens)
            reasons = [c.get("finish_reason") for c in data.get("choices") or [] if isinstance(c, dict)]
            outcome = next((r for r in reasons if r), "stop")
        except (ValueError, AttributeError, TypeError):
            outcome = "upstream_error"
        return Response(content, status_code=200, media_type="application/json",
                        headers={"x-request-id": ex.id})
    finally:
        if resp is not None:
            if outcome in ("cancelled", "timeout"):
                resp.close()  # the engine sees the connection go and aborts the request
            else:
                resp.release()
        ex.finish(outcome)
        watch.stop()


def _timeout_response(ex: Exchange) -> Response:
    return Response(
        json.dumps(error_body(504, f"the request did not finish within request_timeout "
                              f"({ex.rt.config.request_timeout_s:g} s)", "timeout")),
        status_code=504, media_type="application/json", headers={"x-request-id": ex.id})


async def _open_stream(ex: Exchange, upstream: Upstream, req: ParsedRequest, body: bytes,
                       watch: ClientWatch, deadline: float) -> Response | "StreamResponse":
    """Start the engine stream; its status decides between a pass-through error and SSE."""
    outcome = "cancelled"
    resp: aiohttp.ClientResponse | None = None
    try:
        with watch.guard(anyio.CancelScope(deadline=deadline)) as scope:
            try:
                resp = await upstream.post(PATHS[ex.kind], body, _upstream_headers(ex))
            except UpstreamError as exc:
                ex.charge_usage = False
                outcome = "upstream_error"
                raise GatewayError(502, f"engine failed: {type(exc).__name__}",
                                   reason="engine_error", code="engine_error") from None
            if resp.status != 200:
                try:
                    content = await resp.read()
                except UpstreamError:
                    content = b""
                resp.release()
                ex.charge_usage = False
                outcome = "upstream_error"
                ex.finish(outcome)
                watch.stop()
                return Response(content, status_code=resp.status,
                                media_type=resp.headers.get("content-type"),
                                headers={"x-request-id": ex.id})
        if scope.cancelled_caught:
            if resp is not None:
                resp.close()  # closing the connection makes the engine abort the request
            ex.charge_usage = False
            outcome = "cancelled" if watch.gone else "timeout"
            ex.finish(outcome)
            watch.stop()
            return Response(status_code=499) if watch.gone else _timeout_response(ex)
        assert resp is not None
        return StreamResponse(ex, resp, req, watch, deadline)
    except BaseException:
        if resp is not None:
            resp.close()
        ex.finish(outcome)
        watch.stop()
        raise


class StreamResponse:
    """ASGI response relaying the engine's SSE stream; settles the exchange however it ends."""

    def __init__(self, ex: Exchange, upstream: aiohttp.ClientResponse, req: ParsedRequest,
                 watch: ClientWatch, deadline: float) -> None:
        self.ex = ex
        self.upstream = upstream
        self.rewriter = ChunkRewriter(req.client_wants_usage, req.client_wants_continuous_usage)
        self.watch = watch
        self.deadline = deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex, progress = self.ex, self.rewriter.progress
        outcome = "cancelled"
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-request-id", ex.id.encode()),
            ]})
            with self.watch.guard(anyio.CancelScope(deadline=self.deadline)) as cancel:
                failure = await self._relay(send)
            if cancel.cancelled_caught:
                outcome = "cancelled" if self.watch.gone else "timeout"
                if outcome == "timeout":
                    await self._send_error(send, 504, "the request did not finish within "
                                           "request_timeout", "timeout")
            elif failure is not None or progress.error is not None or not progress.done:
                outcome = "upstream_error"
                if failure is not None or not progress.done and progress.error is None:
                    await self._send_error(send, 502, failure or "the engine stream ended early",
                                           "engine_error")
            else:
                outcome = progress.finish_reason or "stop"
            if not self.watch.gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            outcome = "cancelled"  # the client socket broke while we wrote to it
        finally:
            if progress.done:
                self.upstream.release()
            else:
                self.upstream.close()  # the engine sees the connection go and aborts
            ex.completion_tokens = progress.completion_tokens
            if progress.prompt_tokens is not None:
                ex.prompt_tokens = progress.prompt_tokens
            ex.finish(outcome)
            self.watch.stop()

    async def _relay(self, send: Send) -> str | None:
        """Copy events until the engine ends the stream; return a failure description.

        The events of one network read go out in one ``send``: one write per read, not
        per event.
        """
        ex, rewriter = self.ex, self.rewriter
        progress = rewriter.progress
        splitter = EventSplitter()
        try:
            async for data in self.upstream.content.iter_any():
                out = []
                for payload in splitter.feed(data):
                    event = rewriter.event(payload)
                    if event is not None:
                        out.append(b"data: " + event + b"\n\n")
                if progress.first_token and ex.ttft_s is None:
                    ex.ttft_s = ex.rt.clock() - ex.arrived
                if progress.prompt_tokens is not None and not ex.prompt_counted:
                    ex.prompt_tokens = progress.prompt_tokens
                if progress.completion_tokens > ex.completion_tokens or not ex.prompt_counted:
                    ex.completion_tokens = progress.completion_tokens
                    ex.charge_progress()
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out),
                                "more_body": True})
                if progress.done:
                    return None
            for payload in splitter.flush():
                event = rewriter.event(payload)
                if event is not None:
                    await send({"type": "http.response.body", "body": b"data: " + event + b"\n\n",
                                "more_body": True})
        except UpstreamError as exc:
            return f"the engine stream failed: {type(exc).__name__}"
        return None

    async def _send_error(self, send: Send, status: int, message: str, code: str) -> None:
        event = b"data: " + json.dumps(error_body(status, message, code)).encode() + b"\n\n"
        with anyio.move_on_after(1.0, shield=True):
            await send({"type": "http.response.body", "body": event, "more_body": True})
