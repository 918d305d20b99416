"""Checks of one value of a configuration entry, each raising ``ConfigError`` with the
key path of what it read (``tenants[1].budgets[0].per``).

Each helper is told where the value sits (the path of its mapping and its key, or the
value's own path), so a message always names the full path; none keeps state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...fairness import parse_duration
from ._values import hash_key


class ConfigError(ValueError):
    """The gateway configuration is invalid; the message names the key."""


def _batch_cost(m: Mapping[str, Any], where: str, key: str = "batch_cost") -> float | None:
    """A factor on the model's cost for batch lines (``batch.cost``, a model's or a
    tenant's ``batch_cost``); None when absent."""
    value = m.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}.{key}: expected a number >= 0 (times the model's "
                          f"cost for batch lines; 0.5 halves it), got {value!r}")
    return float(value)


def _name_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
        raise ConfigError(f"{where}: expected a list of model names (non-empty strings)")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where}: the same name is listed twice")
    return tuple(value)


def _path(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _known(m: Mapping[str, Any], where: str, keys: tuple[str, ...]) -> None:
    unknown = [k for k in m if k not in keys]
    if unknown:
        raise ConfigError(
            f"{_path(where, str(unknown[0]))}: unknown key; known keys here are {', '.join(keys)}"
        )


def _list(m: Mapping[str, Any], key: str, where: str = "", required: bool = False) -> list[Any]:
    if key not in m:
        if required:
            raise ConfigError(f"{_path(where, key)}: required")
        return []
    value = m[key]
    if not isinstance(value, list):
        raise ConfigError(f"{_path(where, key)}: expected a list, got {type(value).__name__}")
    return value


def _keys(value: Any, where: str) -> list[bytes]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list of keys")
    out = []
    for i, key in enumerate(value):
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{where}[{i}]: expected a non-empty string")
        if key.startswith("sha256:"):
            hexdigest = key[len("sha256:"):]
            try:
                digest = bytes.fromhex(hexdigest)
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise ConfigError(f"{where}[{i}]: 'sha256:' must be followed by 64 hex digits")
            out.append(digest)
        else:
            out.append(hash_key(key))
    return out


def _number(m: Mapping[str, Any], key: str, where: str, required: bool = False) -> float | None:
    if key not in m or m[key] is None:
        if required:
            raise ConfigError(f"{_path(where, key)}: required")
        return None
    value = m[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{_path(where, key)}: expected a number greater than 0, got {value!r}")
    return float(value)


def _bool(m: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = m.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{_path(where, key)}: expected true or false, got {value!r}")
    return value


def _int(m: Mapping[str, Any], key: str, where: str, default: int | None, minimum: int) -> int | None:
    if key not in m or m[key] is None:
        return default
    value = m[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{_path(where, key)}: expected an integer >= {minimum}, got {value!r}")
    return value


def _duration_or_off(m: Mapping[str, Any], key: str, default: float) -> float:
    """A top-level duration that may be 0 (a number, or ``"0"``): off, or no wait."""
    value = m.get(key)
    if (value == 0 and not isinstance(value, bool)) or value == "0":
        return 0.0
    return _duration(m, key, "", default)


def _duration(m: Mapping[str, Any], key: str, where: str, default: float) -> float:
    if key not in m or m[key] is None:
        return default
    value = m[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ConfigError(f"{_path(where, key)}: {exc}") from None
