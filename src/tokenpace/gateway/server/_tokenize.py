"""``POST /tokenize``, ``/detokenize`` and ``/v1/messages/count_tokens`` for tenants: how
clients count before they send.

Authenticated with the tenant's key (401 without one); the model, or an alias of it, is
routed as a completion's is (404 ``model_not_found`` for one the tenant may not use),
without ``model`` the tenant's only model (400 when it has several). The call goes to an
engine of that model's pool with the engine's key, the client's body otherwise as sent
(vLLM checks its fields), and the engine's answer comes back as it is. Nothing is
reserved or charged, and the engine's key never leaves the gateway.

A count costs the engine a tokenizer call, no model step, but vLLM's API server runs one
tokenizer call at a time for everyone, so each call is held inside its tenant's limits
before any of its body is read:

- the ``max_requests`` of the key's application and tenant (429, as a generation);
- one of the tenant's tokenize slots (``TOKENIZE_SLOTS_PER_TENANT``, shared with the
  prompt counts of its own generations): a call that finds them all taken is refused at
  once (429 ``tokenize_busy``, ``retry-after``), so a tenant has at most that many counts
  on the engines and that many bodies in the gateway's memory;
- a body of at most ``max_tokenize_bytes`` (413), and, for a tenant with
  ``max_input_tokens``, at most ``MAX_BYTES_PER_TOKEN`` bytes per allowed token (a larger
  body holds more tokens than the tenant may send in a prompt).

Cost per call in the gateway: a SHA-256 of the key, a bucket update per request limit,
the body read once and parsed once.
"""

from __future__ import annotations

import httpx
from starlette.requests import Request
from starlette.responses import Response

from .. import metrics
from ..admission import (
    MAX_BYTES_PER_TOKEN,
    authorization_of,
    count_request,
    identify,
    read_body,
    route,
    tenant_models,
)
from ..exchange import Runtime
from ..tenants import TOKENIZE_SLOTS_PER_TENANT, TenantState
from ..wire import GatewayError, check_model_name, parse_json_body

PATHS = ("/tokenize", "/detokenize", "/v1/messages/count_tokens")
TIMEOUT_S = 30.0
BODY_SLACK_BYTES = 4096
"""Bytes beyond ``max_input_tokens`` x ``MAX_BYTES_PER_TOKEN`` a counting body may have:
its JSON's keys and the model's name."""


def body_limit(max_tokenize_bytes: int, tenant: TenantState) -> int:
    """The largest counting body ``tenant`` may send: ``max_tokenize_bytes``, or less when
    its ``max_input_tokens`` proves a larger body over that cap whatever the tokenizer."""
    cap = tenant.config.max_input_tokens
    if cap is None:
        return max_tokenize_bytes
    return min(max_tokenize_bytes, cap * MAX_BYTES_PER_TOKEN + BODY_SLACK_BYTES)


def _busy(tenant: TenantState) -> GatewayError:
    return GatewayError(
        429, f"tenant {tenant.id!r} has {TOKENIZE_SLOTS_PER_TENANT} token counts running "
        "(its tokenize slots, shared with its requests' prompt counts); retry when one ends",
        reason="tokenize_busy", code="tokenize_busy", headers={"retry-after": "1"})


async def handle_tokenize(rt: Runtime, request: Request) -> Response:
    """Forward one counting call of a tenant to an engine (errors of the Messages API's
    ``count_tokens`` in Anthropic's format)."""
    kind = "messages" if request.url.path.startswith("/v1/messages") else None
    tenant: TenantState | None = None
    try:
        tenant, application = identify(rt, authorization_of(request.headers))
        await count_request(rt, tenant, application)
        if tenant.tokenize_slots.locked():
            raise _busy(tenant)
        async with tenant.tokenize_slots:
            resp = await _forward(rt, request, tenant)
    except GatewayError as exc:
        if tenant is not None:
            metrics.child(metrics.REJECTIONS, tenant.id, exc.reason).inc()
        return exc.response(kind=kind)
    return Response(resp.content, status_code=resp.status_code,
                    media_type=resp.headers.get("content-type", "application/json"))


async def _forward(rt: Runtime, request: Request, tenant: TenantState) -> httpx.Response:
    """Read, route and send the call (holding one of the tenant's tokenize slots)."""
    limit = body_limit(rt.config.max_tokenize_bytes, tenant)
    try:
        raw = await read_body(request.receive, request.headers.get("content-length"), limit)
    except GatewayError as exc:
        if exc.status != 413:
            raise
        keys = ("max_tokenize_bytes" if limit == rt.config.max_tokenize_bytes
                else "the tenant's max_input_tokens x 64")
        raise GatewayError(413, f"a {request.url.path} body may have at most {limit} bytes "
                           f"({keys})", reason="body_too_large", code="body_too_large") from None
    body = parse_json_body(raw)
    requested = body.get("model")
    if requested is None:
        models = [m for m in tenant_models(rt, tenant) if rt.config.served_name(m) == m]
        if len(models) != 1:
            raise GatewayError(400, f"'model' is required: tenant {tenant.id!r} may use "
                               f"{', '.join(models) or 'no model'}", reason="bad_request",
                               code="invalid_value", param="model")
        requested = models[0]
    if not isinstance(requested, str):
        raise GatewayError(400, "'model' must be a string", reason="bad_request",
                           code="invalid_value", param="model")
    check_model_name(requested, rt.config.max_model_name_chars)
    model, _, engine, adapter = route(rt, tenant, requested)
    body["model"] = model if adapter is None else adapter.base  # its base's tokenizer
    try:
        return await rt.clients[engine.url].post(request.url.path, json=body,
                                                 timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise GatewayError(502, f"the engine did not answer: {type(exc).__name__}",
                           reason="engine_error", code="engine_error") from None
