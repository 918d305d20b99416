"""Who is asking, and for what: the API key's tenant (and application), and the model's pool.

Decided from the configuration in memory (and the admin API's keys, also in memory), without
an engine or database call: a SHA-256 of the key and a few dict lookups per request.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from .. import metrics
from ..config import AdapterConfig, hash_key
from ..dispatch import Pool
from ..exchange import Runtime
from ..fleet import EngineSlots, engine_retry_headers
from ..tenants import ApplicationState, TenantState
from ..wire import GatewayError, clip


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value, else None."""
    scheme, _, key = (authorization or "").partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def authorization_of(headers: Mapping[str, str]) -> str | None:
    """The request's ``Authorization`` value, or one made of its ``x-api-key`` header (how
    the anthropic SDK sends its key)."""
    value = headers.get("authorization")
    if value is None and (key := headers.get("x-api-key")) is not None:
        return f"Bearer {key}"
    return value


def authenticate(rt: Runtime, authorization: str | None) -> TenantState:
    """The tenant of the request's ``Authorization`` header value, or a 401."""
    return identify(rt, authorization)[0]


def identify(rt: Runtime, authorization: str | None,
             ) -> tuple[TenantState, ApplicationState | None]:
    """The tenant, and the application when the key is an application's, of the
    request's ``Authorization`` header value, or a 401. Per request: a SHA-256 of the key
    and two or three dict lookups; a key not in the file (one made through the admin API)
    adds a clock read and ``registry.KeyTable.identity``'s few lookups."""
    key = bearer_key(authorization)
    identity = None
    if key:
        digest = hash_key(key)
        identity = rt.config.identity_for_digest(digest)
        if identity is None and rt.keys is not None:
            identity = rt.keys.identity(digest, rt.config, time.time())
    state = rt.tenants.get(identity[0].id) if identity else None
    application = None
    if state is not None and identity is not None and identity[1] is not None:
        application = state.applications.get(identity[1].id)
        if application is None:  # a reload removed it between the two lookups
            state = None
    if state is None:
        metrics.child(metrics.REJECTIONS, "", "unauthenticated").inc()
        raise GatewayError(
            401,
            "Missing API key: send 'Authorization: Bearer <key>'" if not key
            else "Incorrect API key provided",
            reason="unauthenticated", code="invalid_api_key")
    rt.tenants.series.touch(state)
    return state, application


def adapter_of(rt: Runtime, model: str) -> AdapterConfig | None:
    """The configured LoRA adapter ``model`` (a served name) names; None: a model (an
    adapter an engine lists without an ``adapters`` entry is one: its own pool of the
    engines that list it). A dict lookup."""
    return rt.config.adapter(model)


def route(rt: Runtime, tenant: TenantState, requested: str,
          ) -> tuple[str, Pool, EngineSlots, AdapterConfig | None]:
    """The served name of the model the client asked for, its pool (an adapter's: its
    base's), the engine that counts the prompt, and the adapter it names; 404
    ``model_not_found`` when no engine serves it or the tenant may not use it (an adapter
    of other tenants included), 503 at once when every engine the tenant could use in its
    pool is down. Decided here, without an engine call: a dict lookup or two."""
    model = rt.config.served_name(requested)
    adapter = adapter_of(rt, model)
    pool = rt.dispatcher.pool_for(model if adapter is None else adapter.base)
    if pool is None or not tenant.config.may_use(model) \
            or (adapter is not None and not adapter.serves(tenant.id)):
        if pool is None and rt.dispatcher.fleet.unlearned():
            raise GatewayError(
                503, f"no engine that has reported its models serves {clip(requested)!r}; "
                f"{len(rt.dispatcher.fleet.unlearned())} engine(s) have not reported theirs yet",
                reason="engine_unavailable", code="engine_unavailable",
                headers={"retry-after": "2"})
        raise GatewayError(
            404, f"The model {clip(requested)!r} does not exist or you do not have access to "
            f"it; models of tenant {tenant.id!r}: {', '.join(tenant_models(rt, tenant)) or 'none'}",
            reason="model_not_found", code="model_not_found", param="model")
    engine = rt.dispatcher.preferred(tenant, pool)
    if engine is None:
        raise GatewayError(503, f"no engine serving model {model!r} for tenant {tenant.id!r} "
                           "is available", reason="engine_unavailable",
                           code="engine_unavailable", headers=engine_retry_headers())
    return model, pool, engine, adapter


def tenant_models(rt: Runtime, tenant: TenantState) -> list[str]:
    """The model names (served names and their aliases) the tenant may send, sorted."""
    names: set[str] = set()
    served = rt.dispatcher.served_models()
    for model in served:
        if tenant.config.may_use(model) and rt.config.adapter(model) is None:
            names.add(model)
            names.update(rt.config.aliases_of(model))
    served_set = set(served)
    names.update(a.name for a in rt.config.adapters
                 if a.base in served_set and a.serves(tenant.id) and tenant.config.may_use(a.name))
    return sorted(names)
