"""Which batch line runs next, and whether it may run now: the batch lane's scheduler.

Pure policy (an injected clock, no I/O), as ``fairness`` is. Two questions, asked on every
turn of the runner's pump:

1. *May a line of model M start now?* Only into capacity interactive traffic leaves free:
   the gateway's ``room(M)`` says how many of the pool's slots are free beyond the
   headroom kept for live requests, with nobody waiting in the pool's queue; lines
   started and not yet holding a slot count against it (``starting``), so one turn
   never starts more lines than there are free slots.
2. *Whose line?* Weighted VTC between tenants, as the fair queue shares a lane: each
   tenant's batches wait here as one entry per batch (its next line), the tenant with the
   least service per weight goes first and its batches take turns (each batch is an
   "application" of its tenant, weight 1). A line's estimated prompt cost is charged when
   it starts and its real cost when it ends (``charge``), so a tenant whose lines are long
   gets fewer of them.

A tenant whose line was refused for its budget or a request limit (a 429) is held back
until the refusal's ``retry-after`` has passed (``hold``): its other lines would be
refused alike, and each refusal is a ledger row.

Cost: a push or pop is O(log t) in the t tenants with waiting batches (one heap per model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...fairness import FairQueue, LaneSpec

_LANE = "batch"


@dataclass(eq=False)
class Ticket:
    """A batch's place in the feed: the batch waiting to start its next line."""

    batch_id: str
    tenant: str
    model: str


@dataclass
class _Model:
    queue: FairQueue[Ticket]
    starting: int = 0  # lines started that do not hold an engine slot yet
    tickets: dict[str, Ticket] = field(default_factory=dict)  # batch id -> its waiting ticket
    # Tenant -> its batches with lines of this model left (waiting or running). A tenant
    # is lifted when it becomes active here, not each time its batch's one ticket comes
    # back: the queue's own lift (on every return to the backlog) would wipe out the
    # service it received between two lines and share 1:1 whatever the weights.
    active: dict[str, set[str]] = field(default_factory=dict)


class BatchFeed:
    """The waiting batches of every model, in the order their lines start."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._models: dict[str, _Model] = {}
        self._weights: dict[str, float] = {}
        self._held: dict[str, float] = {}  # tenant -> clock time its lines may go again

    def set_weight(self, tenant: str, weight: float) -> None:
        self._weights[tenant] = weight
        for model in self._models.values():
            if model.queue.declared(tenant):
                model.queue.set_tenant(tenant, _LANE, weight)

    def _model(self, name: str) -> _Model:
        model = self._models.get(name)
        if model is None:
            model = self._models[name] = _Model(FairQueue([LaneSpec(_LANE, 0, 0.0)],
                                                          self._clock, lift=False))
        return model

    def wait(self, batch_id: str, tenant: str, model_name: str, estimate: float) -> None:
        """Batch ``batch_id`` has a line of ``model_name`` ready, of ``estimate`` cost
        units of prompt (charged to its tenant when the line starts). A batch waits with
        one line at a time; a second call before it started replaces nothing."""
        model = self._model(model_name)
        if batch_id in model.tickets:
            return
        if not model.queue.declared(tenant):
            model.queue.set_tenant(tenant, _LANE, self._weights.get(tenant, 1.0))
        batches = model.active.setdefault(tenant, set())
        if not batches:
            # Newly active: lifted to the least counter among the tenants already active
            # here, so time without batches banks no credit (VTC's lift, per activity).
            floor = min((model.queue.counter(other) for other, theirs in model.active.items()
                         if theirs and other != tenant), default=None)
            if floor is not None and floor > model.queue.counter(tenant):
                model.queue.set_counters({tenant: floor})
        batches.add(batch_id)
        ticket = Ticket(batch_id, tenant, model_name)
        model.tickets[batch_id] = ticket
        model.queue.push(ticket, tenant, estimate, estimate, application=batch_id)

    def forget(self, batch_id: str) -> None:
        """The batch stops (finished, cancelled, expired, its lease lost)."""
        for model in self._models.values():
            ticket = model.tickets.pop(batch_id, None)
            if ticket is not None:
                model.queue.remove(ticket)
            for tenant, batches in list(model.active.items()):
                batches.discard(batch_id)
                if not batches:
                    del model.active[tenant]

    def hold(self, tenant: str, seconds: float) -> None:
        """Start no line of ``tenant`` for ``seconds`` (its budget or limits refused one)."""
        self._held[tenant] = max(self._held.get(tenant, 0.0), self._clock() + seconds)

    def held(self, tenant: str) -> bool:
        until = self._held.get(tenant)
        if until is None:
            return False
        if self._clock() >= until:
            del self._held[tenant]
            return False
        return True

    def next(self, room: Callable[[str], int],
             tenant_ok: Callable[[str], bool]) -> Ticket | None:
        """The batch whose line starts now, or None: for each model with waiting batches
        and ``room(model)`` free slots beyond those being taken, the fair choice among
        tenants that are not held and that ``tenant_ok`` lets run. The caller starts the
        line and calls ``started`` when it holds its slot (or ended without one)."""
        def eligible(tenant: str) -> bool:
            return not self.held(tenant) and tenant_ok(tenant)

        for name, model in self._models.items():
            if not len(model.queue) or room(name) - model.starting <= 0:
                continue
            ticket = model.queue.pop(eligible)
            if ticket is not None:
                del model.tickets[ticket.batch_id]
                model.starting += 1
                return ticket
        return None

    def started(self, model_name: str) -> None:
        """A line ``next`` gave holds its engine slot now, or ended before it got one."""
        model = self._models.get(model_name)
        if model is not None and model.starting > 0:
            model.starting -= 1

    def charge(self, tenant: str, model_name: str, batch_id: str, cost: float) -> None:
        """A line of the batch ended having cost ``cost`` beyond its prompt estimate."""
        model = self._models.get(model_name)
        if model is not None and model.queue.declared(tenant):
            model.queue.charge(tenant, cost, batch_id)

    def waiting(self) -> int:
        return sum(len(m.queue) for m in self._models.values())
