"""The relay: a dispatched request's engine call and its answer passed to the client.

``call`` (non-streamed) and ``open_stream`` (server-sent events) end in
``Exchange.finish``; ``ClientWatch`` interrupts any wait when the client goes away or the
request's time runs out.
"""

from ._relay import NotReached, call, not_taken, open_stream
from ._watch import ClientWatch, Guard

__all__ = [
    "NotReached",
    "not_taken",
    "call",
    "ClientWatch",
    "Guard",
    "open_stream",
]
