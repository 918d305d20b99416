"""``POST /tokenize``, ``/detokenize`` and ``/v1/messages/count_tokens`` for tenants: how
clients count before they send.

Authenticated with the tenant's key (401 without one); the model, or an alias of it, is
routed as a completion's is (404 ``model_not_found`` for one the tenant may not use),
without ``model`` the tenant's only model (400 when it has several). The call goes to an
engine of that model's pool with the engine's key, the client's body otherwise as sent
(vLLM checks its fields), and the engine's answer comes back as it is. Nothing is
reserved, queued or charged: a count costs the engine a tokenizer call, no model step,
and the engine's key never leaves the gateway.
"""

from __future__ import annotations

import httpx
from starlette.requests import Request
from starlette.responses import Response

from ..admission import authenticate, authorization_of, read_body, route, tenant_models
from ..exchange import Runtime
from ..wire import GatewayError, parse_json_body

PATHS = ("/tokenize", "/detokenize", "/v1/messages/count_tokens")
TIMEOUT_S = 30.0


async def handle_tokenize(rt: Runtime, request: Request) -> Response:
    """Forward one counting call of a tenant to an engine (errors of the Messages API's
    ``count_tokens`` in Anthropic's format)."""
    kind = "messages" if request.url.path.startswith("/v1/messages") else None
    try:
        tenant = authenticate(rt, authorization_of(request.headers))
        body = parse_json_body(await read_body(request.receive,
                                               request.headers.get("content-length"),
                                               rt.config.max_body_bytes))
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
        model, _, engine = route(rt, tenant, requested)
        body["model"] = model
        try:
            resp = await rt.clients[engine.url].post(request.url.path, json=body,
                                                     timeout=TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise GatewayError(502, f"the engine did not answer: {type(exc).__name__}",
                               reason="engine_error", code="engine_error") from None
    except GatewayError as exc:
        return exc.response(kind=kind)
    return Response(resp.content, status_code=resp.status_code,
                    media_type=resp.headers.get("content-type", "application/json"))
