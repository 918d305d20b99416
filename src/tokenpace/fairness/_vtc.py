"""Who is dispatched next: priority lanes, then the weighted Virtual Token Counter.

Three ideas stay separate: quota is admission's business (budgets), priority
picks the lane, fairness shares a lane between tenants.

Lanes are served in strict priority order (lower value first), except that a backlogged
lower lane whose share of the recently dispatched work fell below its ``min_share`` goes
first: strict priority alone would let a busy interactive lane starve batch work forever.
The share is measured in cost units of the dispatched requests' reservations (prompt plus
``max_tokens``) over a sliding window, not in requests: one long request can cost as much
as a hundred short ones, and the share has to be decided at dispatch, before the output
length is known.

Inside a lane, weighted VTC (Sheng et al., OSDI 2024): each tenant has a counter of the
service it received divided by its weight; the backlogged tenant with the smallest counter
goes next. The counter grows by the prompt cost at dispatch and by the completion cost of
each token as the stream reports it. A tenant that becomes backlogged is lifted to the
smallest counter among the lane's backlogged tenants (or, when none is, to the counter of
the last tenant that left the backlog), so time spent idle banks no credit. Counters are
already divided by the weight, so a weight change applies to future service only (smooth).
The queue is work-conserving: it never holds back an eligible request.

Inside a tenant, the same rule once more between its applications: each application has a
counter of the service it received divided by its weight (lifted when it becomes backlogged
to the smallest counter among the tenant's backlogged applications, or to the last one's
that left), and the tenant's next request is the oldest of its backlogged application with
the smallest counter. The two levels compose: the tenant level decides *which tenant*
(its counter counts every application's service), the application level *which of its
requests*. A tenant backlogged beside others receives its weighted share of the lane, and
an application backlogged beside its siblings its weighted share of its tenant's. Requests
of the tenant's own keys (no application) form one more application of weight 1. Within
an application it is first in, first out.

Several gateway replicas each keep a queue of the requests that reached them; they share
the counters (``set_counters``) and the lane costs (``set_lane_costs``) through a store,
so that service and dispatches on every replica count. The queue itself knows nothing of
the store: the dispatcher reads it and hands the values in.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)

_AHEAD = 1 << 62
"""Subtracted from the sequence number of an item pushed ``ahead``: it sorts before every
fresh item, and after the items pushed ahead before it."""

_COMPACT_SLACK = 32
"""A lane's heap is rebuilt from its backlog once it holds more than twice as many entries
as backlogged tenants plus this: stale entries (a counter charged while its tenant waits
pushes a new one) are dropped lazily, and this bounds what they can pile up to."""


@dataclass(frozen=True)
class LaneSpec:
    name: str
    priority: int = 0
    min_share: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_share < 1.0:
            raise ValueError(f"lane {self.name!r}: min_share must lie in [0, 1), got {self.min_share!r}")


@dataclass
class _Entry(Generic[T]):
    item: T
    seq: int
    prompt_cost: float
    estimate: float
    application: str | None = None


@dataclass
class _Application(Generic[T]):
    """One application of a tenant (``None``: the tenant's own keys)."""

    weight: float = 1.0
    counter: float = 0.0  # service / weight
    queue: deque[_Entry[T]] = field(default_factory=deque)


@dataclass
class _Tenant(Generic[T]):
    lane: str
    weight: float
    counter: float = 0.0  # service / weight
    queued_cost: float = 0.0
    waiting: int = 0
    stamp: int = 0  # bumped whenever its place in its lane's heap changes
    applications: dict[str | None, _Application[T]] = field(default_factory=dict)
    backlog: dict[str | None, _Application[T]] = field(default_factory=dict)
    last_left: float | None = None  # counter of the last application that left the backlog

    def application(self, application: str | None) -> _Application[T]:
        state = self.applications.get(application)
        if state is None:
            state = self.applications[application] = _Application()
        return state

    def head(self, fair: bool,
             eligible: Callable[[str | None], bool] | None = None) -> _Entry[T] | None:
        """The entry the tenant dispatches next: the oldest of the backlogged application
        with the smallest counter (the oldest of all in FCFS order) among those
        ``eligible`` accepts. O(1) with one application waiting, else O(applications
        waiting)."""
        backlog = self.backlog
        if len(backlog) == 1 and eligible is None:
            return next(iter(backlog.values())).queue[0]
        best: _Entry[T] | None = None
        best_key: tuple[float, int] | None = None
        for application, state in backlog.items():
            if eligible is not None and not eligible(application):
                continue
            entry = state.queue[0]
            key = (state.counter if fair else 0.0, entry.seq)
            if best_key is None or key < best_key:
                best, best_key = entry, key
        return best


@dataclass
class _Backlog(Generic[T]):
    """One lane's backlogged tenants, and a heap that orders them for dispatch.

    Heap entries are ``(counter, seq of the tenant's oldest request, stamp, tenant)`` (the
    counter is 0 in FCFS order); an entry whose stamp is not its tenant's current one is
    stale and skipped. Only tenants with waiting requests are here, so the cost of a choice
    depends on how many tenants wait, never on how many are configured.
    """

    tenants: dict[str, _Tenant[T]] = field(default_factory=dict)
    heap: list[tuple[float, int, int, str]] = field(default_factory=list)


class FairQueue(Generic[T]):
    """Waiting requests of one engine pool, in the order lanes and VTC dispatch them.

    ``fair=False`` turns the queue into first come, first served across tenants (lanes
    still apply): the baseline the fairness tests and benchmarks compare against.

    Cost: every operation is O(log w) in the ``w`` tenants waiting in a lane (a heap per
    lane), plus the tenants the dispatcher's ``eligible`` test turns down on the way; none
    depends on how many tenants are declared. Declaring one is a dict entry.
    """

    def __init__(self, lanes: Sequence[LaneSpec], clock: Callable[[], float],
                 share_window_s: float = 30.0, *, fair: bool = True, lift: bool = True) -> None:
        self._clock = clock
        self.share_window_s = share_window_s
        self._fair = fair
        self.lift = lift
        self._seq = count()
        self._tenants: dict[str, _Tenant[T]] = {}
        self._backlogs: dict[str, _Backlog[T]] = {}
        self._where: dict[T, tuple[str, _Entry[T]]] = {}
        self._last_left: dict[str, float] = {}
        self._window: deque[tuple[float, str, float]] = deque()
        self._window_cost: dict[str, float] = {}
        # Lane costs measured elsewhere (set_lane_costs), and what this queue dispatched
        # since they were handed in; None: the lane shares are this queue's own window.
        self._adopted: dict[str, float] | None = None
        self._since_adopted: dict[str, float] = {}
        self.set_lanes(lanes)

    # -- configuration ---------------------------------------------------------------

    @property
    def fair(self) -> bool:
        return self._fair

    @fair.setter
    def fair(self, value: bool) -> None:
        """Switch between VTC and FCFS order (the heaps are keyed on it: rebuilt)."""
        if value != self._fair:
            self._fair = value
            for backlog in self._backlogs.values():
                self._rebuild(backlog)

    def set_lanes(self, lanes: Sequence[LaneSpec]) -> None:
        self._lanes = sorted(lanes, key=lambda lane: lane.priority)
        self._lane_names = {lane.name for lane in self._lanes}
        for lane in self._lanes:
            self._backlogs.setdefault(lane.name, _Backlog())

    def set_tenant(self, tenant: str, lane: str, weight: float,
                   applications: Mapping[str, float] | None = None) -> None:
        """Declare or update a tenant, and the weights of its ``applications``. Counters
        are kept: a new weight only divides future service, so the change takes effect
        smoothly. An application not declared has weight 1."""
        if lane not in self._lane_names:
            raise ValueError(f"unknown lane {lane!r}")
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(lane, weight)
        else:
            state.weight = weight
            if state.lane != lane and not state.waiting:
                state.lane = lane
        if applications is not None:
            for name, app in state.applications.items():
                if name is not None and name not in applications:
                    app.weight = 1.0  # no longer declared (its requests may still wait)
            for application, app_weight in applications.items():
                state.application(application).weight = app_weight

    def declared(self, tenant: str) -> bool:
        return tenant in self._tenants

    def declared_tenants(self) -> list[str]:
        return list(self._tenants)

    # -- queue operations ------------------------------------------------------------

    def push(self, item: T, tenant: str, prompt_cost: float, estimate: float,
             application: str | None = None, ahead: bool = False) -> None:
        """Queue ``item`` of ``tenant`` (and of its ``application``, if any).
        ``prompt_cost`` is charged at dispatch; ``estimate`` (prompt + max output cost) is
        what the lane shares count.

        ``ahead``: an item that was dispatched already and comes back (its engine failed
        before it got the request): first in its tenant's and application's order, and
        before every fresh item in first-come order; among tenants, its tenant's counter
        places it as any other (it was charged at its first dispatch, pass 0 costs)."""
        state = self._tenants[tenant]
        seq = next(self._seq)
        entry = _Entry(item, seq - _AHEAD if ahead else seq, prompt_cost, estimate, application)
        app = state.application(application)
        if not app.queue:
            # Application level: lifted like a tenant, always here (the shared store keeps
            # tenant counters only, so replicas lift applications each on their own).
            floor = (min(a.counter for a in state.backlog.values()) if state.backlog
                     else state.last_left)
            if floor is not None and floor > app.counter:
                app.counter = floor
            state.backlog[application] = app
        if ahead:
            # After the items sent back before it (a few at most), before the rest.
            queue = app.queue
            at = 0
            while at < len(queue) and queue[at].seq < 0:
                at += 1
            queue.insert(at, entry)
        else:
            app.queue.append(entry)
        state.waiting += 1
        if state.waiting == 1:
            if self.lift:
                floor = self._lift_floor(state.lane)
                if floor is not None and floor > state.counter:
                    state.counter = floor
            self._backlogs[state.lane].tenants[tenant] = state
            self._place(tenant, state)
        elif ahead:
            self._place(tenant, state)  # its head, and so its place in the lane, changed
        state.queued_cost += estimate
        self._where[item] = (tenant, entry)

    def remove(self, item: T) -> bool:
        """Take a waiting item out (cancelled, timed out); False if it is not queued.
        O(its application's queue)."""
        where = self._where.pop(item, None)
        if where is None:
            return False
        tenant, entry = where
        self._unlink(tenant, self._tenants[tenant], entry)
        return True

    def pop(self, eligible: Callable[[str], bool] = lambda tenant: True,
            eligible_application: Callable[[str, str], bool] | None = None) -> T | None:
        """The next item to dispatch among tenants for which ``eligible(tenant)`` holds
        (and, inside a tenant, applications for which ``eligible_application(tenant,
        application)`` holds; the tenant's own requests always may go)."""
        now = self._clock()
        self._trim(now)
        chosen = self._choose(eligible, eligible_application)
        if chosen is None:
            return None
        tenant, state, entry = chosen
        del self._where[entry.item]
        self._serve(state, entry.application, entry.prompt_cost)
        self._unlink(tenant, state, entry)
        self._count(now, state.lane, entry.estimate)
        return entry.item

    def peek(self, eligible: Callable[[str], bool] = lambda tenant: True,
             eligible_application: Callable[[str, str], bool] | None = None) -> T | None:
        """The item ``pop`` would return, left in the queue.

        For a dispatcher that must ask someone else before it dispatches (gateway replicas
        take a global slot in a shared store first): ``take`` it once the answer is yes.
        Same cost as ``pop``'s choice."""
        self._trim(self._clock())
        chosen = self._choose(eligible, eligible_application)
        return None if chosen is None else chosen[2].item

    def take(self, item: T) -> bool:
        """Dispatch ``item`` (chosen by ``peek``) with ``pop``'s accounting: its prompt cost
        on its tenant's and application's counters, its estimate in its lane's share. False
        when it is no longer queued (removed while the dispatcher was asking).
        O(its application's queue)."""
        where = self._where.pop(item, None)
        if where is None:
            return False
        tenant, entry = where
        state = self._tenants[tenant]
        self._serve(state, entry.application, entry.prompt_cost)
        self._unlink(tenant, state, entry)
        self._count(self._clock(), state.lane, entry.estimate)
        return True

    def charge(self, tenant: str, cost: float, application: str | None = None) -> None:
        """Service delivered to ``tenant`` (and its ``application``) after dispatch (output
        tokens as they stream). O(1), or O(log w) while the tenant also has requests
        waiting (its place moves)."""
        state = self._tenants.get(tenant)
        if state is not None:
            self._serve(state, application, cost)
            if state.waiting and self._fair:
                self._place(tenant, state)

    @staticmethod
    def _serve(state: _Tenant[T], application: str | None, cost: float) -> None:
        """Service on the tenant's counter and its application's (each by its weight)."""
        state.counter += cost / state.weight
        app = state.applications.get(application)
        if app is not None:
            app.counter += cost / app.weight

    def set_counters(self, counters: Mapping[str, float]) -> None:
        """Adopt counters kept elsewhere (several gateway replicas share them in a store).

        A replica dispatches among its own waiting requests by the shared counters, so a
        tenant's service on every replica counts; the store also does the lift (construct
        the queue with ``lift=False`` then). Unknown tenants are ignored.
        O(len(counters) x log w).
        """
        for tenant, value in counters.items():
            state = self._tenants.get(tenant)
            if state is not None and state.counter != value:
                state.counter = value
                if state.waiting and self._fair:
                    self._place(tenant, state)

    def set_lane_costs(self, costs: Mapping[str, float] | None) -> None:
        """Adopt each lane's cost dispatched within the window as measured elsewhere
        (several gateway replicas count every replica's dispatches in a store), or with
        None go back to this queue's own window.

        Until the next call the lane choice uses these costs plus what this queue
        dispatches meanwhile, so that several dispatches between two readings still move
        the shares. Lanes missing from ``costs`` count 0. ``lane_costs`` keeps reporting
        this queue's own window. O(lanes).
        """
        self._adopted = None if costs is None else dict(costs)
        self._since_adopted = {}

    def shares_matter(self) -> bool:
        """Whether the next choice may depend on the lane shares: two or more lanes have
        waiting requests and one below the first has a ``min_share``. Otherwise the
        lane costs need not be fresh (a dispatcher reads shared ones only then). O(lanes)."""
        ready = [lane for lane in self._lanes if self._backlogs[lane.name].tenants]
        return len(ready) >= 2 and any(lane.min_share > 0 for lane in ready[1:])

    # -- observation -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._where)

    def counter(self, tenant: str) -> float:
        return self._tenants[tenant].counter

    def application_counter(self, tenant: str, application: str | None) -> float:
        """An application's counter inside its tenant (service / its weight)."""
        app = self._tenants[tenant].applications.get(application)
        return 0.0 if app is None else app.counter

    def queued(self, tenant: str) -> tuple[int, float]:
        """(requests, estimated cost) waiting for ``tenant``."""
        state = self._tenants.get(tenant)
        return (state.waiting, state.queued_cost) if state else (0, 0.0)

    def backlogged(self) -> Iterator[tuple[str, str]]:
        """``(tenant, lane)`` of every tenant with a waiting request. O(w)."""
        for lane, backlog in self._backlogs.items():
            for tenant in backlog.tenants:
                yield tenant, lane

    def debt(self, tenant: str) -> float:
        """Counter minus the smallest counter among the lane's backlogged tenants: how far
        ahead of the neediest competitor this tenant is (0 when nobody else waits)."""
        state = self._tenants.get(tenant)
        if state is None:
            return 0.0
        floor = self._backlog_floor(state.lane)
        return 0.0 if floor is None else state.counter - floor

    def lane_costs(self) -> dict[str, float]:
        """Each lane's estimated cost dispatched within the sliding window."""
        self._trim(self._clock())
        return {lane.name: max(0.0, self._window_cost.get(lane.name, 0.0)) for lane in self._lanes}

    def lane_shares(self) -> dict[str, float]:
        """Each lane's fraction of the cost dispatched within the sliding window."""
        costs = self.lane_costs()
        total = sum(costs.values())
        return {lane: (cost / total if total else 0.0) for lane, cost in costs.items()}

    # -- internals -------------------------------------------------------------------

    def _place(self, tenant: str, state: _Tenant[T]) -> None:
        """(Re)insert a backlogged tenant in its lane's heap at its current key."""
        state.stamp += 1
        backlog = self._backlogs[state.lane]
        head = state.head(self._fair)
        assert head is not None
        heapq.heappush(backlog.heap, (state.counter if self._fair else 0.0,
                                      head.seq, state.stamp, tenant))
        if len(backlog.heap) > 2 * len(backlog.tenants) + _COMPACT_SLACK:
            self._rebuild(backlog)

    def _rebuild(self, backlog: _Backlog[T]) -> None:
        """The heap from the lane's backlog alone (drops every stale entry). O(w)."""
        backlog.heap = [(s.counter if self._fair else 0.0, s.head(self._fair).seq,  # type: ignore[union-attr]
                         s.stamp, t) for t, s in backlog.tenants.items()]
        heapq.heapify(backlog.heap)

    def _unlink(self, tenant: str, state: _Tenant[T], entry: _Entry[T]) -> None:
        """``entry`` leaves ``tenant``'s queue; the tenant's place follows (O(log w))."""
        app = state.backlog[entry.application]
        head = app.queue[0] is entry
        if head:
            app.queue.popleft()
        else:
            app.queue.remove(entry)
        if not app.queue:
            del state.backlog[entry.application]
            state.last_left = app.counter
        state.waiting -= 1
        state.queued_cost -= entry.estimate
        if not state.waiting:
            state.stamp += 1  # its heap entries are stale now
            del self._backlogs[state.lane].tenants[tenant]
            self._last_left[state.lane] = state.counter
        elif head:
            self._place(tenant, state)

    def _top(self, backlog: _Backlog[T]) -> tuple[float, int, int, str] | None:
        """The lane's first valid heap entry (stale ones above it are dropped)."""
        heap = backlog.heap
        while heap:
            top = heap[0]
            state = backlog.tenants.get(top[3])
            if state is not None and state.stamp == top[2]:
                return top
            heapq.heappop(heap)
        return None

    def _backlog_floor(self, lane: str) -> float | None:
        """The smallest counter among the lane's backlogged tenants (None: none waits)."""
        backlog = self._backlogs.get(lane)
        if backlog is None or not backlog.tenants:
            return None
        if self._fair:
            top = self._top(backlog)
            return None if top is None else top[0]
        return min(s.counter for s in backlog.tenants.values())  # FCFS order: no heap on it

    def _lift_floor(self, lane: str) -> float | None:
        floor = self._backlog_floor(lane)
        return floor if floor is not None else self._last_left.get(lane)

    def _candidate(self, backlog: _Backlog[T], eligible: Callable[[str], bool],
                   eligible_application: Callable[[str, str], bool] | None,
                   ) -> tuple[str, _Tenant[T], _Entry[T]] | None:
        """The lane's first tenant in heap order that ``eligible`` accepts (with an
        application ``eligible_application`` accepts, or its own requests, waiting), and
        the entry it dispatches. Those turned down are set aside and put back:
        O((1 + turned down) x log w)."""
        heap = backlog.heap
        aside: list[tuple[float, int, int, str]] = []
        found: tuple[str, _Tenant[T], _Entry[T]] | None = None
        while heap:
            top = heapq.heappop(heap)
            state = backlog.tenants.get(top[3])
            if state is None or state.stamp != top[2]:
                continue  # stale
            aside.append(top)
            if not eligible(top[3]):
                continue
            tenant = top[3]
            if eligible_application is None or (len(state.backlog) == 1 and None in state.backlog):
                entry = state.head(self._fair)
            else:
                entry = state.head(self._fair, lambda app: app is None
                                   or eligible_application(tenant, app))
            if entry is not None:
                found = (tenant, state, entry)
                break
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def _count(self, now: float, lane: str, estimate: float) -> None:
        """A dispatch's estimate in the lane shares: own window and, with adopted costs,
        on top of those."""
        self._window.append((now, lane, estimate))
        self._window_cost[lane] = self._window_cost.get(lane, 0.0) + estimate
        if self._adopted is not None:
            self._since_adopted[lane] = self._since_adopted.get(lane, 0.0) + estimate

    def _share_costs(self) -> Mapping[str, float]:
        """The lane costs the lane choice goes by (adopted plus dispatched since, or own)."""
        if self._adopted is None:
            return self._window_cost
        since = self._since_adopted
        return {lane: self._adopted.get(lane, 0.0) + since.get(lane, 0.0)
                for lane in self._lane_names}

    def _trim(self, now: float) -> None:
        horizon = now - self.share_window_s
        while self._window and self._window[0][0] < horizon:
            _, lane, cost = self._window.popleft()
            self._window_cost[lane] -= cost

    def _choose(self, eligible: Callable[[str], bool],
                eligible_application: Callable[[str, str], bool] | None = None,
                ) -> tuple[str, _Tenant[T], _Entry[T]] | None:
        """Lanes in priority order: the first with an eligible tenant, unless a lane below
        it with an eligible tenant has fallen under its ``min_share`` (the first such)."""
        first: tuple[str, _Tenant[T], _Entry[T]] | None = None
        total: float | None = None
        costs: Mapping[str, float] = {}
        for lane in self._lanes:
            backlog = self._backlogs[lane.name]
            if not backlog.tenants:
                continue
            if first is None:
                first = self._candidate(backlog, eligible, eligible_application)
                continue
            if total is None:
                costs = self._share_costs()
                total = sum(costs.values())
            if costs.get(lane.name, 0.0) < lane.min_share * total:
                protected = self._candidate(backlog, eligible, eligible_application)
                if protected is not None:
                    return protected
        return first
