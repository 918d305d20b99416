"""A tenant given as JSON through the admin API, checked by the configuration file's own
tenant parser (``_tenants``), so both accept exactly the same fields and values.

Such a tenant has no ``api_keys`` in its body: its keys live in the admin store, looked
up by digest beside the file's. Its ``key_hashes`` (and each application's) hold digests
derived from a random per-tenant salt: no key hashes to them (finding one means inverting
SHA-256), they keep the parser's "at least one key" rule satisfied, and they keep the
tenant's prefix-cache salt (``TenantConfig.cache_salt``) the same across key rotations.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

from ._fields import ConfigError
from ._gateway import GatewayConfig
from ._models import _known_models
from ._tenants import _tenant
from ._values import TenantConfig

API_TENANT_WHERE = "tenant"
"""The path prefix of the admin API's messages: ``tenant.budgets[0].per: ...``."""


def application_digest(salt: bytes, application_id: object) -> bytes:
    """The placeholder digest of an API tenant's application (no key hashes to it)."""
    return hmac.new(salt, b"application:" + str(application_id).encode(),
                    hashlib.sha256).digest()


def parse_api_tenant(body: Any, config: GatewayConfig, salt: bytes) -> TenantConfig:
    """The tenant of an admin API body, against ``config``'s lanes and models; a
    ``ConfigError`` naming the field (``tenant.<path>: ...``) otherwise. O(size of the
    body); pure."""
    where = API_TENANT_WHERE
    if not isinstance(body, Mapping):
        raise ConfigError(f"{where}: expected a JSON object")
    if "api_keys" in body:
        raise ConfigError(f"{where}.api_keys: not accepted here; a tenant's keys are made "
                          "with POST /admin/tenants/{id}/keys")
    entry = dict(body)
    entry["api_keys"] = [f"sha256:{salt.hex()}"]
    applications = body.get("applications")
    if isinstance(applications, list):
        filled: list[Any] = []
        for i, app in enumerate(applications):
            if isinstance(app, Mapping):
                if "api_keys" in app:
                    raise ConfigError(f"{where}.applications[{i}].api_keys: not accepted here; "
                                      "an application's keys are made with POST "
                                      "/admin/tenants/{id}/keys and its 'application'")
                digest = application_digest(salt, app.get("id"))
                app = {**app, "api_keys": [f"sha256:{digest.hex()}"]}
            filled.append(app)
        entry["applications"] = filled
    aliases = {alias: m.name for m in config.models for alias in m.aliases}
    return _tenant(entry, where, config.lanes, aliases,
                   _known_models(config.models, config.engines))
