"""Where admitted requests wait for an engine, and which engine each one goes to.

Engines grouped in pools per model, one fair queue per pool (lanes, weighted VTC), and the
``Lease`` a request holds on an engine slot from dispatch until it ends. ``Dispatcher``
keeps slots in this process; ``SharedDispatcher`` in the shared store, for several
replicas (``make_dispatcher`` picks by configuration).
"""

from ._dispatcher import Dispatcher, EngineSlots, Lease, Pool, QueueFull, Waiter
from ._shared import SharedDispatcher, make_dispatcher

__all__ = [
    "Dispatcher",
    "EngineSlots",
    "Lease",
    "make_dispatcher",
    "Pool",
    "QueueFull",
    "SharedDispatcher",
    "Waiter",
]
