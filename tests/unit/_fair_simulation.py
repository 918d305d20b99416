"""A deterministic engine-and-queue simulation for fairness checks (no clock, no I/O).

The engine holds up to ``batch`` requests; every step each running request generates one
token, and a request leaves when it has generated its output. Waiting requests are
dispatched by a ``FairQueue`` whenever a batch slot is free, and service is metered as the
VTC paper does: ``cost.prompt x prompt`` at dispatch, ``cost.completion`` per generated
token. Tests reproduce the paper's cases with it; ``fair=False`` is the FCFS baseline.
It lives with the tests because nothing in the product runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenpace.fairness import CostModel, FairQueue, LaneSpec

# step -> requests arriving at that step, as (prompt_tokens, output_tokens)
Arrivals = Callable[[int], Sequence[tuple[int, int]]]


@dataclass(frozen=True)
class SimTenant:
    name: str
    arrivals: Arrivals
    weight: float = 1.0
    lane: str = "default"


@dataclass
class SimResult:
    steps: int
    service: dict[str, list[float]]       # cumulative service per tenant, after each step
    backlogged: dict[str, list[bool]]     # had a request waiting or running at that step
    dispatched: dict[str, list[float]] = field(default_factory=dict)  # cumulative estimate per lane

    def weighted_difference(self, a: str, b: str, weights: dict[str, float]) -> list[float]:
        """|S_a / w_a - S_b / w_b| at each step where both tenants were backlogged."""
        return [abs(sa / weights[a] - sb / weights[b])
                for sa, sb, ba, bb in zip(self.service[a], self.service[b],
                                          self.backlogged[a], self.backlogged[b])
                if ba and bb]


@dataclass
class _Running:
    tenant: str
    left: int


def simulate(tenants: Sequence[SimTenant], steps: int, batch: int, cost: CostModel,
             lanes: Sequence[LaneSpec] = (LaneSpec("default"),), *, fair: bool = True,
             lift: bool = True, share_window: float = 200.0) -> SimResult:
    now = [0.0]
    queue: FairQueue[int] = FairQueue(lanes, lambda: now[0], share_window, fair=fair, lift=lift)
    for t in tenants:
        queue.set_tenant(t.name, t.lane, t.weight)
    lane_of = {t.name: t.lane for t in tenants}
    specs: dict[int, tuple[str, int, int]] = {}
    next_id = 0
    running: list[_Running] = []
    service = {t.name: 0.0 for t in tenants}
    waiting = {t.name: 0 for t in tenants}
    out = SimResult(steps, {t.name: [] for t in tenants}, {t.name: [] for t in tenants},
                    {lane.name: [] for lane in lanes})
    dispatched = {lane.name: 0.0 for lane in lanes}
    for step in range(steps):
        now[0] = float(step)
        for t in tenants:
            for prompt, output in t.arrivals(step):
                specs[next_id] = (t.name, prompt, output)
                queue.push(next_id, t.name, cost.prompt * prompt, cost.of(prompt, output))
                waiting[t.name] += 1
                next_id += 1
        while len(running) < batch:
            item = queue.pop()
            if item is None:
                break
            name, prompt, output = specs.pop(item)
            waiting[name] -= 1
            service[name] += cost.prompt * prompt
            dispatched[lane_of[name]] += cost.of(prompt, output)
            running.append(_Running(name, output))
        active = {r.tenant for r in running}
        for r in running:
            r.left -= 1
            service[r.tenant] += cost.completion
            queue.charge(r.tenant, cost.completion)
        running = [r for r in running if r.left > 0]
        for t in tenants:
            out.service[t.name].append(service[t.name])
            out.backlogged[t.name].append(waiting[t.name] > 0 or t.name in active)
        for lane, value in dispatched.items():
            out.dispatched[lane].append(value)
    return out


def always_backlogged(prompt: int, output: int, per_step: int = 1) -> Arrivals:
    """A tenant that sends ``per_step`` requests every step: its queue never empties."""
    return lambda step: [(prompt, output)] * per_step


def on_off(prompt: int, output: int, on: Callable[[int], bool], per_step: int = 1) -> Arrivals:
    """Sends like ``always_backlogged`` while ``on(step)``, nothing otherwise."""
    return lambda step: [(prompt, output)] * per_step if on(step) else []
