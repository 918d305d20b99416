"""The gateway's configuration: ``gateway.yaml`` parsed and checked into frozen values.

``load_config`` / ``parse_config`` give a ``GatewayConfig`` (engines, models, lanes,
tenants and their applications, state, ledger) or a ``ConfigError`` naming the key path.
Nothing here runs a request: every stage reads these values, and a reload swaps them.

Inside: the file read (``_read``, with ``_gc``), the top level checked (``_parse``) with
one module per section (``_engines`` and ``_router_headers``, ``_models``, ``_tenants``,
``_batch``; ``_api_tenant``, a tenant of the admin API by the same parser) over the
checks of one value (``_fields``), into the values (``_values``, ``_gateway``).
"""

from ._api_tenant import API_TENANT_WHERE, application_digest, parse_api_tenant
from ._engines import keep_engine_keys
from ._fields import ConfigError
from ._gateway import GatewayConfig
from ._gc import paused_gc
from ._parse import parse_config
from ._read import load_config
from ._router_headers import MAX_ROUTER_HEADERS, ROUTER_HEADER_PLACEHOLDERS
from ._values import (
    APPLICATION_SEPARATOR,
    AdapterConfig,
    ApplicationConfig,
    BatchConfig,
    EngineConfig,
    LaneConfig,
    ModelConfig,
    TenantConfig,
    hash_key,
)

__all__ = [
    "AdapterConfig",
    "API_TENANT_WHERE",
    "application_digest",
    "parse_api_tenant",
    "BatchConfig",
    "APPLICATION_SEPARATOR",
    "ApplicationConfig",
    "ConfigError",
    "EngineConfig",
    "GatewayConfig",
    "hash_key",
    "keep_engine_keys",
    "LaneConfig",
    "load_config",
    "MAX_ROUTER_HEADERS",
    "ModelConfig",
    "parse_config",
    "paused_gc",
    "ROUTER_HEADER_PLACEHOLDERS",
    "TenantConfig",
]
