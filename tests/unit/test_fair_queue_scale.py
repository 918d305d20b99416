"""The fair queue's choice costs what the waiting tenants cost, not what is declared.

The queue keeps a heap per lane over the tenants that wait. Two kinds of check:

- the same choices as the definition: a reference that scans every declared tenant, as
  the queue did before (lanes in priority order with ``min_share``, the smallest counter,
  then the oldest request; the lift), driven through random operations side by side;
- structure, not time: with 10,000 tenants declared and three waiting, a dispatch asks
  ``eligible`` about the waiting ones only.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from tokenpace.fairness import FairQueue, LaneSpec

LANES = [LaneSpec("hi", 0, 0.0), LaneSpec("lo", 10, 0.2)]


@dataclass
class _RefTenant:
    lane: str
    weight: float
    counter: float = 0.0
    queue: deque = field(default_factory=deque)  # (item, seq, prompt, estimate)


class Reference:
    """The queue's documented order by scanning every declared tenant on each choice."""

    def __init__(self, lanes: list[LaneSpec], window_s: float, fair: bool = True) -> None:
        self.lanes = sorted(lanes, key=lambda lane: lane.priority)
        self.window_s, self.fair = window_s, fair
        self.tenants: dict[str, _RefTenant] = {}
        self.last_left: dict[str, float] = {}
        self.window: list[tuple[float, str, float]] = []
        self.seq = 0

    def set_tenant(self, name: str, lane: str, weight: float) -> None:
        state = self.tenants.setdefault(name, _RefTenant(lane, weight))
        state.weight = weight
        if not state.queue:
            state.lane = lane

    def floor(self, lane: str) -> float | None:
        backlogged = [s.counter for s in self.tenants.values() if s.lane == lane and s.queue]
        return min(backlogged) if backlogged else None

    def push(self, item: int, name: str, prompt: float, estimate: float) -> None:
        state = self.tenants[name]
        if not state.queue:
            floor = self.floor(state.lane)
            floor = self.last_left.get(state.lane) if floor is None else floor
            if floor is not None and floor > state.counter:
                state.counter = floor
        state.queue.append((item, self.seq, prompt, estimate))
        self.seq += 1

    def remove(self, item: int) -> bool:
        for state in self.tenants.values():
            for entry in state.queue:
                if entry[0] == item:
                    state.queue.remove(entry)
                    if not state.queue:
                        self.last_left[state.lane] = state.counter
                    return True
        return False

    def charge(self, name: str, cost: float) -> None:
        self.tenants[name].counter += cost / self.tenants[name].weight

    def pop(self, now: float, eligible) -> int | None:
        self.window = [w for w in self.window if w[0] >= now - self.window_s]
        ready = [lane for lane in self.lanes
                 if any(s.lane == lane.name and s.queue and eligible(t)
                        for t, s in self.tenants.items())]
        if not ready:
            return None
        costs: dict[str, float] = {}
        for _, lane, cost in self.window:
            costs[lane] = costs.get(lane, 0.0) + cost
        total = sum(costs.values())
        chosen = ready[0].name
        for lane in ready[1:]:
            if costs.get(lane.name, 0.0) < lane.min_share * total:
                chosen = lane.name
                break
        name = min((t for t, s in self.tenants.items()
                    if s.lane == chosen and s.queue and eligible(t)),
                   key=lambda t: (self.tenants[t].counter if self.fair else 0.0,
                                  self.tenants[t].queue[0][1]))
        state = self.tenants[name]
        item, _, prompt, estimate = state.queue.popleft()
        state.counter += prompt / state.weight
        if not state.queue:
            self.last_left[chosen] = state.counter
        self.window.append((now, chosen, estimate))
        return item


@pytest.mark.parametrize("fair", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_operations_choose_what_the_scan_of_every_tenant_chooses(seed: int,
                                                                         fair: bool) -> None:
    rng = random.Random(seed)
    now = [0.0]
    queue: FairQueue[int] = FairQueue(LANES, lambda: now[0], share_window_s=5.0, fair=fair)
    ref = Reference(LANES, 5.0, fair)
    names = [f"t{i}" for i in range(12)]
    for i, name in enumerate(names):
        lane, weight = LANES[i % 2].name, float(1 + i % 3)
        queue.set_tenant(name, lane, weight)
        ref.set_tenant(name, lane, weight)
    queued: list[int] = []
    blocked: set[str] = set()
    for item in range(600):
        now[0] += rng.random() * 0.2
        op = rng.random()
        if op < 0.45:
            name = rng.choice(names)
            prompt, estimate = float(rng.randint(1, 20)), float(rng.randint(20, 80))
            queue.push(item, name, prompt, estimate)
            ref.push(item, name, prompt, estimate)
            queued.append(item)
        elif op < 0.75:
            if rng.random() < 0.3:
                blocked = set(rng.sample(names, 4))
            got = queue.pop(lambda t: t not in blocked)
            assert got == ref.pop(now[0], lambda t: t not in blocked)
            if got is not None:
                queued.remove(got)
        elif op < 0.85 and queued:
            victim = rng.choice(queued)
            assert queue.remove(victim) and ref.remove(victim)
            queued.remove(victim)
        else:
            name, cost = rng.choice(names), float(rng.randint(1, 30))
            queue.charge(name, cost)
            ref.charge(name, cost)
        for name in names:
            assert queue.counter(name) == pytest.approx(ref.tenants[name].counter)
    assert len(queue) == len(queued)


def test_a_choice_asks_only_about_waiting_tenants_whatever_is_declared() -> None:
    queue: FairQueue[int] = FairQueue(LANES, lambda: 0.0)
    for i in range(10_000):
        queue.set_tenant(f"t{i}", LANES[i % 2].name, 1.0 + i % 3)
    for item, name in enumerate(["t1", "t3", "t5"]):
        queue.push(item, name, 1.0, 10.0)
    asked: list[str] = []

    def eligible(tenant: str) -> bool:
        asked.append(tenant)
        return tenant != "t1"  # the first in line is turned down: the next is asked

    assert queue.pop(eligible) == 1
    assert asked == ["t1", "t3"]
    assert sorted(queue.backlogged()) == [("t1", "lo"), ("t5", "lo")]


def test_charges_while_waiting_keep_the_heap_bounded() -> None:
    """Each charge of a waiting tenant moves its place (a new heap entry); the stale ones
    are dropped so the heap stays within twice the waiting tenants plus a constant."""
    queue: FairQueue[int] = FairQueue(LANES, lambda: 0.0)
    for i in range(10):
        queue.set_tenant(f"t{i}", "hi", 1.0)
        queue.push(i, f"t{i}", 1.0, 10.0)
    for step in range(10_000):
        queue.charge(f"t{step % 10}", 1.0)
    backlog = queue._backlogs["hi"]
    assert len(backlog.heap) <= 2 * 10 + 32
    assert [queue.pop() for _ in range(10)] == list(range(10))  # equal counters: oldest first
