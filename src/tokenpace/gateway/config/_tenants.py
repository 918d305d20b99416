"""The ``tenants`` section: each tenant, its applications, and the limits both have
(concurrency, token budgets, request rates, each enforced or observed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...fairness import PERIODS, BudgetSpec, RequestLimit, nominal_seconds, parse_duration
from ...pacing import LimitsError, validate_user_id
from ._fields import (
    ConfigError,
    _batch_cost,
    _bool,
    _duration,
    _int,
    _keys,
    _known,
    _list,
    _mapping,
    _name_list,
    _number,
)
from ._values import (
    DEFAULT_MAX_BODY_BYTES_PER_SECOND,
    DEFAULT_MAX_QUEUED,
    ApplicationConfig,
    LaneConfig,
    TenantConfig,
)


def _tenant(value: Any, where: str, lanes: tuple[LaneConfig, ...],
            aliases: Mapping[str, str] | None = None,
            served: frozenset[str] | None = None) -> TenantConfig:
    m = _mapping(value, where)
    _known(m, where, ("id", "api_keys", "lane", "weight", "output_tokens_per_second",
                      "end_user_output_tokens_per_second",
                      "max_concurrency", "max_queued", "max_input_tokens", "max_output_tokens",
                      "max_body_bytes_per_second", "queue_timeout", "budgets", "max_requests",
                      "share_prefix_cache",
                      "models", "applications", "batch_cost"))
    tenant_id = m.get("id")
    try:
        validate_user_id(tenant_id, f"{where}.id")
    except LimitsError as exc:
        raise ConfigError(str(exc)) from None
    _no_control_characters(tenant_id, f"{where}.id")
    keys = tuple(_keys(m.get("api_keys"), f"{where}.api_keys"))
    applications = _applications(m, where)
    if not keys and not any(a.key_hashes for a in applications):
        raise ConfigError(f"{where}.api_keys: at least one key is needed (the tenant's own, "
                          "or its applications')")
    lane = m.get("lane", lanes[0].name)
    if lane not in {x.name for x in lanes}:
        raise ConfigError(
            f"{where}.lane: unknown lane {lane!r}; lanes are {', '.join(x.name for x in lanes)}"
        )
    return TenantConfig(
        id=tenant_id,
        key_hashes=keys,
        lane=lane,
        weight=_number(m, "weight", where) or 1.0,
        output_tokens_per_second=_number(m, "output_tokens_per_second", where),
        end_user_output_tokens_per_second=_number(m, "end_user_output_tokens_per_second", where),
        max_input_tokens=_int(m, "max_input_tokens", where, None, minimum=1),
        max_output_tokens=_int(m, "max_output_tokens", where, None, minimum=1),
        queue_timeout_s=_duration(m, "queue_timeout", where, 60.0),
        share_prefix_cache=_bool(m, "share_prefix_cache", where, False),
        models=_allowed_models(m, where, aliases or {}, served),
        applications=applications,
        batch_cost=_batch_cost(m, where),
        max_queued=_int(m, "max_queued", where, DEFAULT_MAX_QUEUED, minimum=0),
        max_body_bytes_per_second=_int(m, "max_body_bytes_per_second", where,
                                       DEFAULT_MAX_BODY_BYTES_PER_SECOND, minimum=1024),
        **_limits(m, where),
    )


def _limits(m: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The limits a tenant and an application both have, as their configs' fields:
    concurrency, token budgets and request rates, each enforced or observed."""
    budgets = _budgets(m, where)
    max_requests = _request_limits(m, where)
    max_concurrency, observed_concurrency = _concurrency(m, where)
    return {
        "max_concurrency": max_concurrency,
        "observed_concurrency": observed_concurrency,
        "budgets": tuple(b for b in budgets if not b.observe),
        "observed_budgets": tuple(b for b in budgets if b.observe),
        "max_requests": tuple(r for r in max_requests if not r.observe),
        "observed_requests": tuple(r for r in max_requests if r.observe),
    }


def _applications(m: Mapping[str, Any], where: str) -> tuple[ApplicationConfig, ...]:
    """``applications: [{id, api_keys, weight, output_tokens_per_second,
    end_user_output_tokens_per_second, max_concurrency, budgets, max_requests}]``: ids
    unique inside the tenant."""
    out: list[ApplicationConfig] = []
    for i, item in enumerate(_list(m, "applications", where)):
        aw = f"{where}.applications[{i}]"
        am = _mapping(item, aw)
        _known(am, aw, ("id", "api_keys", "weight", "output_tokens_per_second",
                        "end_user_output_tokens_per_second", "max_concurrency", "budgets",
                        "max_requests"))
        app_id = am.get("id")
        if not isinstance(app_id, str) or not app_id:
            raise ConfigError(f"{aw}.id: required, a non-empty string")
        if len(app_id) > MAX_APPLICATION_ID_LENGTH:
            raise ConfigError(f"{aw}.id: is {len(app_id)} characters long; at most "
                              f"{MAX_APPLICATION_ID_LENGTH} are allowed")
        _no_control_characters(app_id, f"{aw}.id")
        if any(a.id == app_id for a in out):
            raise ConfigError(f"{aw}.id: application {app_id!r} is defined twice in the tenant")
        keys = tuple(_keys(am.get("api_keys"), f"{aw}.api_keys"))
        if not keys:
            raise ConfigError(f"{aw}.api_keys: at least one key is needed (a key names the "
                              "tenant and the application)")
        out.append(ApplicationConfig(
            id=app_id, key_hashes=keys, weight=_number(am, "weight", aw) or 1.0,
            output_tokens_per_second=_number(am, "output_tokens_per_second", aw),
            end_user_output_tokens_per_second=_number(
                am, "end_user_output_tokens_per_second", aw),
            **_limits(am, aw)))
    return tuple(out)


MAX_APPLICATION_ID_LENGTH = 128
"""An application id is a metric label and part of ledger rows and store keys."""


def _no_control_characters(value: str, where: str) -> None:
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ConfigError(f"{where}: must not contain control characters")


def _budgets(m: Mapping[str, Any], where: str) -> list[BudgetSpec]:
    """``budgets: [{tokens, per, mode}]``: token buckets, each listed once; ``per`` a
    duration (a sliding bucket) or ``month`` / ``week`` (a calendar budget, UTC)."""
    budgets = []
    for i, b in enumerate(_list(m, "budgets", where)):
        bw = f"{where}.budgets[{i}]"
        bm = _mapping(b, bw)
        _known(bm, bw, ("tokens", "per", "mode"))
        tokens = _number(bm, "tokens", bw, required=True)
        assert tokens is not None
        if bm.get("per") in PERIODS:
            budgets.append(BudgetSpec(tokens, nominal_seconds(bm["per"]), _observe(bm, bw),
                                      calendar=bm["per"]))
            continue
        try:
            per = parse_duration(bm.get("per"))
        except ValueError as exc:
            raise ConfigError(f"{bw}.per: {exc}, or 'month' or 'week'") from None
        budgets.append(BudgetSpec(tokens, per, _observe(bm, bw)))
    if len({b.key for b in budgets}) != len(budgets):
        raise ConfigError(f"{where}.budgets: the same budget is listed twice")
    return budgets


def _request_limits(m: Mapping[str, Any], where: str) -> tuple[RequestLimit, ...]:
    """``max_requests: [{requests: 600, per: 1m}, ...]``: whole requests per period."""
    limits = []
    for i, item in enumerate(_list(m, "max_requests", where)):
        lw = f"{where}.max_requests[{i}]"
        lm = _mapping(item, lw)
        _known(lm, lw, ("requests", "per", "mode"))
        requests = _int(lm, "requests", lw, None, minimum=1)
        if requests is None:
            raise ConfigError(f"{lw}.requests: required (a whole number of requests, >= 1)")
        try:
            per = parse_duration(lm.get("per"))
        except ValueError as exc:
            raise ConfigError(f"{lw}.per: {exc}") from None
        limits.append(RequestLimit(requests, per, _observe(lm, lw)))
    if len({x.key for x in limits}) != len(limits):
        raise ConfigError(f"{where}.max_requests: the same limit is listed twice")
    return tuple(limits)


def _observe(m: Mapping[str, Any], where: str) -> bool:
    """A limit's ``mode``: ``enforce`` (the default) or ``observe`` (True)."""
    mode = m.get("mode", "enforce")
    if mode not in ("enforce", "observe"):
        raise ConfigError(f"{where}.mode: expected 'enforce' (the default) or 'observe', "
                          f"got {mode!r}")
    return mode == "observe"


def _concurrency(m: Mapping[str, Any], where: str) -> tuple[int | None, int | None]:
    """``max_concurrency``: a number, or ``{limit: 8, mode: observe}``; (enforced, observed)."""
    value = m.get("max_concurrency")
    if not isinstance(value, Mapping):
        return _int(m, "max_concurrency", where, None, minimum=1), None
    cw = f"{where}.max_concurrency"
    _known(value, cw, ("limit", "mode"))
    limit = _int(value, "limit", cw, None, minimum=1)
    if limit is None:
        raise ConfigError(f"{cw}.limit: required (requests in flight at once, >= 1)")
    return (None, limit) if _observe(value, cw) else (limit, None)


def _allowed_models(m: Mapping[str, Any], where: str, aliases: Mapping[str, str],
                    served: frozenset[str] | None) -> frozenset[str] | None:
    """A tenant's ``models`` allow-list as served names; a name no engine serves is an
    error when every engine lists its models (a typo would lock the tenant out)."""
    if m.get("models") is None:
        return None
    names = _name_list(m["models"], f"{where}.models")
    if not names:
        raise ConfigError(f"{where}.models: at least one model; leave the key out to allow "
                          "every model")
    resolved = frozenset(aliases.get(name, name) for name in names)
    if served is not None:
        for name in names:
            if aliases.get(name, name) not in served:
                raise ConfigError(f"{where}.models: no engine serves {name!r}; served: "
                                  f"{', '.join(sorted(served))}")
    return resolved
