"""What pacing did, per user, for the engine's ``/metrics``: counters that only grow.

The planner counts as it decides: the tokens it dispatched (charges that were not
refunded), the refunds, the request-steps it throttled, and how long each user had work
waiting for quota. The counts outlive a user's requests (a Prometheus counter must not go
back), so they cannot live in the planner's per-user accounts, which go when a user has
nothing running. Labels must stay bounded: the first ``max_users`` users seen (configured
ones first) get their own entry, every later one shares the entry ``OTHER_USER``
(``__other__``).

Cost on the step: the planner holds each user's entry in its account, so a dispatched
token is one attribute increment; throttling and refunds, off the common path, one each.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

OTHER_USER = "__other__"
"""The label of every user past ``max_users`` (a user with this very id counts there too,
so a label never means two things)."""
DEFAULT_MAX_USERS = 1000


class UserStats:
    """One user's (or ``OTHER_USER``'s) counters."""

    __slots__ = ("tokens", "refunds", "throttled_steps", "throttled_ns")

    def __init__(self) -> None:
        self.tokens = 0  # output tokens dispatched to sample (charges minus refunds)
        self.refunds = 0  # charges returned at the refund point
        self.throttled_steps = 0  # request-steps skipped for lack of quota
        self.throttled_ns = 0  # time during which the user had work waiting for quota


@dataclass(frozen=True)
class StatsSnapshot:
    """The counters at one instant (what a scrape reads)."""

    users: dict[str, tuple[int, int, int, int]]  # user -> (tokens, refunds, steps, ns)
    idle_waits: int
    idle_wait_ns: int
    folded: int  # distinct users counted under OTHER_USER


class PacingStats:
    """Per-user counters with a bounded label set, and the engine's idle waits."""

    def __init__(self, max_users: int = DEFAULT_MAX_USERS,
                 first: Iterable[str] = ()) -> None:
        if max_users < 1:
            raise ValueError(f"max_users must be at least 1, got {max_users!r}")
        self.max_users = max_users
        self._users: dict[str, UserStats] = {}
        self._other = UserStats()
        self._folded: set[str] = set()
        self.idle_waits = 0
        self.idle_wait_ns = 0
        for user in first:
            self.of(user)

    def of(self, user: str) -> UserStats:
        """The entry ``user`` counts into (looked up once per user per account)."""
        entry = self._users.get(user)
        if entry is not None:
            return entry
        if len(self._users) < self.max_users and user != OTHER_USER:
            entry = self._users[user] = UserStats()
            return entry
        if len(self._folded) < 10 * self.max_users:  # a count, itself bounded
            self._folded.add(user)
        return self._other

    def note_idle_wait(self, waited_ns: int) -> None:
        """The engine loop waited ``waited_ns`` for quota instead of stepping."""
        self.idle_waits += 1
        self.idle_wait_ns += waited_ns

    def snapshot(self) -> StatsSnapshot:
        users = {u: (s.tokens, s.refunds, s.throttled_steps, s.throttled_ns)
                 for u, s in self._users.items()}
        other = self._other
        if self._folded:
            users[OTHER_USER] = (other.tokens, other.refunds, other.throttled_steps,
                                 other.throttled_ns)
        return StatsSnapshot(users, self.idle_waits, self.idle_wait_ns, len(self._folded))
