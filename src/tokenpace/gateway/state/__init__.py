"""Where the gateway keeps budgets, slots and fair-queue counters: in process or in Redis.

One replica needs nothing shared (:class:`LocalStore`). Several replicas behind a load
balancer share one Redis (:class:`RedisStore`), so that together they admit no more than
one would, hold slots as leases that a crashed replica gives back by expiry, and order
their queues by the same virtual counters. ``on_state_failure`` (:class:`FailoverStore`)
says what happens while Redis does not answer. See docs/gateway/replicas.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ._base import (
    Admission,
    FairnessView,
    Reservation,
    SlotClaim,
    SlotRefusal,
    StateStore,
    StateUnavailable,
    StoreLease,
    engine_slot,
    lane_share_key,
    queued_slot,
    running_slot,
)
from ._config import StateConfig, StateConfigError, check_workers, parse_state
from ._local import LocalStore


def open_store(config: StateConfig, workers: int = 1,
               clock: Callable[[], float] = time.monotonic) -> StateStore:
    """The store a configuration asks for (call :meth:`StateStore.start` inside the loop)."""
    if not config.shared:
        return LocalStore(clock)
    from ._failover import FailoverStore
    from ._redis import RedisStore

    assert config.url is not None
    primary = RedisStore(config.url, lease_s=config.lease_s, timeout_s=config.timeout_s,
                         clock=clock)
    return FailoverStore(primary, config.on_failure,
                         LocalStore(clock, divisor=config.fallback_divisor(workers)))


_LAZY = {"RedisStore": "._redis", "FailoverStore": "._failover", "StateCollector": "._metrics"}


def __getattr__(name: str) -> object:
    """The Redis store and what wraps it, imported on first use: a gateway without a shared
    store never imports redis-py."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Admission",
    "FailoverStore",
    "FairnessView",
    "LocalStore",
    "RedisStore",
    "Reservation",
    "SlotClaim",
    "SlotRefusal",
    "StateConfig",
    "StateCollector",
    "StateConfigError",
    "StateStore",
    "StateUnavailable",
    "StoreLease",
    "check_workers",
    "engine_slot",
    "lane_share_key",
    "open_store",
    "parse_state",
    "queued_slot",
    "running_slot",
]
