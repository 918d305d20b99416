"""The relay: a dispatched request's engine call and its answer passed to the client.

``call`` (non-streamed) and ``open_stream`` (server-sent events) end in
``Exchange.finish``; ``ClientWatch`` interrupts any wait when the client goes away or the
request's time runs out; ``ClientPipe`` feeds a client that reads slower than its engine
writes from memory, so the engine's slot goes back once its answer is complete. A request
cut short before the engine's final usage is settled
with what the engine says it generated; ``ask_engine_counts`` is that question, for any
caller that holds a gateway request id (crash recovery of the ledger's open rows).
"""

from ._counts import ask_engine_counts
from ._pipe import ClientPipe
from ._relay import NotReached, call, not_taken, open_stream
from ._watch import ClientWatch, Guard

__all__ = [
    "ask_engine_counts",
    "ClientPipe",
    "NotReached",
    "not_taken",
    "call",
    "ClientWatch",
    "Guard",
    "open_stream",
]
