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
from dataclasses import dataclass, field

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


class LaneStats:
    """One priority level's counters (``_lanes``); ``held`` is the last step's count."""

    __slots__ = ("held_steps", "yielded_steps", "admitted", "held")

    def __init__(self) -> None:
        self.held_steps = 0  # running request-steps held for a better priority
        self.yielded_steps = 0  # prompt chunks that sat out for a better priority's prefill
        self.admitted = 0  # requests admitted past the active limit by holding others
        self.held = 0  # requests held in the last step


MAX_LANES = 32
"""Priority levels with their own lane counters; the rest share ``OTHER_LANE``."""
OTHER_LANE = "other"


@dataclass(frozen=True)
class StatsSnapshot:
    """The counters at one instant (what a scrape reads)."""

    users: dict[str, tuple[int, int, int, int]]  # user -> (tokens, refunds, steps, ns)
    idle_waits: int
    idle_wait_ns: int
    folded: int  # distinct users counted under OTHER_USER
    # priority (or OTHER_LANE) -> (held request-steps, yielded chunks, admitted, held now)
    lanes: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)


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
        self._lanes: dict[str, LaneStats] = {}
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

    def lane(self, priority: int) -> LaneStats:
        """The counters of a priority level (the first ``MAX_LANES`` levels seen have
        their own; later ones share ``OTHER_LANE``). Cost: a dict lookup."""
        key = str(priority)
        entry = self._lanes.get(key)
        if entry is None:
            if len(self._lanes) >= MAX_LANES:
                key = OTHER_LANE
                entry = self._lanes.get(key)
            if entry is None:
                entry = self._lanes[key] = LaneStats()
        return entry

    def note_held(self, priorities: Iterable[int]) -> None:
        """The priorities of the requests held in this step (their gauges are set, the
        other levels' go to 0). Cost: a dict lookup per held request, one store per level."""
        for entry in self._lanes.values():
            entry.held = 0
        for p in priorities:
            entry = self.lane(p)
            entry.held += 1
            entry.held_steps += 1

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
        lanes = {p: (e.held_steps, e.yielded_steps, e.admitted, e.held)
                 for p, e in self._lanes.items()}
        return StatsSnapshot(users, self.idle_waits, self.idle_wait_ns, len(self._folded), lanes)
