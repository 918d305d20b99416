"""``gateway.yaml``, validated strictly.

Every unknown key and every bad value is an error whose message names the key path
(``tenants[1].budgets[0].per``): a typo in a quota must stop the gateway, not silently
leave a tenant unlimited. Parsing is separate from the running state so that a reload can
check a new file completely before anything changes. This module checks the top level and
its one-line sections; each list of entries has its own module (engines, models, tenants,
batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..state import StateConfig, StateConfigError, parse_state
from ._batch import _batch
from ._engines import _engine
from ._fields import (
    ConfigError,
    _duration,
    _duration_or_off,
    _int,
    _keys,
    _known,
    _list,
    _mapping,
)
from ._gateway import DEFAULT_LEDGER, GatewayConfig
from ._adapters import _adapters
from ._models import _cost, _known_models, _models
from ._tenants import _tenant
from ._values import LaneConfig


ROUTINGS = ("pool", "pinned")


def parse_config(data: Any, base_dir: Path | None = None, source: Path | None = None) -> GatewayConfig:
    root = _mapping(data, "the configuration")
    _known(root, "", ("engines", "tenants", "lanes", "cost", "ledger", "admin_api_keys",
                      "request_timeout", "max_body_bytes", "lane_share_window", "repin_after",
                      "max_model_name_chars", "max_prompts_per_request",
                      "header_timeout", "body_timeout", "body_min_rate", "max_connections",
                      "stream_buffer_bytes", "tenant_stream_buffer_bytes",
                      "dispatch_order", "prompt_count", "state", "on_state_failure", "models",
                      "routing", "pool_affinity", "conversation_affinity",
                      "metrics_idle_after", "max_tokenize_bytes", "metrics_api_keys",
                      "metrics_cache", "max_conversation_homes",
                      "max_conversation_homes_per_tenant",
                      "discovery_interval", "locality", "batch", "ledger_journal",
                      "ledger_journal_max_bytes", "on_ledger_full", "reconcile_interval",
                      "reconcile_grace", "adapters", "adapter_affinity"))
    engines = tuple(_engine(e, f"engines[{i}]") for i, e in enumerate(_list(root, "engines", required=True)))
    if not engines:
        raise ConfigError("engines: at least one engine is needed")
    urls = [e.url for e in engines]
    if len(set(urls)) != len(urls):
        raise ConfigError("engines: the same url is listed twice")
    lanes = tuple(_lane(x, f"lanes[{i}]") for i, x in enumerate(_list(root, "lanes"))) or (LaneConfig("default", 0),)
    names = [lane.name for lane in lanes]
    if len(set(names)) != len(names):
        raise ConfigError("lanes: lane names must be unique")
    cost = _cost(root.get("cost"))
    models = _models(_list(root, "models"), engines)
    aliases = {alias: m.name for m in models for alias in m.aliases}
    adapters = _adapters(_list(root, "adapters"), models)
    known = _known_models(models, engines)
    if known is not None:
        known |= {a.name for a in adapters}
    tenants = tuple(
        _tenant(t, f"tenants[{i}]", lanes, aliases, known)
        for i, t in enumerate(_list(root, "tenants", required=True))
    )
    if not tenants:
        raise ConfigError("tenants: at least one tenant is needed")
    seen_ids: set[str] = set()
    seen_keys: dict[bytes, str] = {}
    for i, tenant in enumerate(tenants):
        if tenant.id in seen_ids:
            raise ConfigError(f"tenants[{i}].id: tenant {tenant.id!r} is defined twice")
        seen_ids.add(tenant.id)
        owned = [(f"tenants[{i}].api_keys", repr(tenant.id), d) for d in tenant.key_hashes]
        owned += [(f"tenants[{i}].applications[{j}].api_keys",
                   f"{tenant.id!r} application {app.id!r}", d)
                  for j, app in enumerate(tenant.applications) for d in app.key_hashes]
        for where, owner, digest in owned:
            if digest in seen_keys:
                raise ConfigError(f"{where}: a key of {owner} also belongs to "
                                  f"{seen_keys[digest]}")
            seen_keys[digest] = owner
    admin = tuple(_keys(root.get("admin_api_keys", []), "admin_api_keys"))
    ledger = root.get("ledger", DEFAULT_LEDGER)
    if not isinstance(ledger, str) or not ledger:
        raise ConfigError("ledger: must be a URL such as 'sqlite:///usage.db' or 'postgresql://...'")
    if base_dir is not None:
        from ..ledger import resolve_ledger_url

        ledger = resolve_ledger_url(ledger, base_dir)
    journal = _ledger_journal(root.get("ledger_journal"), ledger, base_dir)
    on_full = root.get("on_ledger_full", "refuse")
    from ..ledger import ON_FULL

    if on_full not in ON_FULL:
        raise ConfigError("on_ledger_full: expected 'refuse' (new requests get 503 while the "
                          "ledger's journal is full) or 'drop' (serve them and count the rows "
                          f"that cannot be kept), got {on_full!r}")
    return GatewayConfig(
        engines=engines,
        tenants=tenants,
        lanes=lanes,
        cost=cost,
        ledger=ledger,
        ledger_journal=journal,
        ledger_journal_max_bytes=_int(root, "ledger_journal_max_bytes", "", 1024 * 1024 * 1024,
                                      minimum=64 * 1024) or 0,
        on_ledger_full=on_full,
        admin_key_hashes=admin,
        request_timeout_s=_duration(root, "request_timeout", "", 600.0),
        max_body_bytes=_int(root, "max_body_bytes", "", 8 * 1024 * 1024, minimum=1024) or 0,
        max_model_name_chars=_int(root, "max_model_name_chars", "", 256, minimum=1) or 0,
        max_prompts_per_request=_int(root, "max_prompts_per_request", "", 2048, minimum=1) or 0,
        header_timeout_s=_duration(root, "header_timeout", "", 20.0),
        body_timeout_s=_duration(root, "body_timeout", "", 30.0),
        body_min_rate=_int(root, "body_min_rate", "", 64 * 1024, minimum=0) or 0,
        max_connections=_int(root, "max_connections", "", 1000, minimum=1) or 0,
        stream_buffer_bytes=_int(root, "stream_buffer_bytes", "", 1024 * 1024, minimum=0) or 0,
        tenant_stream_buffer_bytes=_int(root, "tenant_stream_buffer_bytes", "",
                                        16 * 1024 * 1024, minimum=0) or 0,
        lane_share_window_s=_duration(root, "lane_share_window", "", 30.0),
        repin_after_s=_duration(root, "repin_after", "", 0.0) or None,
        dispatch_order=_dispatch_order(root.get("dispatch_order", "vtc")),
        prompt_count=_prompt_count(root.get("prompt_count", "bound")),
        state=_state(root.get("state"), root.get("on_state_failure")),
        models=models,
        adapters=adapters,
        adapter_affinity=_int(root, "adapter_affinity", "", 4, minimum=0) or 0,
        routing=_routing(root.get("routing", "pool")),
        pool_affinity=_int(root, "pool_affinity", "", 2, minimum=0) or 0,
        conversation_affinity=_int(root, "conversation_affinity", "", 8, minimum=0) or 0,
        locality=_locality(root.get("locality", "conversation")),
        metrics_idle_after_s=_duration(root, "metrics_idle_after", "", 900.0),
        max_tokenize_bytes=_int(root, "max_tokenize_bytes", "", 1024 * 1024,
                                minimum=1024) or 0,
        metrics_key_hashes=tuple(_keys(root.get("metrics_api_keys", []), "metrics_api_keys")),
        metrics_cache_s=_duration_or_off(root, "metrics_cache", 2.0),
        max_conversation_homes=_int(root, "max_conversation_homes", "", 100_000,
                                    minimum=1) or 0,
        max_conversation_homes_per_tenant=_int(root, "max_conversation_homes_per_tenant", "",
                                               10_000, minimum=1) or 0,
        discovery_interval_s=_duration(root, "discovery_interval", "", 10.0),
        reconcile_interval_s=_duration_or_off(root, "reconcile_interval", 60.0),
        reconcile_grace_s=_duration_or_off(root, "reconcile_grace", 30.0),
        batch=_batch(root.get("batch"), lanes, base_dir),
        source=source,
    )


def _locality(value: Any) -> str:
    if value not in ("conversation", "tenant"):
        raise ConfigError(f"locality: expected 'conversation' (each conversation on the engine "
                          f"that holds its prefix, within conversation_affinity of the least "
                          f"loaded) or "
                          f"'tenant' (a tenant's engine while it has room), got {value!r}")
    return str(value)


def _routing(value: Any) -> str:
    if value not in ROUTINGS:
        raise ConfigError(f"routing: expected 'pool' (one fair queue per model over its "
                          f"engines) or 'pinned' (each tenant on one engine), got {value!r}")
    return value


def _state(state: Any, on_failure: Any) -> StateConfig:
    try:
        return parse_state(state, on_failure)
    except StateConfigError as exc:
        raise ConfigError(str(exc)) from None


def _dispatch_order(value: Any) -> str:
    if value not in ("vtc", "fcfs"):
        raise ConfigError(f"dispatch_order: expected 'vtc' (weighted fair) or 'fcfs', got {value!r}")
    return value


def _prompt_count(value: Any) -> str:
    if value not in ("bound", "exact"):
        raise ConfigError(f"prompt_count: expected 'bound' (count with /tokenize only when the "
                          f"prompt's byte bound cannot decide) or 'exact', got {value!r}")
    return value


def _lane(value: Any, where: str) -> LaneConfig:
    m = _mapping(value, where)
    _known(m, where, ("name", "priority", "min_share"))
    name = m.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: required, a non-empty string")
    priority = m.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigError(f"{where}.priority: expected an integer (lower runs first), got {priority!r}")
    share = m.get("min_share", 0.1)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise ConfigError(f"{where}.min_share: expected a fraction in [0, 1), got {share!r}")
    return LaneConfig(name, priority, float(share))


def _ledger_journal(value: Any, ledger: str, base_dir: Path | None) -> str:
    """The journal directory: as given (relative to the configuration file), else beside
    a SQLite ledger, else ``tokenpace-journal`` beside the configuration file."""
    from ..ledger import default_journal

    if value is None:
        beside = default_journal(ledger)
        if beside is not None:
            return beside
        value = "tokenpace-journal"
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ConfigError(f"ledger_journal: expected a directory path, got {value!r}")
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return str(path.absolute())
