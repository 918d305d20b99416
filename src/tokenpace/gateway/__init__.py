"""The tenant gateway: an OpenAI-compatible proxy in front of one or more vLLM engines.

Identity (API key -> tenant), admission (request caps, concurrency, queue depth, token
budgets), dispatch to the engine a tenant is pinned to, a usage ledger and Prometheus
metrics. ``tokenpace gateway --config gateway.yaml`` serves it; see docs/gateway/index.md.

One subpackage per stage of a request, imported only downward (docs/architecture.md):
``server`` (HTTP surface) -> ``admission`` and ``relay`` -> ``exchange`` (a request's
book and settlement) -> ``dispatch`` -> ``engines`` -> ``tenants`` -> ``config`` ->
``ledger``, ``state`` -> ``wire`` and ``metrics``.
"""

from .config import ConfigError, GatewayConfig, load_config, parse_config
from .server import Gateway, create_app

__all__ = ["ConfigError", "Gateway", "GatewayConfig", "create_app", "load_config", "parse_config"]
