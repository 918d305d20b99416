"""Where admitted requests wait for an engine, and which engine each one goes to.

Engines grouped in pools per model, one fair queue per pool (lanes, weighted VTC), and the
``Lease`` a request holds on an engine slot from dispatch until it ends. ``Dispatcher``
keeps slots in this process; ``SharedDispatcher`` in the shared store, for several
replicas (``make_dispatcher`` picks by configuration). Engines leave dispatch when their
health checks fail or at once when they refuse a connection, and come back when a probe
answers (``ProbeSchedule``).
"""

from ._dispatcher import (
    EJECT_LAST_AFTER,
    Dispatcher,
    EngineSlots,
    Lease,
    Pool,
    QueueFull,
    Waiter,
)
from ._health import (
    DOWN_AFTER_FAILURES,
    HEALTH_INTERVAL_S,
    HEALTH_TIMEOUT_S,
    PROBE_FIRST_S,
    ProbeSchedule,
    engine_retry_headers,
)
from ._shared import SharedDispatcher, make_dispatcher

__all__ = [
    "DOWN_AFTER_FAILURES",
    "EJECT_LAST_AFTER",
    "HEALTH_INTERVAL_S",
    "HEALTH_TIMEOUT_S",
    "PROBE_FIRST_S",
    "ProbeSchedule",
    "engine_retry_headers",
    "Dispatcher",
    "EngineSlots",
    "Lease",
    "make_dispatcher",
    "Pool",
    "QueueFull",
    "SharedDispatcher",
    "Waiter",
]
