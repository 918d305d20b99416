"""The ``tokenpace`` section of vLLM's ``additional_config``, validated strictly.

This module imports nothing from vLLM so that `tokenpace serve` can check flags before it
starts the engine, and so that tests can exercise every refusal cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..pacing import (
    DEFAULT_MAX_USERS,
    LimitsError,
    UserRateLimits,
    limits_file_of,
    parse_overrides_arg,
    validate_overrides,
    validate_rate,
)


SECTION = "tokenpace"
KEY_DEFAULT = "default_user_output_tokens_per_second"
KEY_OVERRIDES = "user_output_tokens_per_second"
KEY_EVENT_LOG = "event_log"
KEY_IDLE_WAIT = "idle_wait"
KEY_TRUSTED_GATEWAY = "trusted_gateway"
KEY_METRICS_USERS = "metrics_users"
KEY_END_USER = "end_user_output_tokens_per_second"
KNOWN_KEYS = (KEY_DEFAULT, KEY_OVERRIDES, KEY_EVENT_LOG, KEY_IDLE_WAIT, KEY_TRUSTED_GATEWAY,
              KEY_METRICS_USERS, KEY_END_USER)


class PacingConfigError(ValueError):
    """The ``tokenpace`` configuration is invalid; the message names the key."""


@dataclass(frozen=True)
class PacingConfig:
    """What the paced scheduler needs: limits (None: pacing off) and where to log events.

    ``trusted_gateway``: requests may carry their user's rate
    (``vllm_xargs.output_rate_tokens_per_second``) and the scheduler adopts it, so that a
    gateway's tenant configuration is the only place rates live. It turns pacing on by
    itself: without a default rate, users that no request gave a rate are not paced
    (``limits.default`` is None).
    """

    limits: UserRateLimits | None
    limits_file: Path | None = None
    event_log: Path | None = None
    idle_wait: bool = True
    trusted_gateway: bool = False
    # Users with their own label on /metrics (the rest are counted as "__other__").
    metrics_users: int = DEFAULT_MAX_USERS
    # Rate of each end user (``vllm_xargs.output_rate_end_user``) inside its user's rate;
    # None: end users are not paced unless a trusted gateway sends their rate.
    end_user_rate: float | None = None

    @property
    def enabled(self) -> bool:
        return self.limits is not None

    @classmethod
    def from_additional_config(cls, additional: Mapping[str, Any] | None) -> PacingConfig:
        section = (additional or {}).get(SECTION)
        if section is None:
            return cls(limits=None)
        return cls.from_section(section)

    @classmethod
    def from_section(cls, section: Any) -> PacingConfig:
        where = f"additional_config[{SECTION!r}]"
        if not isinstance(section, Mapping):
            raise PacingConfigError(f"{where} must be an object, got {type(section).__name__}")
        unknown = sorted(set(section) - set(KNOWN_KEYS))
        if unknown:
            raise PacingConfigError(
                f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known keys are {', '.join(KNOWN_KEYS)}"
            )
        idle_wait = section.get(KEY_IDLE_WAIT, True)
        if not isinstance(idle_wait, bool):
            raise PacingConfigError(f"{where}[{KEY_IDLE_WAIT!r}] must be true or false")
        trusted = section.get(KEY_TRUSTED_GATEWAY, False)
        if not isinstance(trusted, bool):
            raise PacingConfigError(f"{where}[{KEY_TRUSTED_GATEWAY!r}] must be true or false")
        metrics_users = section.get(KEY_METRICS_USERS, DEFAULT_MAX_USERS)
        if not isinstance(metrics_users, int) or isinstance(metrics_users, bool) \
                or not 1 <= metrics_users <= 100_000:
            raise PacingConfigError(f"{where}[{KEY_METRICS_USERS!r}] must be an integer "
                                    f"from 1 to 100000, got {metrics_users!r}")
        event_log = section.get(KEY_EVENT_LOG)
        if event_log is not None and (not isinstance(event_log, str) or not event_log):
            raise PacingConfigError(f"{where}[{KEY_EVENT_LOG!r}] must be a non-empty path string")
        try:
            end_user_rate = (None if section.get(KEY_END_USER) is None else
                             validate_rate(section[KEY_END_USER], f"{where}[{KEY_END_USER!r}]"))
        except LimitsError as exc:
            raise PacingConfigError(str(exc)) from None
        default = section.get(KEY_DEFAULT)
        overrides_value = section.get(KEY_OVERRIDES)
        if default is None and not trusted:
            if overrides_value is not None:
                raise PacingConfigError(
                    f"{where}[{KEY_OVERRIDES!r}] needs {KEY_DEFAULT!r} (or "
                    f"{KEY_TRUSTED_GATEWAY!r}): without a default rate pacing is off"
                )
            return cls(limits=None, event_log=Path(event_log) if event_log else None)
        try:
            # A trusted gateway sends each user's rate, so a default is optional there:
            # None leaves users the gateway has not given a rate unpaced.
            default_rate = (
                None if default is None else validate_rate(default, f"{where}[{KEY_DEFAULT!r}]")
            )
            overrides, limits_file = _overrides(overrides_value, f"{where}[{KEY_OVERRIDES!r}]")
            limits = UserRateLimits(default_rate, overrides)
        except LimitsError as exc:
            raise PacingConfigError(str(exc)) from None
        return cls(
            limits=limits,
            limits_file=limits_file,
            event_log=Path(event_log) if event_log else None,
            idle_wait=idle_wait,
            trusted_gateway=trusted,
            metrics_users=metrics_users,
            end_user_rate=end_user_rate,
        )


def _overrides(value: Any, where: str) -> tuple[dict[str, float], Path | None]:
    if value is None:
        return {}, None
    if isinstance(value, str):
        return parse_overrides_arg(value, source=where), limits_file_of(value)
    if isinstance(value, Mapping):  # vLLM has already parsed --additional-config
        return validate_overrides(value, where), None
    raise LimitsError(
        f"{where} must be an object of user id -> tokens per second or '@/path/limits.json', "
        f"got {type(value).__name__}"
    )
