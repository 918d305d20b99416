"""The ``engines`` section: one entry per engine (or per DNS name of a set of engines),
and the rule a reload follows for engine keys the file does not hold."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from ._fields import ConfigError, _bool, _int, _known, _mapping, _name_list
from ._gateway import GatewayConfig
from ._router_headers import _router_headers
from ._values import EngineConfig


SCHEDULING_POLICIES = ("fcfs", "priority")


def _engine(value: Any, where: str) -> EngineConfig:
    if isinstance(value, str):
        value = {"url": value}
    m = _mapping(value, where)
    _known(m, where, ("url", "max_inflight", "scheduling_policy", "max_engine_waiting",
                      "max_kv_cache_usage", "max_num_seqs", "reserved_slots", "api_key",
                      "api_key_env", "models", "model_path", "drain", "discovery", "headers",
                      "max_adapters"))
    url = m.get("url")
    if not isinstance(url, str):
        raise ConfigError(f"{where}.url: required, e.g. 'http://127.0.0.1:8001'")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{where}.url: expected http(s)://host:port, got {url!r}")
    discovery = m.get("discovery")
    if discovery is not None and discovery != "dns":
        raise ConfigError(f"{where}.discovery: expected 'dns' (each address the url's host "
                          f"resolves to is an engine) or null, got {discovery!r}")
    if discovery and (parts.scheme != "http" or parts.path.strip("/")):
        raise ConfigError(f"{where}.discovery: needs a plain http://host:port url (engines "
                          "found by address are called by address, which a TLS certificate "
                          f"naming the host would not match), got {url!r}")
    policy = m.get("scheduling_policy", "fcfs")
    if policy not in SCHEDULING_POLICIES:
        raise ConfigError(
            f"{where}.scheduling_policy: expected one of {', '.join(SCHEDULING_POLICIES)} "
            f"(the engine's --scheduling-policy), got {policy!r}"
        )
    kv = m.get("max_kv_cache_usage", 0.95)
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, (int, float))
                           or not 0 < kv <= 1):
        raise ConfigError(f"{where}.max_kv_cache_usage: expected a fraction in (0, 1] or null, got {kv!r}")
    return EngineConfig(
        url=url.rstrip("/"),
        max_inflight=_int(m, "max_inflight", where, 64, minimum=1) or 64,
        scheduling_policy=policy,
        max_engine_waiting=_int(m, "max_engine_waiting", where, 4, minimum=0)
        if m.get("max_engine_waiting", 4) is not None else None,
        max_kv_cache_usage=None if kv is None else float(kv),
        api_key=_engine_key(m, where),
        max_num_seqs=_int(m, "max_num_seqs", where, None, minimum=1),
        reserved_slots=_int(m, "reserved_slots", where, None, minimum=0),
        models=_name_list(m["models"], f"{where}.models") if m.get("models") is not None
        else None,
        model_path=_model_path(m, where),
        drain=_bool(m, "drain", where, False),
        discovery=discovery,
        headers=_router_headers(m.get("headers"), f"{where}.headers"),
        max_adapters=_int(m, "max_adapters", where, None, minimum=1),
    )


def _model_path(m: Mapping[str, Any], where: str) -> str | None:
    value = m.get("model_path")
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{where}.model_path: expected the model tokenpace up serves there "
                          "(a path or a hub name)")
    return value


def _engine_key(m: Mapping[str, Any], where: str) -> str | None:
    """``api_key`` as given, or read from the environment variable named by ``api_key_env``."""
    if "api_key" in m and "api_key_env" in m:
        raise ConfigError(f"{where}: give api_key or api_key_env, not both")
    if "api_key_env" in m:
        name = m["api_key_env"]
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.api_key_env: expected the name of an environment variable")
        key = os.environ.get(name)
        if not key:
            raise ConfigError(f"{where}.api_key_env: the environment variable {name} is not set "
                              "or empty")
        if key != key.strip() or not key.isprintable():
            raise ConfigError(f"{where}.api_key_env: the value of {name} has surrounding spaces "
                              "or control characters")
        return key
    key = m.get("api_key")
    if key is not None and (not isinstance(key, str) or not key or key != key.strip()
                            or not key.isprintable()):
        raise ConfigError(f"{where}.api_key: expected a non-empty string without surrounding "
                          "spaces or control characters (the engine's --api-key / VLLM_API_KEY)")
    return key


def keep_engine_keys(new: GatewayConfig, old: GatewayConfig) -> GatewayConfig:
    """``new`` with the running engines' keys where its file gives none (paired by url).

    Keys that ``tokenpace up`` generated live only in the running configuration; a key
    that the new file changes is refused (the engine would have to restart with it too).
    An engine the file adds brings its own key, or none.
    """
    running = {e.url: e for e in old.engines}
    engines = []
    for i, engine in enumerate(new.engines):
        before = running.get(engine.url)
        if before is not None:
            if engine.api_key is None:
                engine = dataclasses.replace(engine, api_key=before.api_key)
            elif engine.api_key != before.api_key:
                raise ConfigError(f"engines[{i}].api_key: changing an engine's key needs a "
                                  "restart")
        engines.append(engine)
    return dataclasses.replace(new, engines=tuple(engines))
