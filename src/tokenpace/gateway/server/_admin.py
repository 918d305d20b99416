"""The admin API's tenant, key and audit routes (docs/gateway/admin-api.md).

Every route takes one of ``admin_api_keys`` (401 without a key, 403 with another key).
A change is checked whole before anything is written (a tenant's body by the
configuration file's parser: 400 naming the field), then written in one transaction with
its audit row (``registry.RegistryStore``), then applied on this replica before the answer
(``Registry.poll``); the other replicas apply it at their next poll.

The configuration file's tenants are listed, read-only: a change to one is refused (409),
and so is an API tenant with a file tenant's id. Admin keys are named in the audit by the
first 12 hex digits of their SHA-256, never by the key.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...fairness import parse_duration
from ..admission import bearer_key
from ..config import (
    API_TENANT_WHERE,
    ConfigError,
    GatewayConfig,
    TenantConfig,
    hash_key,
    parse_api_tenant,
)
from ..registry import RegistryConflict, new_key_id, new_salt, new_secret
from ..wire import error_response
from ._registry import Registry

MAX_ADMIN_BODY_BYTES = 256 * 1024
MAX_GRACE_S = 30 * 24 * 3600.0
MAX_KEY_NAME_CHARS = 256
AUDIT_PAGE_MAX = 1000
KEY_FIELDS = ("name", "application", "expires_at")


class _Refused(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


def _error(status: int, message: str, code: str, param: str | None = None) -> _Refused:
    return _Refused(error_response(status, message, code=code, param=param))


class AdminApi:
    """The routes; ``config()`` is the served configuration, ``registry()`` this
    replica's view of the admin store (None before start-up)."""

    def __init__(self, config: Callable[[], GatewayConfig],
                 registry: Callable[[], Registry | None]) -> None:
        self._config = config
        self._registry = registry

    # -- plumbing ------------------------------------------------------------------------

    def _admin(self, request: Request) -> str:
        """The calling admin key's name for the audit, or a 401/403."""
        key = bearer_key(request.headers.get("authorization"))
        if not key or not self._config().is_admin_key(key):
            raise _error(401 if not key else 403, "an admin API key is required",
                         "invalid_api_key")
        return "sha256:" + hash_key(key).hex()[:12]

    def _ready(self) -> Registry:
        registry = self._registry()
        if registry is None or registry.store is None:
            raise _error(503, "the admin store (the ledger's database) is not available",
                         "admin_store_unavailable")
        return registry

    async def _body(self, request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_ADMIN_BODY_BYTES:
            raise _error(413, f"the body is over {MAX_ADMIN_BODY_BYTES} bytes",
                         "request_too_large")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_ADMIN_BODY_BYTES:
                raise _error(413, f"the body is over {MAX_ADMIN_BODY_BYTES} bytes",
                             "request_too_large")
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError:
            raise _error(400, "the body is not JSON", "invalid_request") from None
        if not isinstance(body, dict):
            raise _error(400, "the body must be a JSON object", "invalid_request")
        return body

    async def _store_call(self, registry: Registry, fn: Callable[..., Any], *args: Any) -> Any:
        """A store method in a worker thread; its refusals and the database's errors as
        answers."""
        try:
            return await asyncio.to_thread(fn, *args)
        except RegistryConflict as exc:
            code = "conflict" if exc.status == 409 else "not_found"
            raise _error(exc.status, str(exc), code, exc.param) from None
        except Exception as exc:
            if registry.store is not None and isinstance(exc, registry.store.errors):
                raise _error(503, f"the admin store did not answer: {exc}",
                             "admin_store_unavailable") from None
            raise

    async def _applied(self, registry: Registry) -> None:
        """This replica applies the change before it answers (the others at their poll)."""
        try:
            await registry.poll()
        except Exception:  # the change is stored; the background poll applies it
            pass

    def _file_tenant(self, registry: Registry, tenant_id: str) -> TenantConfig | None:
        return registry.file_config.tenant(tenant_id)

    def _parse(self, registry: Registry, tenant_id: str, spec: dict[str, Any],
               salt: bytes) -> TenantConfig:
        try:
            return parse_api_tenant({**spec, "id": tenant_id}, registry.file_config, salt)
        except ConfigError as exc:
            message = str(exc)
            path = message.partition(":")[0]
            param = path[len(API_TENANT_WHERE) + 1:] if path.startswith(
                API_TENANT_WHERE + ".") else None
            raise _error(400, message, "invalid_request", param) from None

    async def _run(self, request: Request, handler: Callable[..., Any]) -> Response:
        try:
            admin = self._admin(request)
            return await handler(request, admin)
        except _Refused as refused:
            return refused.response

    # -- tenants -------------------------------------------------------------------------

    async def create_tenant(self, request: Request) -> Response:
        return await self._run(request, self._create_tenant)

    async def _create_tenant(self, request: Request, admin: str) -> Response:
        body = await self._body(request)
        registry = self._ready()
        tenant_id = body.get("id")
        if not isinstance(tenant_id, str) or not tenant_id:
            raise _error(400, "id: required, a non-empty string", "invalid_request", "id")
        if self._file_tenant(registry, tenant_id) is not None:
            raise _error(409, f"tenant {tenant_id!r} is defined in the configuration file",
                         "conflict", "id")
        spec = {k: v for k, v in body.items() if k != "id"}
        salt = new_salt()
        self._parse(registry, tenant_id, spec, salt)
        assert registry.store is not None
        tenant = await self._store_call(registry, registry.store.create_tenant, tenant_id,
                                        spec, salt, admin, time.time())
        await self._applied(registry)
        return JSONResponse(tenant.public(), status_code=201)

    async def list_tenants(self, request: Request) -> Response:
        return await self._run(request, self._list_tenants)

    async def _list_tenants(self, request: Request, admin: str) -> Response:
        registry = self._ready()
        data = [describe_file_tenant(t) for t in registry.file_config.tenants]
        data += [row.public() for _, row in sorted(registry.tenants.rows.items())]
        return JSONResponse({"object": "list", "data": data})

    async def get_tenant(self, request: Request) -> Response:
        return await self._run(request, self._get_tenant)

    async def _get_tenant(self, request: Request, admin: str) -> Response:
        registry = self._ready()
        tenant_id = request.path_params["tenant_id"]
        file_tenant = self._file_tenant(registry, tenant_id)
        if file_tenant is not None:
            return JSONResponse(describe_file_tenant(file_tenant))
        assert registry.store is not None
        row = await self._store_call(registry, registry.store.tenant, tenant_id)
        if row is None or row.deleted_at is not None:
            raise _error(404, f"no tenant {tenant_id!r}", "not_found", "id")
        return JSONResponse(row.public())

    async def update_tenant(self, request: Request) -> Response:
        return await self._run(request, self._update_tenant)

    async def _update_tenant(self, request: Request, admin: str) -> Response:
        registry = self._ready()
        tenant_id = request.path_params["tenant_id"]
        body = await self._body(request)
        if self._file_tenant(registry, tenant_id) is not None:
            raise _error(409, f"tenant {tenant_id!r} is defined in the configuration file: "
                         "change it there and reload", "conflict", "id")
        if "id" in body and body["id"] != tenant_id:
            raise _error(400, "id: a tenant's id cannot change", "invalid_request", "id")
        assert registry.store is not None
        row = await self._store_call(registry, registry.store.tenant, tenant_id)
        if row is None or row.deleted_at is not None:
            raise _error(404, f"no tenant {tenant_id!r} made through the admin API",
                         "not_found", "id")
        spec = dict(row.spec)
        for name, value in body.items():
            if name == "id":
                continue
            if value is None:
                spec.pop(name, None)  # back to the default
            else:
                spec[name] = value
        self._parse(registry, tenant_id, spec, row.salt)
        tenant = await self._store_call(registry, registry.store.update_tenant, tenant_id,
                                        spec, admin, time.time(), row.version)
        await self._applied(registry)
        return JSONResponse(tenant.public())

    async def delete_tenant(self, request: Request) -> Response:
        return await self._run(request, self._delete_tenant)

    async def _delete_tenant(self, request: Request, admin: str) -> Response:
        registry = self._ready()
        tenant_id = request.path_params["tenant_id"]
        if self._file_tenant(registry, tenant_id) is not None:
            raise _error(409, f"tenant {tenant_id!r} is defined in the configuration file: "
                         "remove it there and reload", "conflict", "id")
        assert registry.store is not None
        revoked = await self._store_call(registry, registry.store.delete_tenant, tenant_id,
                                         admin, time.time())
        await self._applied(registry)
        return JSONResponse({"id": tenant_id, "deleted": True, "keys_revoked": revoked})

    # -- keys ----------------------------------------------------------------------------

    async def create_key(self, request: Request) -> Response:
        return await self._run(request, self._create_key)

    async def _create_key(self, request: Request, admin: str) -> Response:
        registry = self._ready()
        tenant_id = request.path_params["tenant_id"]
        body = await self._body(request)
        unknown = [k for k in body if k not in KEY_FIELDS]
        if unknown:
            raise _error(400, f"{unknown[0]}: unknown field; known fields are "
                         f"{', '.join(KEY_FIELDS)}", "invalid_request", str(unknown[0]))
        if self._file_tenant(registry, tenant_id) is not None:
            raise _error(409, f"tenant {tenant_id!r} is defined in the configuration file: "
                         "its keys are there", "conflict", "id")
        name = body.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > MAX_KEY_NAME_CHARS):
            raise _error(400, f"name: a string of at most {MAX_KEY_NAME_CHARS} characters",
                         "invalid_request", "name")
        now = time.time()
        expires_at = body.get("expires_at")
        if expires_at is not None and (
                isinstance(expires_at, bool) or not isinstance(expires_at, (int, float))
                or not math.isfinite(expires_at) or expires_at <= now):
            raise _error(400, "expires_at: unix seconds in the future", "invalid_request",
                         "expires_at")
        application = body.get("application")
        assert registry.store is not None
        row = await self._store_call(registry, registry.store.tenant, tenant_id)
        if row is None or row.deleted_at is not None:
            raise _error(404, f"no tenant {tenant_id!r}", "not_found", "id")
        if application is not None:
            known = [a.get("id") for a in row.spec.get("applications") or ()
                     if isinstance(a, dict)]
            if not isinstance(application, str) or application not in known:
                raise _error(400, f"application: tenant {tenant_id!r} has no application "
                             f"{application!r}; its applications: "
                             f"{', '.join(map(str, known)) or 'none'}", "invalid_request",
                             "application")
        secret = new_secret()
        key = await self._store_call(
            registry, registry.store.create_key, new_key_id(), tenant_id, application,
            hash_key(secret), name, None if expires_at is None else float(expires_at),
            admin, now)
        await self._applied(registry)
        return JSONResponse({**key.public(), "key": secret}, status_code=201)

    async def list_keys(self, request: Request) -> Response:
        return await self._run(request, self._list_keys)

    async def _list_keys(self, request: Request, admin: str) -> Response:
        registry = self._ready()
        tenant_id = request.path_params["tenant_id"]
        if self._file_tenant(registry, tenant_id) is not None:
            return JSONResponse({"object": "list", "data": [], "source": "file"})
        assert registry.store is not None
        row = await self._store_call(registry, registry.store.tenant, tenant_id)
        if row is None or row.deleted_at is not None:
            raise _error(404, f"no tenant {tenant_id!r}", "not_found", "id")
        keys = await self._store_call(registry, registry.store.keys_of, tenant_id, time.time())
        return JSONResponse({"object": "list", "data": [k.public() for k in keys]})

    async def rotate_key(self, request: Request) -> Response:
        return await self._run(request, self._rotate_key)

    async def _rotate_key(self, request: Request, admin: str) -> Response:
        registry = self._ready()
        key_id = request.path_params["key_id"]
        body = await self._body(request)
        unknown = [k for k in body if k != "grace"]
        if unknown:
            raise _error(400, f"{unknown[0]}: unknown field; the known field is grace",
                         "invalid_request", str(unknown[0]))
        grace = body.get("grace", "0s")
        try:
            grace_s = 0.0 if grace in ("0", "0s") else parse_duration(grace)
        except ValueError as exc:
            raise _error(400, f"grace: {exc}", "invalid_request", "grace") from None
        if grace_s > MAX_GRACE_S:
            raise _error(400, "grace: at most 30d", "invalid_request", "grace")
        secret = new_secret()
        assert registry.store is not None
        old, new = await self._store_call(registry, registry.store.rotate_key, key_id,
                                          grace_s, new_key_id(), hash_key(secret), admin,
                                          time.time())
        await self._applied(registry)
        return JSONResponse({**new.public(), "key": secret, "replaces": old.id,
                             "old_key_works_until": old.revoked_at}, status_code=201)

    async def revoke_key(self, request: Request) -> Response:
        return await self._run(request, self._revoke_key)

    async def _revoke_key(self, request: Request, admin: str) -> Response:
        registry = self._ready()
        assert registry.store is not None
        key = await self._store_call(registry, registry.store.revoke_key,
                                     request.path_params["key_id"], admin, time.time())
        await self._applied(registry)
        return JSONResponse({**key.public(), "revoked": True})

    # -- audit ---------------------------------------------------------------------------

    async def audit(self, request: Request) -> Response:
        return await self._run(request, self._audit)

    async def _audit(self, request: Request, admin: str) -> Response:
        registry = self._ready()
        limit = _int_param(request, "limit", 100, 1, AUDIT_PAGE_MAX)
        before = _int_param(request, "before", None, 1, None)
        assert registry.store is not None
        rows = await self._store_call(registry, registry.store.audit, limit + 1, before)
        return JSONResponse({"object": "list", "data": [r.public() for r in rows[:limit]],
                             "has_more": len(rows) > limit})


def _int_param(request: Request, name: str, default: int | None, low: int,
               high: int | None) -> int | None:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        bound = f" and {high}" if high is not None else ""
        raise _error(400, f"{name}: a whole number between {low}{bound}", "invalid_request",
                     name)
    return value


def describe_file_tenant(t: TenantConfig) -> dict[str, Any]:
    """A configuration file's tenant as the admin API lists it: its settings, no keys."""
    return {
        "id": t.id, "source": "file", "lane": t.lane, "weight": t.weight,
        "output_tokens_per_second": t.output_tokens_per_second,
        "max_concurrency": t.max_concurrency, "max_queued": t.max_queued,
        "max_input_tokens": t.max_input_tokens, "max_output_tokens": t.max_output_tokens,
        "budgets": [b.key for b in (*t.budgets, *t.observed_budgets)],
        "max_requests": [r.key for r in (*t.max_requests, *t.observed_requests)],
        "models": None if t.models is None else sorted(t.models),
        "applications": [a.id for a in t.applications],
    }
