"""The tenant gateway: an OpenAI-compatible proxy in front of one or more vLLM engines.

Identity (API key -> tenant), admission (request caps, concurrency, queue depth, token
budgets), dispatch to the engine a tenant is pinned to, a usage ledger and Prometheus
metrics. ``tokenpace gateway --config gateway.yaml`` serves it; see docs/gateway.md.
"""

from ._app import Gateway, create_app
from ._config import ConfigError, GatewayConfig, load_config, parse_config

__all__ = ["ConfigError", "Gateway", "GatewayConfig", "create_app", "load_config", "parse_config"]
