"""Per-user output-rate table: a default rate plus per-user overrides.

Parsing is strict because the table arrives from command-line flags, JSON files and a
gateway: a typo such as ``"100"`` (a string) or ``0`` must stop start-up with a message
that names the problem, not silently pace someone at an unexpected rate.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

MAX_USER_ID_LENGTH = 256


class LimitsError(ValueError):
    """A rate table or one of its values is invalid; the message says which and why."""


def validate_rate(value: Any, what: str) -> float:
    """Return ``value`` as a float if it is a finite, positive number of tokens per second.

    Booleans are refused although Python treats them as ints: ``true`` in a JSON limits
    file is a mistake, not a rate of one token per second. An integer too large for a
    float (JSON allows ``1`` followed by 400 zeros) counts as infinite, so that it is
    refused with ``LimitsError`` like any other bad rate instead of escaping as
    ``OverflowError`` into the engine or the HTTP guard.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LimitsError(
            f"{what}: rate must be a number of tokens per second, got {value!r}"
        )
    try:
        rate = float(value)
    except OverflowError:
        rate = math.inf
    if not math.isfinite(rate) or rate <= 0:
        raise LimitsError(
            f"{what}: rate must be a finite number greater than 0, got {value!r}"
        )
    return rate


MAX_RATE_VERSION = 2**63 - 1


def validate_rate_version(value: Any, what: str) -> int | None:
    """Return a rate's version (None when absent): an integer from 0 to 2**63 - 1.

    A gateway numbers each change of a user's rate so that the engine can tell a late,
    older rate from the current one; a float or a string there is a bug in the sender,
    refused rather than rounded.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RATE_VERSION:
        raise LimitsError(f"{what}: a rate version must be an integer from 0 to 2**63 - 1, "
                          f"got {value!r}")
    return value

def validate_user_id(user: Any, what: str = "user id") -> str:
    """Return ``user`` if it is a usable identity: a non-empty string of bounded length."""
    if not isinstance(user, str):
        raise LimitsError(f"{what} must be a string, got {type(user).__name__}")
    if not user:
        raise LimitsError(f"{what} must not be empty")
    if len(user) > MAX_USER_ID_LENGTH:
        raise LimitsError(
            f"{what} is {len(user)} characters long; at most {MAX_USER_ID_LENGTH} are allowed"
        )
    return user


@dataclass(frozen=True)
class UserRateLimits:
    """Output-token rate per user, in tokens per second.

    ``default`` applies to every user without an override; ``None`` means such users are
    not paced at all. The table is immutable so that a scheduler can swap a whole new
    table in atomically when limits are reloaded.
    """

    default: float | None
    overrides: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.default is not None:
            object.__setattr__(self, "default", validate_rate(self.default, "default rate"))
        checked: dict[str, float] = {}
        for user, rate in dict(self.overrides).items():
            validate_user_id(user, "user id in the rate overrides")
            checked[user] = validate_rate(rate, f"rate of user {user!r}")
        object.__setattr__(self, "overrides", MappingProxyType(checked))

    def __reduce__(self) -> tuple[Any, ...]:
        # The read-only view cannot be pickled; the engine core runs in another process.
        return (type(self), (self.default, dict(self.overrides)))

    def rate(self, user: str) -> float | None:
        """Tokens per second allowed to ``user``, or ``None`` if it is not paced."""
        return self.overrides.get(user, self.default)

    @classmethod
    def from_json(cls, text: str, default: float | None = None) -> UserRateLimits:
        """Limits from an inline JSON object of user id -> tokens per second,
        ``'{"user-a": 100, "user-b": 500}'``; anything else is a ``LimitsError``."""
        return cls(default=default, overrides=parse_overrides_json(text))

    @classmethod
    def from_file(cls, path: str | Path, default: float | None = None) -> UserRateLimits:
        """Read overrides from a JSON file holding one object of user -> rate."""
        return cls(default=default, overrides=read_overrides_file(path))


def validate_overrides(data: Any, source: str = "user rate overrides") -> dict[str, float]:
    """Check an already-parsed object of user id -> tokens per second."""
    if not isinstance(data, Mapping):
        raise LimitsError(
            f"{source}: expected a JSON object of user id -> tokens per second, "
            f"got {type(data).__name__}"
        )
    result: dict[str, float] = {}
    for user, rate in data.items():
        validate_user_id(user, f"{source}: user id")
        result[user] = validate_rate(rate, f"{source}: rate of user {user!r}")
    return result


def parse_overrides_json(text: str, source: str = "user rate overrides") -> dict[str, float]:
    """Parse a JSON object of user id -> tokens per second, refusing anything else."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LimitsError(
            f"{source}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    return validate_overrides(data, source)


def read_overrides_file(path: str | Path) -> dict[str, float]:
    """Read and parse a limits file; unreadable files are reported like bad content."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise LimitsError(f"cannot read limits file {str(p)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise LimitsError(f"limits file {str(p)!r} is not UTF-8 text") from None
    return parse_overrides_json(text, source=f"limits file {str(p)!r}")


def limits_file_of(value: str) -> Path | None:
    """The file named by an ``@/path/limits.json`` value, or None for inline JSON."""
    if not value.startswith("@"):
        return None
    if len(value) == 1:
        raise LimitsError("'@' must be followed by the path of a limits file")
    return Path(value[1:])


def parse_overrides_arg(value: str, source: str = "user rate overrides") -> dict[str, float]:
    """Parse a flag value: inline JSON, or ``@/path/limits.json`` to read a file."""
    path = limits_file_of(value)
    if path is not None:
        return read_overrides_file(path)
    return parse_overrides_json(value, source)
