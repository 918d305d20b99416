"""The ``state:`` and ``on_state_failure:`` keys of ``gateway.yaml``.

One replica keeps its budgets, slots and fair-queue counters in process (no ``state``
key). Several replicas share them in Redis: ``state: "redis://host:6379/0"`` (or
``rediss://`` for TLS, a password as ``redis://:secret@host:6379/0``), or a mapping when
the defaults do not fit::

    state:
      url: redis://redis:6379/0
      replicas: 3          # gateway processes sharing it: the fallback divides limits by this
      lease: 10s           # how long a crashed replica's slots stay taken
      timeout: 100ms       # longest wait on one Redis call
    on_state_failure: closed   # or open

Parsed here rather than in the gateway's own config module so that the state layer owns
its keys; ``gateway.config`` calls :func:`parse_state` with the two raw values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ...fairness import parse_duration

ON_FAILURE = ("closed", "open")
SCHEMES = ("redis", "rediss")


class StateConfigError(ValueError):
    """A bad ``state`` / ``on_state_failure`` value; the message names the key."""


@dataclass(frozen=True)
class StateConfig:
    """Where shared state lives; ``url=None`` means in process (one replica)."""

    url: str | None = None
    on_failure: str = "closed"
    replicas: int | None = None  # None: the number of worker processes (--workers)
    lease_s: float = 10.0
    timeout_s: float = 0.1

    @property
    def shared(self) -> bool:
        return self.url is not None

    def redacted_url(self) -> str | None:
        """The URL without its password, for logs and /health."""
        if self.url is None:
            return None
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        user = parts.username or ""
        netloc = f"{user}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return parts._replace(netloc=netloc).geturl()

    def fallback_divisor(self, workers: int) -> int:
        """What each limit is divided by while Redis is unreachable and the gateway runs open."""
        return self.replicas if self.replicas is not None else max(1, workers)


def parse_state(state: Any, on_failure: Any = None) -> StateConfig:
    """Validate the raw ``state`` and ``on_state_failure`` values of the configuration."""
    mode = "closed" if on_failure is None else on_failure
    if mode not in ON_FAILURE:
        raise StateConfigError(
            f"on_state_failure: expected 'closed' (refuse with 503 while the state store is "
            f"unreachable) or 'open' (admit under per-replica fallback limits), got {on_failure!r}")
    if state is None:
        return StateConfig(on_failure=mode)
    if isinstance(state, str):
        return StateConfig(url=_url(state, "state"), on_failure=mode)
    if not isinstance(state, Mapping):
        raise StateConfigError(
            f"state: expected a URL such as 'redis://host:6379/0' or a mapping with 'url', "
            f"got {type(state).__name__}")
    unknown = sorted(set(state) - {"url", "replicas", "lease", "timeout"})
    if unknown:
        raise StateConfigError(f"state.{unknown[0]}: unknown key (known: url, replicas, lease, timeout)")
    if "url" not in state:
        raise StateConfigError("state.url: required, e.g. 'redis://127.0.0.1:6379/0'")
    replicas = state.get("replicas")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int)
                                 or replicas < 1):
        raise StateConfigError(f"state.replicas: expected a whole number >= 1, got {replicas!r}")
    lease_s = _duration(state.get("lease", "10s"), "state.lease")
    timeout_s = _duration(state.get("timeout", "100ms"), "state.timeout")
    if lease_s < 1.0:
        raise StateConfigError(f"state.lease: at least 1s (renewals need room), got {state['lease']!r}")
    if timeout_s > lease_s / 4:
        raise StateConfigError("state.timeout: must be at most a quarter of state.lease, "
                               "or a slow renewal could let a live lease expire")
    return StateConfig(url=_url(state["url"], "state.url"), on_failure=mode, replicas=replicas,
                       lease_s=lease_s, timeout_s=timeout_s)


def check_workers(workers: int, config: StateConfig) -> str | None:
    """Why ``--workers N`` cannot run with this configuration, or None.

    Several processes with in-process state would each grant every budget and slot in
    full: N replicas would admit N times what one does.
    """
    if workers < 1:
        return f"--workers: expected a whole number >= 1, got {workers}"
    if workers > 1 and not config.shared:
        return (f"--workers {workers} needs shared state: set the configuration key 'state' "
                "(e.g. state: \"redis://127.0.0.1:6379/0\"), or every worker would grant each "
                "budget and concurrency limit in full")
    return None


def _url(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise StateConfigError(f"{where}: expected a URL such as 'redis://host:6379/0', got {value!r}")
    parts = urlsplit(value.strip())
    if parts.scheme not in SCHEMES:
        raise StateConfigError(
            f"{where}: expected a redis:// or rediss:// URL, got scheme {parts.scheme!r}")
    try:
        port = parts.port
    except ValueError:
        raise StateConfigError(f"{where}: the port is not a number in {value!r}") from None
    if not parts.hostname:
        raise StateConfigError(f"{where}: the URL names no host: {value!r}")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise StateConfigError(f"{where}: the database must be a number (redis://host:6379/0), got {db!r}")
    del port
    return value.strip()


def _duration(value: Any, where: str) -> float:
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise StateConfigError(f"{where}: {exc}") from None
    if not math.isfinite(seconds):
        raise StateConfigError(f"{where}: must be finite")
    return seconds
