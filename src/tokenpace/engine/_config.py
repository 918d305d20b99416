"""The ``tokenpace`` section of vLLM's ``additional_config``, validated strictly.

This module imports nothing from vLLM so that `tokenpace serve` can check flags before it
starts the engine, and so that tests can exercise every refusal cheaply.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..pacing import (
    DEFAULT_MAX_USERS,
    LanePolicy,
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
KEY_USER_HEADER = "user_header"
KEY_APPLICATION_HEADER = "application_header"
KEY_END_USER_HEADER = "end_user_header"
KEY_REQUIRE_USER_HEADER = "require_user_header"
KEY_LANES = "lanes"
HEADER_KEYS = (KEY_USER_HEADER, KEY_APPLICATION_HEADER, KEY_END_USER_HEADER)
KNOWN_KEYS = (KEY_DEFAULT, KEY_OVERRIDES, KEY_EVENT_LOG, KEY_IDLE_WAIT, KEY_TRUSTED_GATEWAY,
              KEY_METRICS_USERS, KEY_END_USER, *HEADER_KEYS, KEY_REQUIRE_USER_HEADER,
              KEY_LANES)

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
RESERVED_HEADERS = frozenset({
    "authorization", "connection", "content-length", "content-type", "cookie", "host",
    "keep-alive", "te", "trailer", "transfer-encoding", "upgrade",
})
"""Headers that carry the exchange itself (or a key): naming one as an identity would
make every client of the proxy one user, or a user of whatever the client sent there."""


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
    # Headers a trusted proxy in front sets (lower-case names; None: the level comes from
    # ``vllm_xargs`` as usual). A level with a header takes its name from that header
    # only: the body's field for it is replaced (``_header_identity``).
    user_header: str | None = None
    application_header: str | None = None
    end_user_header: str | None = None
    # A request without ``user_header`` is refused (HTTP 400) instead of paced as anonymous.
    require_user_header: bool = False
    # Lanes (``pacing._lanes``): in force under --scheduling-policy priority when running
    # has room beyond the active limit; None: off (``lanes: false``).
    lanes: LanePolicy | None = LanePolicy()
    # ``lanes`` was given as an object: the paced scheduler runs for lanes even with pacing
    # off (nobody is paced then).
    lanes_requested: bool = False

    @property
    def identity_headers(self) -> bool:
        """Whether some level's identity comes from a proxy's header."""
        return (self.user_header is not None or self.application_header is not None
                or self.end_user_header is not None)

    @property
    def enabled(self) -> bool:
        return self.limits is not None

    @property
    def runs_scheduler(self) -> bool:
        """Whether tokenpace's scheduler runs: pacing is on, or lanes were asked for."""
        return self.enabled or self.lanes_requested

    @classmethod
    def of_started(cls, vllm_config: Any) -> PacingConfig | None:
        """The configuration of an engine that has started, for the hooks that run in it
        afterwards: None where its section is invalid (start-up refused it, naming the
        key, in the process that reads it first; the others do nothing instead of
        reporting it again)."""
        try:
            return cls.from_additional_config(getattr(vllm_config, "additional_config", None))
        except ValueError:
            return None

    def headers_pace(self) -> bool:
        """Pacing is on and some level's identity comes from a proxy's header."""
        return self.enabled and self.identity_headers

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
        headers = _identity_headers(section, where)
        require = section.get(KEY_REQUIRE_USER_HEADER, False)
        if not isinstance(require, bool):
            raise PacingConfigError(f"{where}[{KEY_REQUIRE_USER_HEADER!r}] must be true or false")
        if require and headers[KEY_USER_HEADER] is None:
            raise PacingConfigError(f"{where}[{KEY_REQUIRE_USER_HEADER!r}] needs "
                                    f"{KEY_USER_HEADER!r} (the header that is required)")
        lanes, lanes_requested = _lanes(section.get(KEY_LANES, True), f"{where}[{KEY_LANES!r}]")
        default = section.get(KEY_DEFAULT)
        overrides_value = section.get(KEY_OVERRIDES)
        if default is None and not trusted:
            for key in (KEY_OVERRIDES, *HEADER_KEYS):
                if section.get(key) is not None:
                    raise PacingConfigError(
                        f"{where}[{key!r}] needs {KEY_DEFAULT!r} (or "
                        f"{KEY_TRUSTED_GATEWAY!r}): without a default rate pacing is off"
                    )
            return cls(limits=None, event_log=Path(event_log) if event_log else None,
                       idle_wait=idle_wait, metrics_users=metrics_users, lanes=lanes,
                       lanes_requested=lanes_requested)
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
            user_header=headers[KEY_USER_HEADER],
            application_header=headers[KEY_APPLICATION_HEADER],
            end_user_header=headers[KEY_END_USER_HEADER],
            require_user_header=require,
            lanes=lanes,
            lanes_requested=lanes_requested,
        )


def _lanes(value: Any, where: str) -> tuple[LanePolicy | None, bool]:
    """``lanes``: true (the default: on where the scheduling allows it), false (off), or
    an object ``{"min_share": X}`` (on, and the scheduler runs even with pacing off)."""
    if isinstance(value, bool):
        return (LanePolicy() if value else None), False
    if not isinstance(value, Mapping):
        raise PacingConfigError(f"{where} must be true, false or an object like "
                                f'{{"min_share": 0.1}}, got {type(value).__name__}')
    unknown = sorted(set(value) - {"min_share"})
    if unknown:
        raise PacingConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                                "the known key is 'min_share'")
    share = value.get("min_share", LanePolicy().min_share)
    if isinstance(share, bool) or not isinstance(share, (int, float)) \
            or not 0 <= share <= 0.5:
        raise PacingConfigError(f"{where}['min_share'] must be a number from 0 to 0.5, "
                                f"got {share!r}")
    return LanePolicy(float(share)), True


def validate_header_name(value: Any, where: str) -> str:
    """A header name an identity may come from, lower-cased (ASGI servers give them so).

    Raises ``PacingConfigError`` for a name that is not an HTTP token or that carries the
    exchange itself (``RESERVED_HEADERS``)."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise PacingConfigError(f"{where} must be an HTTP header name (letters, digits and "
                                f"!#$%&'*+-.^_`|~), got {value!r}")
    name = value.lower()
    if name in RESERVED_HEADERS or name.startswith("proxy-"):
        raise PacingConfigError(f"{where}: {name!r} carries the HTTP exchange itself and "
                                "cannot name a user; use a header of its own, e.g. x-tenant-id")
    return name


def _identity_headers(section: Mapping[str, Any], where: str) -> dict[str, str | None]:
    names: dict[str, str | None] = {}
    for key in HEADER_KEYS:
        value = section.get(key)
        names[key] = None if value is None else validate_header_name(value, f"{where}[{key!r}]")
    given = [name for name in names.values() if name is not None]
    if len(set(given)) != len(given):
        raise PacingConfigError(f"{where}: {', '.join(HEADER_KEYS)} must be different headers")
    return names


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
