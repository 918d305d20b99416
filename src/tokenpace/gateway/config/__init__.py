"""The gateway's configuration: ``gateway.yaml`` parsed and checked into frozen values.

``load_config`` / ``parse_config`` give a ``GatewayConfig`` (engines, models, lanes,
tenants and their applications, state, ledger) or a ``ConfigError`` naming the key path.
Nothing here runs a request: every stage reads these values, and a reload swaps them.
"""

from ._config import (
    BatchConfig,
    APPLICATION_SEPARATOR,
    ApplicationConfig,
    ConfigError,
    EngineConfig,
    GatewayConfig,
    LaneConfig,
    MAX_ROUTER_HEADERS,
    ModelConfig,
    ROUTER_HEADER_PLACEHOLDERS,
    TenantConfig,
    hash_key,
    keep_engine_keys,
    load_config,
    parse_config,
    paused_gc,
)

__all__ = [
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
