"""How fast one tenant may send request bodies: a byte rate kept as a debt (GCRA).

Reading, parsing and forwarding a body costs the gateway's event loop and the engine's API
server time in proportion to its bytes, whatever the tokens it asks for; fields the engine
ignores cost it too. This bounds what one tenant can make them spend per second.

A body may start while its tenant owes less than ``TOLERANCE_S`` seconds of its rate; its
bytes are then added to the debt, whatever their number (any body up to ``max_body_bytes``
fits once). So a tenant averages at most the rate, and at once sends at most one body more
than ``TOLERANCE_S`` seconds of it (a body's declared length is charged before it is read,
so concurrent bodies see each other). The check needs no size: a refused body is refused
before it is read. Pure book-keeping on the caller's clock; a few float operations per
request; each gateway process keeps its own (replicas do not share it).
"""

from __future__ import annotations

TOLERANCE_S = 2.0
"""Seconds of its rate a tenant may owe and still start a body."""


class BodyRate:
    """One tenant's body bytes against ``rate`` (bytes per second)."""

    __slots__ = ("rate", "_paid_until")

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._paid_until = 0.0  # when the bytes charged so far are paid for at the rate

    def wait_s(self, now: float) -> float:
        """Seconds until a body may start (0.0: now)."""
        return max(0.0, self._paid_until - now - TOLERANCE_S)

    def charge(self, size: int, now: float) -> None:
        """``size`` bytes sent (or declared) now."""
        self._paid_until = max(self._paid_until, now) + size / self.rate
