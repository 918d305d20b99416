"""One request in flight: its book (``Exchange``), how it ended (``Outcome``), and the
``Runtime`` every request handler shares.

Admission writes what it reserved onto the exchange, the relay what the engine generated;
``Exchange.finish``, the one exit of every request past authentication, settles it: the
slot back, budgets settled to the actual cost, metrics counted, one ledger row.
"""

from ._exchange import Exchange, Outcome, settle_in_store
from ._runtime import Runtime

__all__ = [
    "Exchange",
    "Outcome",
    "Runtime",
    "settle_in_store",
]
