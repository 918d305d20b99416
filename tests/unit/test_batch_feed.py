"""The batch lane's scheduler: which batch starts its next line, and whether one may start.

Pure policy with an injected clock, so every test drives a fake clock and asserts exact
picks. What matters to the gateway: a line starts only into free room (lines started but
not yet holding a slot count against it), tenants share that room by weight, a tenant's
batches take turns, and a tenant refused for its budget waits out its hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from tokenpace.gateway.batch import BatchFeed, Ticket

M = "tiny"


class Clock:
    """A clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def always(_: str) -> bool:
    return True


def room_of(**rooms: int) -> Callable[[str], int]:
    """``room(model)`` as the gateway gives it: free slots per model (0 if not named)."""
    return lambda model: rooms.get(model, 0)


def plenty(_: str) -> int:
    return 1_000


def test_one_ticket_per_batch() -> None:
    """A batch waits with one line at a time: a second ``wait`` before it started is
    ignored, so the batch cannot start two lines from one turn."""
    feed = BatchFeed(Clock())
    feed.wait("b1", "acme", M, 10.0)
    feed.wait("b1", "acme", M, 10.0)
    assert feed.waiting() == 1
    ticket = feed.next(plenty, always)
    assert isinstance(ticket, Ticket)
    assert (ticket.batch_id, ticket.tenant, ticket.model) == ("b1", "acme", M)
    assert feed.next(plenty, always) is None
    # once started, the batch may wait again with its next line
    feed.wait("b1", "acme", M, 10.0)
    assert feed.waiting() == 1


def test_next_stops_when_room_is_taken_by_starting_lines() -> None:
    """``room - starting <= 0`` stops: with 2 free slots, two lines may be on their way;
    a third waits until one of them holds its slot (``started``)."""
    feed = BatchFeed(Clock())
    for batch_id in ("b1", "b2", "b3"):
        feed.wait(batch_id, "acme", M, 1.0)
    room = room_of(tiny=2)
    first, second = feed.next(room, always), feed.next(room, always)
    assert first is not None and second is not None
    assert feed.next(room, always) is None
    feed.started(M)
    third = feed.next(room, always)
    assert third is not None
    assert {first.batch_id, second.batch_id, third.batch_id} == {"b1", "b2", "b3"}
    assert feed.waiting() == 0


def test_no_room_no_line() -> None:
    """``room`` 0 (live requests wait, or only the headroom is free): nothing starts, and
    the batch keeps its place."""
    feed = BatchFeed(Clock())
    feed.wait("b1", "acme", M, 1.0)
    assert feed.next(room_of(tiny=0), always) is None
    assert feed.next(room_of(tiny=-3), always) is None
    assert feed.waiting() == 1
    ticket = feed.next(room_of(tiny=1), always)
    assert ticket is not None and ticket.batch_id == "b1"


def test_started_never_goes_below_zero() -> None:
    """A stray ``started`` (a line that ended twice, an unknown model) must not give the
    model extra room."""
    feed = BatchFeed(Clock())
    feed.started("unknown")
    feed.started(M)
    feed.wait("b1", "acme", M, 1.0)
    feed.wait("b2", "acme", M, 1.0)
    room = room_of(tiny=1)
    assert feed.next(room, always) is not None
    feed.started(M)
    feed.started(M)  # once too often
    assert feed.next(room, always) is not None
    feed.wait("b1", "acme", M, 1.0)
    assert feed.next(room, always) is None


def picks(feed: BatchFeed, batches: dict[str, str], rounds: int,
          cost: Callable[[str], float], estimate: float = 1.0,
          rewait_first: bool = False) -> Counter[str]:
    """Keep every batch waiting (batch id -> tenant) and run ``rounds`` lines one at a
    time: next -> started -> charge(cost(batch)) -> wait again, or (``rewait_first``) in
    the runner's own order, whose pump re-offers a batch's next line as soon as it took
    one: next -> wait -> started -> charge. Returns how many lines each batch started."""
    for batch_id, tenant in batches.items():
        feed.wait(batch_id, tenant, M, estimate)
    counts: Counter[str] = Counter()
    for _ in range(rounds):
        ticket = feed.next(plenty, always)
        assert ticket is not None
        counts[ticket.batch_id] += 1
        if rewait_first:
            feed.wait(ticket.batch_id, ticket.tenant, M, estimate)
        feed.started(M)
        feed.charge(ticket.tenant, M, ticket.batch_id, cost(ticket.batch_id))
        if not rewait_first:
            feed.wait(ticket.batch_id, ticket.tenant, M, estimate)
    return counts


def unit(_: str) -> float:
    return 1.0


def free(_: str) -> float:
    return 0.0


@pytest.mark.parametrize("rewait_first", [False, True], ids=["brief-order", "runner-order"])
def test_weighted_share_between_tenants(rewait_first: bool) -> None:
    """Weights 2 and 1, both always waiting, every line costing the same (estimate 1 +
    charge 1): the heavier tenant gets 2/3 of 300 lines. VTC keeps each tenant's counter
    (service / weight) within one line's cost of the other's, so the split is 200:100 to
    within a line or two; the tolerance is 3 lines."""
    feed = BatchFeed(Clock())
    feed.set_weight("gold", 2.0)
    feed.set_weight("free", 1.0)
    counts = picks(feed, {"g1": "gold", "f1": "free"}, 300, unit, rewait_first=rewait_first)
    assert counts["g1"] + counts["f1"] == 300
    assert abs(counts["g1"] - 200) <= 3, counts
    assert abs(counts["f1"] - 100) <= 3, counts


def test_weight_change_applies_to_waiting_tenants() -> None:
    """``set_weight`` for a tenant already waiting changes its share from then on."""
    feed = BatchFeed(Clock())
    feed.wait("a1", "a", M, 1.0)
    feed.wait("b1", "b", M, 1.0)
    feed.set_weight("a", 3.0)
    counts = picks(feed, {"a1": "a", "b1": "b"}, 200, unit)
    assert abs(counts["a1"] - 150) <= 3, counts


def test_cost_charged_counts_against_a_tenant() -> None:
    """Equal weights, but one tenant's lines cost 9 more each (estimate 1 + charge 9): it
    gets about 1/11 of the lines (its counter grows 10 per line, the other's 1)."""
    feed = BatchFeed(Clock())
    counts = picks(feed, {"long": "a", "short": "b"}, 220,
                   lambda batch_id: 9.0 if batch_id == "long" else 0.0)
    assert abs(counts["long"] - 20) <= 2, counts
    assert abs(counts["short"] - 200) <= 2, counts


def test_batches_of_one_tenant_take_turns() -> None:
    """Each batch is an application of weight 1 inside its tenant: two batches of one
    tenant alternate line by line, neither runs to the end first."""
    feed = BatchFeed(Clock())
    order: list[str] = []
    feed.wait("b1", "acme", M, 1.0)
    feed.wait("b2", "acme", M, 1.0)
    for _ in range(10):
        ticket = feed.next(plenty, always)
        assert ticket is not None
        order.append(ticket.batch_id)
        feed.started(M)
        feed.wait(ticket.batch_id, "acme", M, 1.0)
    assert order == ["b1", "b2"] * 5


def test_a_tenants_two_batches_share_its_weight_not_double_it() -> None:
    """A tenant cannot gain share by splitting its work into more batches: tenant a with
    two batches and tenant b with one, equal weights, split the lines about evenly."""
    feed = BatchFeed(Clock())
    counts = picks(feed, {"a1": "a", "a2": "a", "b1": "b"}, 300, free)
    assert abs(counts["a1"] + counts["a2"] - 150) <= 3, counts
    assert abs(counts["a1"] - counts["a2"]) <= 2, counts


def test_hold_keeps_a_tenant_out_until_the_clock_passes() -> None:
    """A tenant refused for its budget waits out the retry-after; the others go on."""
    clock = Clock()
    feed = BatchFeed(clock)
    feed.wait("a1", "a", M, 1.0)
    feed.wait("b1", "b", M, 1.0)
    feed.hold("a", 5.0)
    assert feed.held("a") and not feed.held("b")
    first = feed.next(plenty, always)
    assert first is not None and first.batch_id == "b1"
    feed.started(M)
    assert feed.next(plenty, always) is None  # only a's line waits, and a is held
    clock.now += 4.9
    assert feed.next(plenty, always) is None
    clock.now += 0.1
    assert not feed.held("a")
    second = feed.next(plenty, always)
    assert second is not None and second.batch_id == "a1"


def test_hold_only_extends() -> None:
    """A shorter hold given while a longer one runs does not shorten it (two lines of the
    tenant refused with different retry-afters)."""
    clock = Clock()
    feed = BatchFeed(clock)
    feed.hold("a", 10.0)
    feed.hold("a", 1.0)
    clock.now += 5.0
    assert feed.held("a")
    clock.now += 5.0
    assert not feed.held("a")


def test_forget_removes_the_batch_ticket() -> None:
    """A batch that stops (cancelled, expired) starts no more lines."""
    feed = BatchFeed(Clock())
    feed.wait("b1", "acme", M, 1.0)
    feed.wait("b2", "acme", M, 1.0)
    feed.forget("b1")
    feed.forget("never-waited")  # harmless
    assert feed.waiting() == 1
    ticket = feed.next(plenty, always)
    assert ticket is not None and ticket.batch_id == "b2"
    assert feed.next(plenty, always) is None
    # a forgotten batch may wait again (resumed by this runner later)
    feed.wait("b1", "acme", M, 1.0)
    ticket = feed.next(plenty, always)
    assert ticket is not None and ticket.batch_id == "b1"


def test_tenant_ok_false_skips_that_tenant() -> None:
    """A tenant at its concurrency limit is passed over, without losing its place."""
    feed = BatchFeed(Clock())
    feed.wait("a1", "a", M, 1.0)
    feed.wait("b1", "b", M, 1.0)

    def not_a(tenant: str) -> bool:
        return tenant != "a"

    ticket = feed.next(plenty, not_a)
    assert ticket is not None and ticket.batch_id == "b1"
    feed.started(M)
    assert feed.next(plenty, not_a) is None
    assert feed.waiting() == 1
    ticket = feed.next(plenty, always)
    assert ticket is not None and ticket.batch_id == "a1"


def test_models_are_independent() -> None:
    """Room is per model: free slots of one model never start a line of another, and
    lines starting on one model do not use up another's room."""
    feed = BatchFeed(Clock())
    feed.wait("b-on-b", "acme", "model-b", 1.0)
    room = room_of(**{"model-a": 1, "model-b": 0})
    assert feed.next(room, always) is None
    feed.wait("b-on-a", "acme", "model-a", 1.0)
    ticket = feed.next(room, always)
    assert ticket is not None and ticket.model == "model-a"
    assert feed.next(room, always) is None  # a: starting, b: 0
    feed.wait("b-on-a2", "acme", "model-a", 1.0)
    room = room_of(**{"model-a": 1, "model-b": 1})
    ticket = feed.next(room, always)
    assert ticket is not None and ticket.model == "model-b"  # a's starting line fills a
    feed.started("model-a")
    ticket = feed.next(room, always)
    assert ticket is not None and ticket.batch_id == "b-on-a2"


def test_charge_for_unknown_model_or_tenant_is_ignored() -> None:
    """A line can end after its batch was forgotten and its model dropped: no error."""
    feed = BatchFeed(Clock())
    feed.charge("nobody", "no-model", "b0", 5.0)
    feed.wait("b1", "acme", M, 1.0)
    feed.charge("nobody", M, "b0", 5.0)
    assert feed.waiting() == 1
