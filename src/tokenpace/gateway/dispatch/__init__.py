"""Where admitted requests wait for an engine, and which engine each one goes to.

Engines grouped in pools per model, one fair queue per pool (lanes, weighted VTC), and the
``Lease`` a request holds on an engine slot from dispatch until it ends. ``Dispatcher``
keeps slots in this process; ``SharedDispatcher`` in the shared store, for several
replicas (``make_dispatcher`` picks by configuration). The engines themselves, their
membership, health, drain and load, are ``fleet``'s: each dispatcher owns one ``Fleet``,
which tells it of every change.
"""

from ._dispatcher import Dispatcher, Lease, Pool, QueueFull, Waiter
from ._shared import SharedDispatcher, make_dispatcher

__all__ = [
    "Dispatcher",
    "Lease",
    "make_dispatcher",
    "Pool",
    "QueueFull",
    "SharedDispatcher",
    "Waiter",
]
