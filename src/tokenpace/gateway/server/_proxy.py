"""One proxied request (a completion, or a pooling request: embeddings and the like):
identity -> admission -> queue -> engine -> settlement.

``handle`` runs the stages in order; each lives in its own package: ``admission``
(identity, body, caps, budget reservation), ``dispatch``'s ``Lease`` (a slot on an engine
of the model's pool, waited for in the fair queue), ``engines`` (the rate's share on that
engine, the instructions written into the body), ``relay`` (the engine call and the relay
of its answer) and ``exchange`` (the one exit every request that got past authentication
ends in: slot, budget, metrics, ledger).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable

import asyncio
from dataclasses import dataclass

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope

from .. import metrics
from ..admission import (
    Admission,
    admit,
    identify,
    parse_body,
    queue_full,
    read_body,
    read_paced_body,
    retry_headers,
    route,
    state_unavailable,
)
from ..config import AdapterConfig
from ..dispatch import Lease, Pool, QueueFull
from ..engines import SplitFailed, engine_body, for_request, paces_end_users
from ..exchange import Exchange, Outcome, Runtime
from ..fleet import AdapterLoadFailed, EngineSlots, engine_retry_headers, ensure_loaded
from ..ledger import INTERRUPTED, UsageRecord
from ..relay import ClientWatch, NotReached, call, open_stream
from ..state import StateUnavailable
from ..tenants import ApplicationState, TenantState
from ..wire import (
    POOLING_KINDS,
    GatewayError,
    ROUTES,
    Kind,
    ParsedRequest,
    conversation_key,
    end_user_of,
)

logger = logging.getLogger("tokenpace.gateway")

TRIM_BODY_BYTES = 64 * 1024
"""A body larger than this goes to the engine without the top-level fields the engine does
not read (``fleet``'s request fields): it would parse them and drop them. Smaller bodies go
whole (the trim would cost more than it saves)."""

MAX_DISPATCHES = 3
"""How many engines a request is sent to at most when engines refuse its connection (the
first and two more), all within its ``request_timeout``, each wait for a slot within its
``queue_timeout``. A request an engine accepted is never sent again."""


@dataclass(frozen=True)
class BatchLine:
    """A request that is one line of a batch (``/v1/batches``), run by the batch runner
    for the batch's tenant: it runs in the batch lane at the batch cost, its ledger row
    names the batch, and ``on_slot`` is called once it holds an engine slot."""

    batch_id: str
    on_slot: Callable[[], None]


async def handle(rt: Runtime, kind: Kind, scope: Scope, receive: Receive,
                 principal: tuple[TenantState, ApplicationState | None] | None = None,
                 line: BatchLine | None = None) -> Response | Callable[..., Awaitable[None]]:
    """One completion request, given as its ASGI ``scope`` and ``receive`` channel; the
    returned ASGI response is the caller's to send. ``principal``: the tenant (and
    application) it comes from, already known (a batch line), instead of its API key."""
    request_id = "tpg-" + os.urandom(16).hex()  # 128 random bits; uuid4() costs 4x as much
    arrived = rt.clock()
    # Cost: one pass over the request's header list (uvicorn gives names in lower case).
    authorization = declared = None
    for name, value in scope["headers"]:
        if name == b"authorization" and authorization is None:
            authorization = value.decode("latin-1")
        elif name == b"content-length":
            declared = value.decode("latin-1")
        elif name == b"x-api-key" and authorization is None:
            # How the anthropic SDK sends its key; a Bearer header, if any, comes first.
            authorization = "Bearer " + value.decode("latin-1")
    try:
        tenant, application = identify(rt, authorization) if principal is None else principal
    except GatewayError as exc:
        return exc.response(request_id, kind)
    ex = Exchange(rt, request_id, kind, tenant, arrived, time.time(), application=application)
    if line is not None:
        ex.batch_id, ex.batch_lane = line.batch_id, rt.config.batch_lane
    watch: ClientWatch | None = None
    try:
        # A large body is parsed in a worker thread, one at a time per tenant.
        # A batch line's body was read from its file: only a client's is paced.
        raw = (await read_body(receive, declared, rt.config.max_body_bytes) if line is not None
               else await read_paced_body(tenant, receive, declared,
                                          rt.config.max_body_bytes, rt.clock))
        req = await parse_body(
            tenant.id, kind, raw,
            max_model_chars=rt.config.max_model_name_chars,
            max_prompts=rt.config.max_prompts_per_request)
        ex.model = req.model
        watch = ClientWatch(receive)
        model, pool, counting, adapter = route(rt, tenant, req.model)
        # An alias resolved: what the engine serves. An adapter's prompt is counted by its
        # base (the counting engine need not hold the adapter); it is sent as itself.
        req.model = model if adapter is None else adapter.base
        ex.model = model
        ex.routed = True
        ex.cost = (rt.config.cost_of(model) if line is None
                   else rt.config.batch_cost_of(model, tenant.config))
        app = application.config if application is not None else None
        end_user = end_user_of(req) if paces_end_users(tenant.config, app) else None
        admission = await admit(rt, ex, req, rt.clients[counting.url], counting.url)
        req.model = model
        admitted = rt.clock()
        # The conversation's key (only where it can decide an engine: a pool of several,
        # an unpaced tenant; see wire.conversation_key for its cost).
        affinity = (conversation_key(req, tenant.id)
                    if len(pool.engines) > 1 and rt.config.locality == "conversation"
                    and kind not in POOLING_KINDS
                    and rt.config.routing == "pool"
                    and tenant.config.output_tokens_per_second is None else None)
        ex.lease = await _wait_for_slot(ex, pool, admission, watch, affinity=affinity,
                                        adapter=adapter)
        if ex.lease is None:
            ex.charge_usage = False
            ex.finish(Outcome.CANCELLED)
            watch.stop()
            return Response(status_code=499)
        ex.queue_s = rt.clock() - admitted  # the wait for a slot, as the metric says
        if line is not None:
            line.on_slot()
        metrics.child(metrics.QUEUE_SECONDS, tenant.id).observe(ex.queue_s)
        lane = rt.config.lane(ex.lane)
        deadline = asyncio.get_running_loop().time() + rt.config.request_timeout_s
        dispatches = 1
        while True:
            engine = ex.lease.engine
            rate, version = await _rate_share(ex, pool, engine.url)
            body = engine_body(req, for_request(
                tenant.config, app, model=model, request_id=request_id,
                max_tokens=admission.max_tokens, rate=rate, rate_version=version,
                priority=lane.priority if engine.config.scheduling_policy == "priority" else 0,
                end_user=end_user),
                keep=_fields_read(engine, kind) if len(raw) > TRIM_BODY_BYTES else None)
            upstream = rt.upstreams.get(engine.url)
            _journal_open(ex, engine.url, admitted)
            try:
                if upstream is None:  # it left the configuration as the request went to it
                    raise NotReached()
                if adapter is not None and not await _load_adapter(ex, engine, adapter, watch):
                    ex.charge_usage = False  # nothing was sent
                    ex.finish(Outcome.CLIENT_DISCONNECTED)
                    watch.stop()
                    return Response(status_code=499)
                router = upstream.router_headers  # None: an engine without ``headers``
                headers = None if router is None else router.render(
                    tenant.id, app.id if app is not None else None, tenant.config.lane, model,
                    end_user if end_user is not None or not router.needs_end_user
                    else _named_end_user(req))
                if req.stream:
                    answer = await open_stream(ex, upstream, req, body, watch, deadline,
                                               headers)
                else:
                    answer = await call(ex, upstream, body, watch, deadline, headers)
            except NotReached as exc:
                _not_reached(ex, pool, engine, dispatches, exc)
                dispatches += 1
                ex.lease = await _wait_for_slot(ex, pool, admission, watch, again=True)
                if ex.lease is None:
                    ex.charge_usage = False
                    ex.finish(Outcome.CANCELLED)
                    watch.stop()
                    return Response(status_code=499)
                continue
            engine.connect_ok()
            return answer
    except GatewayError as exc:
        ex.charge_usage = False
        ex.finish(Outcome.REJECTED, exc.reason)
        if watch is not None:
            watch.stop()
        return exc.response(request_id, kind)
    except ClientDisconnect:
        # The client left while sending its body: nothing was asked of the engine.
        ex.charge_usage = False
        ex.finish(Outcome.CLIENT_DISCONNECTED)
        return Response(status_code=499)
    except Exception:
        # A bug, not a refusal: logged here once with the request id the client receives.
        logger.exception("request %s failed", request_id)
        ex.charge_usage = ex.lease is not None
        ex.finish(Outcome.ERROR)
        if watch is not None:
            watch.stop()
        return GatewayError(500, f"internal error in the gateway (request id {request_id})",
                            reason="error", code="internal_error").response(request_id, kind)
    except BaseException:
        ex.finish(Outcome.ERROR)
        if watch is not None:
            watch.stop()
        raise


async def _load_adapter(ex: Exchange, engine: EngineSlots, adapter: AdapterConfig,
                        watch: ClientWatch) -> bool:
    """Make ``engine`` hold ``adapter`` before the request goes there (the request holds
    its slot meanwhile; ``fleet.ensure_loaded`` bounds the wait); False: the client left
    meanwhile. A failed load is the engine's failure: 502, nothing charged."""
    held = adapter.name in engine.adapters.held and adapter.name not in engine.adapters.loading
    if not held:
        try:
            async with watch.guard() as guard:
                await ensure_loaded(engine, ex.rt.clients[engine.url], adapter.name,
                                    adapter.path)
            if guard.cancelled_caught:
                return False
        except AdapterLoadFailed as exc:
            logger.warning("request %s: %s", ex.id, exc)
            raise GatewayError(502, f"the engine could not load adapter {adapter.name!r}; "
                               "retry", reason="engine_error", code="adapter_load_failed",
                               headers={"retry-after": "1"}) from None
    metrics.ADAPTER_DISPATCHES.labels(adapter.name, "true" if held else "false").inc()
    return True


def _fields_read(engine: EngineSlots, kind: Kind) -> frozenset[str] | None:
    """The top-level fields ``engine`` reads on ``kind``'s route, for a large body; None
    while they are not known (asked for: the fleet's monitor reads them)."""
    engine.fields_wanted = True
    return engine.request_fields.get(ROUTES[kind])


def _journal_open(ex: Exchange, engine: str, admitted: float) -> None:
    """Journal the request before it is sent to ``engine``: the row it gets if this
    process dies before it ends (``ledger.Ledger.open``). Raises the 503 when the journal
    is full and ``on_ledger_full`` is ``refuse``. Cost per dispatch: building one record,
    one ``json.dumps`` and one ``os.write`` (a few microseconds): what makes a request in
    flight survive a SIGKILL of the gateway. ``admitted``: the clock when its budgets were
    reserved (the entry carries the reservation, for the budgets' recovery)."""
    rt = ex.rt
    prompt = ex.prompt_bound if ex.prompt_bound is not None else ex.prompt_tokens
    completion = ex.max_completion_tokens
    now = time.time()
    rec = UsageRecord(
        request_id=ex.id, tenant=ex.tenant.id, model=ex.model, lane=ex.lane,
        prompt_tokens=prompt, completion_tokens=completion,
        cost=ex.cost.of(prompt, completion) if ex.charge_usage else 0.0,
        queue_ms=None if ex.queue_s is None else ex.queue_s * 1000.0, ttft_ms=None,
        e2e_ms=(rt.clock() - ex.arrived) * 1000.0, finish_reason=INTERRUPTED,
        started_at=ex.started_at, ended_at=now, served=True, route=ROUTES[ex.kind],
        application=ex.application.id if ex.application is not None else "",
        batch_id=ex.batch_id, estimated=True)
    # The enforced reservations (the tenant's, its application's): [application id or
    # "", cost, in the shared store].
    holders = [["", ex.reservation.cost if ex.reservation is not None else ex.reserved,
                ex.reservation is not None]]
    holders += [[ex.application.id if ex.application is not None else "",
                 hold.reservation.cost if hold.reservation is not None else hold.reserved,
                 hold.reservation is not None]
                for hold in ex.holds if hold.level is not None and hold.level is not ex.tenant]
    if not rt.ledger.open(
            rec, engine=engine, kind=ex.kind,
            cost=[ex.cost.prompt, ex.cost.completion, ex.cost.cached_price],
            prompt_bound=ex.prompt_bound is not None, holders=holders,
            reserved_at=now - (rt.clock() - admitted)):
        raise GatewayError(
            503, "the gateway cannot record usage now (its ledger journal is full while the "
            "database is unreachable); retry later", reason="ledger_full", code="ledger_full",
            headers={"retry-after": "10"})


def _named_end_user(req: ParsedRequest) -> str | None:
    """The end user ``req`` names, for an engine's router headers (``{end_user}``) where
    the tenant does not pace end users: None when it names none or an unusable one (the
    header is then left out; a request is refused for it only where it would be paced)."""
    try:
        return end_user_of(req)
    except GatewayError:
        return None


async def _rate_share(ex: Exchange, pool: Pool, url: str) -> tuple[float | None, int | None]:
    """The rate (and its version) the request carries to engine ``url``: the tenant's
    rate, or with rates split over engines its share there, once the other engines'
    shares are lowered (``engines.RateSplitter``; a 503 when one cannot be)."""
    rt, tenant = ex.rt, ex.tenant
    rate = tenant.config.output_tokens_per_second
    if rate is None or rt.rate_split is None or rt.dispatcher.pinned(tenant) \
            or ex.kind in POOLING_KINDS:  # no output to pace: nothing to split
        return rate, None
    try:
        share = await rt.rate_split.start(tenant.id, rate, url)
    except SplitFailed:
        raise GatewayError(
            503, f"could not move tenant {tenant.id!r}'s rate between engines (an engine did "
            "not answer the rate-control call); retry", reason="rate_control_failed",
            code="rate_control_failed", headers={"retry-after": "1"}) from None
    except StateUnavailable:
        # Several replicas and the store does not answer: nobody can count the tenant's
        # streams. ``open`` keeps serving it on its first engine at R (as with one
        # replica); anywhere else its rate could add to shares other engines hold.
        if rt.config.state.on_failure != "open" \
                or rt.dispatcher.engine_for(tenant.id, pool).url != url:
            raise state_unavailable() from None
        return rate, None
    ex.split_on = url
    return share


def _not_reached(ex: Exchange, pool: Pool, engine: EngineSlots, dispatches: int,
                 why: NotReached) -> None:
    """The request's engine did not take it (a refused connection, a 503, an answer that
    it is shutting down, or a 404 for an adapter it does not hold: see
    ``relay.NotReached``): undo what was set up for that engine (its share of a split
    rate) and take it out of dispatch (``connect_failed``; a shutting-down engine is
    drained instead, ``set_stopping``; one without the adapter stays: the adapter is
    loaded next), or raise the 503 when the request may not
    go again: after ``MAX_DISPATCHES``, or with no engine of its pool up for its tenant."""
    rt, tenant = ex.rt, ex.tenant
    if ex.split_on is not None and rt.rate_split is not None:
        rt.rate_split.end(tenant.id, tenant.config.output_tokens_per_second, ex.split_on)
        ex.split_on = None
    if why.answered == 404:
        # A LoRA adapter the engine no longer holds (``relay.not_taken``): the engine is
        # fine; the adapter is loaded before the request goes again.
        engine.adapters.missing(ex.model)
        logger.info("engine %s did not hold adapter %r (request %s): loading it again",
                    engine.url, ex.model, ex.id)
    elif why.stopping:
        if rt.dispatcher.fleet.set_stopping(engine):
            logger.warning("engine %s is shutting down (request %s): drained until it is gone "
                           "and back", engine.url, ex.id)
    else:
        was_up = engine.healthy
        out = rt.dispatcher.fleet.connect_failed(engine)
        if was_up and out:
            logger.warning("engine %s %s (request %s): out of dispatch until its /health "
                           "answers", engine.url, "refused a connection"
                           if why.answered is None else f"answered {why.answered}", ex.id)
    if dispatches >= MAX_DISPATCHES or not rt.dispatcher.may_wait(tenant, pool):
        raise GatewayError(
            503, f"no engine serving model {pool.model!r} for tenant {tenant.id!r} could be "
            f"reached ({dispatches} tried); retry shortly", reason="engine_unavailable",
            code="engine_unavailable", headers=engine_retry_headers())


async def _wait_for_slot(ex: Exchange, pool: Pool, admission: Admission,
                         watch: ClientWatch, again: bool = False,
                         affinity: bytes | None = None,
                         adapter: AdapterConfig | None = None) -> Lease | None:
    """A granted slot on an engine of ``pool``, or None when the client left while waiting;
    a full queue or the queue timeout is a ``GatewayError``. ``again``: the request's
    engine refused it; the slot is given back and one on another engine waited for, first
    in the tenant's order (``Lease.again``)."""
    rt, tenant = ex.rt, ex.tenant
    if again:
        assert ex.lease is not None
        acquire = ex.lease.again
    else:
        acquire = rt.dispatcher.lease(
            tenant, pool, tenant.config.queue_timeout_s,
            prompt_cost=ex.cost.prompt * admission.prompt_tokens, estimate=admission.reserved,
            application=ex.application, affinity=affinity, adapter=adapter).acquire
    async with watch.guard():
        try:
            return await acquire()
        except QueueFull as exc:
            raise queue_full(tenant, exc.waiting) from None
        except StateUnavailable:  # shared slots, on_state_failure: closed
            raise state_unavailable() from None
        except TimeoutError:
            if not rt.dispatcher.may_wait(tenant, pool):
                raise GatewayError(
                    503, f"the engines serving model {pool.model!r} for tenant {tenant.id!r} "
                    "went down while the request waited", reason="engine_unavailable",
                    code="engine_unavailable", headers=engine_retry_headers()) from None
            wait = tenant.slot_wait_s()
            raise GatewayError(
                429, f"waited {tenant.config.queue_timeout_s:g} s in the queue without an "
                f"engine slot (queue_timeout); a slot frees in about {wait:.1f} s",
                reason="queue_timeout", code="queue_timeout",
                headers=retry_headers(wait)) from None
    return None
