"""The fair queue's second level: applications inside a tenant.

Between the tenants of a lane the queue is weighted VTC; inside a tenant the same rule
picks which request goes: the oldest of the backlogged application with the smallest
application counter (service / application weight), an application that becomes
backlogged being lifted to the smallest counter among the tenant's backlogged
applications (or to the counter of the last one that left). The tenant's own keys
(application ``None``) are one more application of weight 1.

The bound the share tests assert (unit costs, every application of the tenant always
backlogged, application counters starting equal):

    Let c_i = s_i / w_i be application i's counter (s_i its service, w_i its weight). The
    application served next has the smallest counter, and its dispatch raises it by
    1 / w_i. So at every prefix of the dispatches, c_i - c_j <= 1 / w_i for every pair:
    true at the start (all 0); after a dispatch of i, c_i was <= every c_j and grew by
    1 / w_i; every other difference only shrank. With S = sum_j s_j (the tenant's
    service) and W = sum_j w_j:

        s_i - (w_i / W) S = (w_i / W) sum_j w_j (c_i - c_j)

    which lies in [-(n - 1) w_i / W, (W - w_i) / W] for n applications. Multiplied by W
    (integers only, so float rounding in the counters cannot matter):

        -(n - 1) w_i <= W s_i - w_i S <= W - w_i.

    Two applications x (3) and y (1): 4 s_x - 3 S in [-3, 1] (|s_x - 3/4 S| <= 3/4), and
    4 s_y - S in [-1, 3]. Both ends are reached (tight; measured over every prefix of
    every push order tried). The same argument between two tenants of weight 1 gives
    |s_A - s_B| <= 1.

An application's lift makes the same start condition hold when it (re)joins: its counter
is raised to the smallest backlogged sibling's, so from then on the bound applies to the
service counted from that moment, and an idle application banks no credit.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import count

import pytest

from tokenpace.fairness import FairQueue, LaneSpec

LANE = "default"
Item = tuple[str, str | None, int]  # (tenant, application, serial): an item knows its owner


def make_queue(fair: bool = True) -> FairQueue[Item]:
    return FairQueue([LaneSpec(LANE, 0)], lambda: 0.0, fair=fair)


class Driver:
    """Keeps some (tenant, application) streams backlogged (``depth`` requests each, so an
    application never leaves the backlog), dispatches one request at a time and records
    who got it. Every dispatch costs 1: as its prompt cost, or (``charge_after``) charged
    right after the pop as output, before the next choice."""

    def __init__(self, queue: FairQueue[Item], streams: Iterable[tuple[str, str | None]],
                 depth: int = 2, charge_after: bool = False) -> None:
        self.queue, self.charge_after = queue, charge_after
        self.serial = count()
        self.keep: set[tuple[str, str | None]] = set()
        self.order: list[tuple[str, str | None]] = []
        streams = list(streams)
        for _ in range(depth):
            for tenant, application in streams:
                self.push(tenant, application)
        self.keep.update(streams)

    def push(self, tenant: str, application: str | None) -> Item:
        item = (tenant, application, next(self.serial))
        self.queue.push(item, tenant, 0.0 if self.charge_after else 1.0, 1.0, application)
        return item

    def backlog(self, tenant: str, application: str | None, depth: int = 2) -> None:
        """Start keeping a stream backlogged from now on."""
        for _ in range(depth):
            self.push(tenant, application)
        self.keep.add((tenant, application))

    def stop(self, tenant: str, application: str | None) -> None:
        """No more refills: the stream drains as it is served."""
        self.keep.discard((tenant, application))

    def dispatch(self, n: int = 1, **choice: Callable[..., bool]) -> list[tuple[str, str | None]]:
        got = []
        for _ in range(n):
            item = self.queue.pop(**choice)
            assert item is not None
            tenant, application, _ = item
            if self.charge_after:
                self.queue.charge(tenant, 1.0, application)
            if (tenant, application) in self.keep:
                self.push(tenant, application)
            got.append((tenant, application))
        self.order.extend(got)
        return got


def longest_run(order: list, who: object) -> int:
    best = run = 0
    for o in order:
        run = run + 1 if o == who else 0
        best = max(best, run)
    return best


def check_shares(order: list[tuple[str, str | None]], tenant: str,
                 weights: dict[str | None, float]) -> None:
    """The module docstring's bound at every prefix: -(n-1) w_i <= W s_i - w_i S <= W - w_i
    for each application i of ``tenant`` (weights integral here)."""
    total_w, n = sum(weights.values()), len(weights)
    served = dict.fromkeys(weights, 0)
    s = 0
    for k, (t, application) in enumerate(order):
        if t != tenant:
            continue
        served[application] += 1
        s += 1
        for app, w in weights.items():
            d = total_w * served[app] - w * s
            assert -(n - 1) * w <= d <= total_w - w, (k, app, served, s)


def check_tenants_even(order: list[tuple[str, str | None]], a: str, b: str) -> None:
    diff = 0
    for k, (t, _) in enumerate(order):
        diff += (t == a) - (t == b)
        assert abs(diff) <= 1, (k, diff)


# -- 1. shares compose ---------------------------------------------------------------


@pytest.mark.parametrize("charge_after", [False, True])
@pytest.mark.parametrize("first", ["x", "y"])
def test_shares_compose_tenant_then_application(charge_after: bool, first: str) -> None:
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 3.0, "y": 1.0})
    queue.set_tenant("B", LANE, 1.0)
    streams = [("A", first), ("A", "y" if first == "x" else "x"), ("B", None)]
    driver = Driver(queue, streams, charge_after=charge_after)
    order = driver.dispatch(400)
    assert order.count(("B", None)) == 200
    assert order.count(("A", "x")) == 150
    assert order.count(("A", "y")) == 50
    check_tenants_even(order, "A", "B")  # |s_A - s_B| <= 1 at every prefix
    check_shares(order, "A", {"x": 3, "y": 1})  # 4 s_x - 3 S in [-3, 1] at every prefix
    # The counters: service over weight at both levels.
    assert queue.counter("A") == pytest.approx(200.0)
    assert queue.counter("B") == pytest.approx(200.0)
    assert queue.application_counter("A", "x") == pytest.approx(50.0)
    assert queue.application_counter("A", "y") == pytest.approx(50.0)


def test_tenant_weights_and_application_weights_multiply() -> None:
    """A (weight 3) against B (weight 1), A's x (1) against y (2): x gets 3/4 x 1/3 = 1/4
    of the lane, y 1/2, B 1/4."""
    queue = make_queue()
    queue.set_tenant("A", LANE, 3.0, {"x": 1.0, "y": 2.0})
    queue.set_tenant("B", LANE, 1.0)
    driver = Driver(queue, [("A", "x"), ("A", "y"), ("B", None)])
    order = driver.dispatch(1200)
    assert abs(order.count(("B", None)) - 300) <= 1
    assert abs(order.count(("A", "x")) - 300) <= 1
    assert abs(order.count(("A", "y")) - 600) <= 1
    check_shares(order, "A", {"x": 1, "y": 2})


# -- 2. work conservation inside a tenant ----------------------------------------------


def test_an_application_alone_takes_its_whole_tenant_share() -> None:
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 3.0, "y": 1.0})
    queue.set_tenant("B", LANE, 1.0)
    driver = Driver(queue, [("A", "x"), ("B", None)])
    order = driver.dispatch(200)  # y has nothing waiting
    assert order.count(("A", "x")) == 100
    assert order.count(("A", "y")) == 0
    check_tenants_even(order, "A", "B")  # A still gets exactly half against B
    # y arrives: A's half is split 3:1 at once; B's half is untouched.
    driver.backlog("A", "y")
    after = driver.dispatch(400)
    assert after.count(("B", None)) == 200
    assert after.count(("A", "x")) == 150
    assert after.count(("A", "y")) == 50
    check_tenants_even(driver.order, "A", "B")
    check_shares(after, "A", {"x": 3, "y": 1})
    # y drains: x takes the whole of A's share again.
    driver.stop("A", "y")
    rest = driver.dispatch(200)
    assert rest.count(("A", "y")) <= 2  # the two that were waiting, at most
    assert rest.count(("A", "x")) + rest.count(("A", "y")) == 100
    check_tenants_even(driver.order, "A", "B")


def test_a_tenant_alone_is_served_whatever_its_applications_counters() -> None:
    """Work conservation: a queue with requests waiting always dispatches one."""
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 0.001, "y": 1000.0})
    queue.charge("A", 1e9, "x")  # x far ahead of y
    driver = Driver(queue, [("A", "x")], depth=1)
    driver.stop("A", "x")
    assert driver.dispatch(1) == [("A", "x")]
    assert queue.pop() is None and len(queue) == 0


# -- 3. the lift -------------------------------------------------------------------------


@pytest.mark.parametrize("y_before", [0, 5])
def test_an_idle_application_banks_no_credit(y_before: int) -> None:
    """y (served ``y_before`` times, then idle, or never seen) comes back after x alone
    was served 100 times: lifted to x's counter, it gets its 1/4 of A from then on, with
    no run of y-only dispatches (without the lift it would be served ~33 times in a row)."""
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 3.0, "y": 1.0})
    driver = Driver(queue, [])
    if y_before:
        driver.backlog("A", "y", depth=y_before)
        driver.stop("A", "y")
        assert driver.dispatch(y_before) == [("A", "y")] * y_before
    driver.backlog("A", "x")
    assert driver.dispatch(100) == [("A", "x")] * 100
    x_counter = queue.application_counter("A", "x")
    assert x_counter == pytest.approx(y_before + 100 / 3)  # x joined at y's last counter
    driver.backlog("A", "y")
    assert queue.application_counter("A", "y") == pytest.approx(x_counter)  # lifted
    after = driver.dispatch(400)
    assert longest_run(after, ("A", "y")) == 1
    check_shares(after, "A", {"x": 3, "y": 1})
    assert after.count(("A", "y")) == 100


def test_an_application_of_an_idle_tenant_is_lifted_to_the_last_that_left() -> None:
    """A's whole backlog drained (x left last), then y arrives first: lifted to x's
    counter at leaving, not left at 0; then x is lifted to y's."""
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 1.0, "y": 1.0})
    driver = Driver(queue, [("A", "x")], depth=1)
    driver.dispatch(30)
    driver.stop("A", "x")
    driver.dispatch(1)  # the last x leaves: A is idle
    assert queue.queued("A") == (0, 0.0)
    assert queue.application_counter("A", "x") == pytest.approx(31.0)
    queue.charge("A", 5.0, "x")  # output after x left: not in the last-left counter
    driver.backlog("A", "y")
    assert queue.application_counter("A", "y") == pytest.approx(31.0)
    driver.backlog("A", "x")
    assert queue.application_counter("A", "x") == pytest.approx(36.0)  # above the floor: kept
    after = driver.dispatch(40)
    # y is 5 behind x: it catches up (5 in a row at most, once), then they alternate.
    assert after[:5] == [("A", "y")] * 5
    check_shares(after[5:], "A", {"x": 1, "y": 1})


def test_the_lift_moves_only_up() -> None:
    """An application already ahead of its backlogged siblings keeps its counter."""
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 1.0, "y": 1.0})
    queue.charge("A", 50.0, "y")  # y ahead, never backlogged yet
    queue.push(("A", "x", 0), "A", 1.0, 1.0, "x")
    queue.push(("A", "y", 1), "A", 1.0, 1.0, "y")
    assert queue.application_counter("A", "y") == pytest.approx(50.0)
    assert queue.application_counter("A", "x") == pytest.approx(0.0)
    assert queue.pop() == ("A", "x", 0)


# -- 4. the tenant's own requests -------------------------------------------------------


def test_own_requests_are_one_more_application_of_weight_one() -> None:
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 3.0})
    queue.set_tenant("B", LANE, 1.0)
    driver = Driver(queue, [("A", None), ("A", "x"), ("B", None)])
    order = driver.dispatch(400)
    assert order.count(("B", None)) == 200
    assert order.count(("A", "x")) == 150
    assert order.count(("A", None)) == 50
    check_tenants_even(order, "A", "B")
    check_shares(order, "A", {"x": 3, None: 1})
    assert queue.application_counter("A", None) == pytest.approx(50.0)


@pytest.mark.parametrize("push_order", [["x", "y", None], [None, "y", "x"]])
def test_own_requests_beside_two_applications(push_order: list[str | None]) -> None:
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 3.0, "y": 1.0})
    driver = Driver(queue, [("A", app) for app in push_order])
    order = driver.dispatch(1000)
    assert [order.count(("A", app)) for app in ("x", "y", None)] == [600, 200, 200]
    check_shares(order, "A", {"x": 3, "y": 1, None: 1})  # n = 3: 5 s_x - 3 S in [-6, 2]


# -- 5. eligible_application ---------------------------------------------------------


def test_eligible_application_picks_inside_the_tenant_and_skips_it_when_none_may_go() -> None:
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 1.0, "y": 1.0})
    queue.set_tenant("B", LANE, 1.0)
    for item in [("A", "x", 0), ("A", "y", 1), ("A", None, 2), ("B", None, 3), ("A", "x", 4)]:
        queue.push(item, item[0], 1.0, 1.0, item[1])
    queue.charge("B", 10.0)  # B's counter far above A's: A goes first while it can
    asked: list[tuple[str, str | None]] = []

    def not_x(tenant: str, application: str) -> bool:
        asked.append((tenant, application))
        return application != "x"

    # x (oldest, counters equal) may not go: the next of A's others.
    assert queue.peek(eligible_application=not_x) == ("A", "y", 1)
    assert queue.pop(eligible_application=not_x) == ("A", "y", 1)
    assert queue.pop(eligible_application=not_x) == ("A", None, 2)  # own requests may go
    assert queue.counter("A") == pytest.approx(2.0)
    # Only x waits in A: A is skipped entirely, B served, A's counters untouched.
    assert queue.pop(eligible_application=not_x) == ("B", None, 3)
    assert queue.counter("A") == pytest.approx(2.0)
    assert queue.application_counter("A", "x") == pytest.approx(0.0)
    assert None not in {app for _, app in asked}, "never asked about the tenant's own"
    assert queue.pop(eligible_application=not_x) is None
    # Once x may go again, A keeps its place: its x requests go, oldest first.
    assert queue.pop() == ("A", "x", 0)
    assert queue.pop(eligible_application=lambda t, a: True) == ("A", "x", 4)


def test_no_application_eligible_leaves_own_requests_to_go() -> None:
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 1.0})
    queue.push(("A", "x", 0), "A", 1.0, 1.0, "x")
    queue.push(("A", None, 1), "A", 1.0, 1.0, None)
    asked: list[tuple[str, str | None]] = []

    def nothing(tenant: str, application: str) -> bool:
        asked.append((tenant, application))
        return False

    assert queue.pop(eligible_application=nothing) == ("A", None, 1)
    assert queue.pop(eligible_application=nothing) is None
    assert asked and all(app == "x" for _, app in asked)
    # A tenant with only its own requests waiting: the filter is not consulted at all.
    asked.clear()
    queue.push(("A", None, 2), "A", 1.0, 1.0, None)
    queue.remove(("A", "x", 0))
    assert queue.pop(eligible_application=nothing) == ("A", None, 2)
    assert asked == []


def test_the_application_filter_does_not_change_the_tenant_order() -> None:
    """At every step, a filter that leaves each tenant something to send picks the same
    tenant as no filter (the tenant level goes by tenant counters only); only the request
    inside the tenant changes. A filter that admits everything changes nothing."""
    queue = make_queue()
    for i, tenant in enumerate("ABC"):
        queue.set_tenant(tenant, LANE, float(1 + i), {"x": 2.0, "y": 1.0})
    driver = Driver(queue, [(t, a) for t in "ABC" for a in ("x", "y", None)])
    for _ in range(300):
        head = queue.peek()
        assert queue.peek(eligible_application=lambda t, a: True) == head
        turned_down = "x" if head[1] is None else head[1]  # own requests always may go
        other = queue.peek(eligible_application=lambda t, a: a != turned_down)
        assert other[0] == head[0]
        assert other[1] != turned_down
        assert driver.dispatch(1)[0] == head[:2]
    # Over a whole run with y never eligible, each tenant's service keeps to its weight
    # exactly as without the filter (within one request at every prefix).
    def run(filter_: Callable[[str, str], bool] | None) -> list[str]:
        queue = make_queue()
        for i, tenant in enumerate("ABC"):
            queue.set_tenant(tenant, LANE, float(1 + i), {"x": 2.0, "y": 1.0})
        driver = Driver(queue, [(t, a) for t in "ABC" for a in ("x", "y", None)])
        return [t for t, _ in driver.dispatch(300, eligible_application=filter_)]

    unfiltered, filtered = run(None), run(lambda t, a: a != "y")
    assert run(lambda t, a: True) == unfiltered
    for k in range(1, 301):
        for tenant in "ABC":
            assert abs(unfiltered[:k].count(tenant) - filtered[:k].count(tenant)) <= 1


def test_eligible_tenant_and_application_filters_combine() -> None:
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0)
    queue.set_tenant("B", LANE, 1.0)
    queue.push(("A", "x", 0), "A", 1.0, 1.0, "x")
    queue.push(("B", "x", 1), "B", 1.0, 1.0, "x")
    queue.push(("B", "y", 2), "B", 1.0, 1.0, "y")
    only_b_y = {"eligible": lambda t: t == "B", "eligible_application": lambda t, a: a == "y"}
    assert queue.pop(**only_b_y) == ("B", "y", 2)
    assert queue.pop(**only_b_y) is None
    assert queue.pop(eligible_application=lambda t, a: t != "A") == ("B", "x", 1)
    assert queue.pop() == ("A", "x", 0)


# -- 6. peek + take, remove, queued ----------------------------------------------------


def _script(seed: int) -> list[Item]:
    """200 requests of random tenants and applications, to push in this order."""
    rng = random.Random(seed)
    return [(rng.choice("AB"), rng.choice(["x", "y", None]), n) for n in range(200)]


@pytest.mark.parametrize("fair", [True, False])
def test_peek_then_take_gives_pops_order(fair: bool) -> None:
    """Two queues fed the same requests and the same output charges: one drained by
    ``pop``, the other by ``peek`` + ``take``; the same items, counters, in the same order."""
    rng = random.Random(7)
    queues = [make_queue(fair), make_queue(fair)]
    for queue in queues:
        for tenant, weight in (("A", 1.0), ("B", 2.0)):
            queue.set_tenant(tenant, LANE, weight, {"x": 3.0, "y": 1.0})
        for item in _script(7):
            queue.push(item, item[0], float(item[2] % 9 + 1), 10.0, item[1])
    popped, taken = [], []
    for k in range(200):
        def filter_(t: str, a: str) -> bool:
            return a != "x" or k % 3 == 0

        filter_: Callable[[str, str], bool] | None

        if queues[0].peek(eligible_application=filter_) is None:
            filter_ = None  # only x left: no filter
        item = queues[0].pop(eligible_application=filter_)
        peeked = queues[1].peek(eligible_application=filter_)
        assert item is not None and peeked == item
        assert queues[1].take(peeked)
        popped.append(item)
        taken.append(peeked)
        tenant, app, _ = item
        output = float(rng.randint(0, 20))
        for queue in queues:
            queue.charge(tenant, output, app)
        for t in "AB":
            assert queues[0].counter(t) == queues[1].counter(t)
            for a in ("x", "y", None):
                assert queues[0].application_counter(t, a) == queues[1].application_counter(t, a)
    assert popped == taken
    assert len(set(popped)) == 200
    assert queues[0].pop() is None and queues[1].peek() is None


def test_take_of_a_removed_item_is_refused_and_charges_nothing() -> None:
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 1.0})
    queue.push(("A", "x", 0), "A", 5.0, 5.0, "x")
    item = queue.peek()
    assert queue.remove(item)
    assert not queue.take(item)
    assert queue.counter("A") == 0.0 and queue.application_counter("A", "x") == 0.0


def test_remove_keeps_the_rest_in_order_and_queued_counts_every_application() -> None:
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 1.0, "y": 1.0})
    items = [("A", "x", 0), ("A", "x", 1), ("A", "y", 2), ("A", "x", 3), ("A", None, 4),
             ("A", "x", 5), ("A", "x", 6)]
    for i, item in enumerate(items):
        queue.push(item, "A", 1.0, float(10 + i), item[1])
    assert queue.queued("A") == (7, 91.0)
    assert len(queue) == 7
    assert queue.remove(("A", "x", 1))  # in the middle of x's queue
    assert queue.remove(("A", "x", 0))  # x's head
    assert not queue.remove(("A", "x", 0))
    assert queue.queued("A") == (5, 70.0)
    assert len(queue) == 5
    # Counters all 0: y's (oldest head), x's, own (x and own at 1 now: x is older), x, x.
    assert [queue.pop() for _ in range(5)] == [("A", "y", 2), ("A", "x", 3), ("A", None, 4),
                                                ("A", "x", 5), ("A", "x", 6)]
    assert queue.queued("A") == (0, 0.0)
    assert queue.counter("A") == pytest.approx(5.0)
    assert [queue.application_counter("A", a) for a in ("x", "y", None)] == [3.0, 1.0, 1.0]


def test_removing_an_applications_last_request_takes_it_out_of_the_backlog() -> None:
    """After its last waiting request is removed, an application no longer holds the
    tenant's floor: a sibling arriving then is lifted to it as the last that left."""
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0)
    queue.push(("A", "x", 0), "A", 1.0, 1.0, "x")
    queue.charge("A", 8.0, "x")  # x at 8 while waiting
    queue.push(("A", "y", 1), "A", 1.0, 1.0, "y")
    assert queue.application_counter("A", "y") == pytest.approx(8.0)  # lifted to x
    assert queue.remove(("A", "y", 1))
    queue.charge("A", 4.0, "x")  # x at 12
    queue.push(("A", "z", 2), "A", 1.0, 1.0, "z")
    assert queue.application_counter("A", "z") == pytest.approx(12.0)  # x's, not y's 8
    assert queue.remove(("A", "x", 0)) and queue.remove(("A", "z", 2))
    queue.push(("A", "y", 3), "A", 1.0, 1.0, "y")
    assert queue.application_counter("A", "y") == pytest.approx(12.0)  # z left last at 12


# -- 7. weight change of an application ------------------------------------------------


@pytest.mark.parametrize("new_weight", [3.0, 1 / 3])
def test_application_weight_change_applies_to_future_service_without_a_burst(
        new_weight: float) -> None:
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 1.0, "y": 1.0})
    queue.set_tenant("B", LANE, 1.0)
    driver = Driver(queue, [("A", "x"), ("A", "y"), ("B", None)])
    before = driver.dispatch(400)
    assert before.count(("A", "x")) == before.count(("A", "y")) == 100
    counters = (queue.application_counter("A", "x"), queue.application_counter("A", "y"))
    queue.set_tenant("A", LANE, 1.0, {"x": new_weight})  # the reload: x's weight 1 -> new
    assert (queue.application_counter("A", "x"),
            queue.application_counter("A", "y")) == counters  # kept
    after = [app for t, app in driver.dispatch(1600) if t == "A"]
    assert len(after) == 800  # the tenant level is untouched
    share_x = new_weight / (new_weight + 1)
    for start in range(0, len(after) - 8 + 1, 8):  # at once, in every window of 8
        window = after[start:start + 8]
        assert abs(window.count("x") - 8 * share_x) <= 1, (start, window)
    heavy, light = ("x", "y") if new_weight > 1 else ("y", "x")
    assert longest_run(after, heavy) <= 4  # ratio 3, plus one: no catch-up burst
    assert longest_run(after, light) <= 1
    assert after.count("x") == pytest.approx(800 * share_x, abs=1)


def test_application_weight_change_keeps_counters() -> None:
    queue = make_queue()
    queue.set_tenant("A", LANE, 2.0, {"x": 1.0, "y": 1.0})
    queue.charge("A", 300.0, "x")
    queue.charge("A", 100.0, "y")
    assert queue.counter("A") == pytest.approx(200.0)
    queue.set_tenant("A", LANE, 2.0, {"x": 3.0})

    def counters() -> tuple[float, float]:
        return queue.application_counter("A", "x"), queue.application_counter("A", "y")

    assert counters() == (300.0, 100.0)
    queue.charge("A", 300.0, "x")  # a third as far as before
    queue.charge("A", 300.0, "y")
    assert counters() == (400.0, 400.0)
    assert queue.counter("A") == pytest.approx(500.0)  # the tenant's by the tenant weight


# -- 8. FCFS -------------------------------------------------------------------------


def test_fcfs_serves_the_oldest_across_applications_and_tenants() -> None:
    queue = make_queue(fair=False)
    queue.set_tenant("A", LANE, 1.0, {"x": 3.0, "y": 1.0})
    queue.set_tenant("B", LANE, 5.0)
    rng = random.Random(3)
    items = [(rng.choice("AB"), rng.choice(["x", "y", None]), n) for n in range(120)]
    for item in items[:60]:
        queue.push(item, item[0], 1.0, 1.0, item[1])
    queue.charge("A", 1000.0, "x")  # counters must not matter
    queue.charge("B", 1000.0, None)
    got = []
    for item in items[60:]:
        got.append(queue.pop())
        queue.charge(got[-1][0], 50.0, got[-1][1])
        queue.push(item, item[0], 1.0, 1.0, item[1])
    while (item := queue.pop()) is not None:
        got.append(item)
    assert got == items
    # The counters still count (for a switch back to VTC).
    assert queue.application_counter("A", "x") > 1000.0 / 3


def test_switching_to_fcfs_and_back() -> None:
    queue = make_queue()
    queue.set_tenant("A", LANE, 1.0, {"x": 1.0, "y": 1.0})
    queue.charge("A", 10.0, "x")
    for n, app in enumerate(["x", "x", "y"]):
        queue.push(("A", app, n), "A", 1.0, 1.0, app)
    assert queue.application_counter("A", "y") == pytest.approx(10.0)  # lifted to x's
    queue.charge("A", 5.0, "x")  # x at 15, y at 10: VTC would take y first
    assert queue.peek() == ("A", "y", 2)
    queue.fair = False
    assert queue.peek() == ("A", "x", 0)
    queue.fair = True
    assert queue.pop() == ("A", "y", 2)


# -- 9. against a reference ----------------------------------------------------------


NONE = object()  # no application (None is the tenant's own requests)


@dataclass
class _RefApp:
    weight: float = 1.0
    counter: float = 0.0
    queue: deque = field(default_factory=deque)  # (item, seq, prompt, estimate)


@dataclass
class _RefTenant:
    weight: float
    counter: float = 0.0
    apps: dict = field(default_factory=dict)  # application -> _RefApp
    last_left: float | None = None  # counter of the application that left the backlog last

    def waiting(self) -> int:
        return sum(len(a.queue) for a in self.apps.values())

    def head(self, fair: bool, ok: Callable[[str | None], bool] = lambda app: True):
        """The application the tenant dispatches next among those ``ok`` admits: the
        smallest (counter, seq of its oldest); NONE if none waits."""
        ready = [app for app, s in self.apps.items() if s.queue and ok(app)]
        if not ready:
            return NONE
        return min(ready, key=lambda app: (self.apps[app].counter if fair else 0.0,
                                           self.apps[app].queue[0][1]))


class Reference:
    """The documented two-level order by scanning every tenant and application on each
    choice (one lane). Between tenants: the smallest (counter, seq of the request the
    tenant would dispatch next), among the eligible tenants with an eligible request;
    inside: the smallest (application counter, seq of its oldest) among the eligible
    applications (own requests always eligible). Both levels lift on becoming backlogged."""

    def __init__(self, fair: bool) -> None:
        self.fair = fair
        self.tenants: dict[str, _RefTenant] = {}
        self.last_left: float | None = None  # tenant level
        self.seq = 0

    def set_tenant(self, name: str, weight: float, apps: dict[str, float]) -> None:
        state = self.tenants.setdefault(name, _RefTenant(weight))
        state.weight = weight
        for app, w in apps.items():
            state.apps.setdefault(app, _RefApp()).weight = w

    def push(self, item: Item, name: str, prompt: float, estimate: float, app: str | None) -> None:
        state = self.tenants[name]
        if not state.waiting():
            floors = [s.counter for s in self.tenants.values() if s.waiting()]
            floor = min(floors) if floors else self.last_left
            if floor is not None:
                state.counter = max(state.counter, floor)
        a = state.apps.setdefault(app, _RefApp())
        if not a.queue:
            floors = [s.counter for s in state.apps.values() if s.queue]
            floor = min(floors) if floors else state.last_left
            if floor is not None:
                a.counter = max(a.counter, floor)
        a.queue.append((item, self.seq, prompt, estimate))
        self.seq += 1

    def _leave(self, state: _RefTenant, app: str | None) -> None:
        """Bookkeeping after an entry of ``app`` left ``state``'s queue."""
        if not state.apps[app].queue:
            state.last_left = state.apps[app].counter
            if not state.waiting():
                self.last_left = state.counter

    def remove(self, item: Item) -> bool:
        for state in self.tenants.values():
            for app, a in state.apps.items():
                for entry in a.queue:
                    if entry[0] == item:
                        a.queue.remove(entry)
                        self._leave(state, app)
                        return True
        return False

    def charge(self, name: str, cost: float, app: str | None) -> None:
        state = self.tenants[name]
        state.counter += cost / state.weight
        if app in state.apps:
            state.apps[app].counter += cost / state.apps[app].weight

    def choose(self, eligible, eligible_application):
        def ok(name):
            return lambda app: (app is None or eligible_application is None
                                or eligible_application(name, app))

        candidates = [name for name, s in self.tenants.items()
                      if s.waiting() and eligible(name) and s.head(self.fair, ok(name)) is not NONE]
        if not candidates:
            return None

        def key(name):
            s = self.tenants[name]
            return (s.counter if self.fair else 0.0, s.apps[s.head(self.fair)].queue[0][1])

        name = min(candidates, key=key)
        return name, self.tenants[name].head(self.fair, ok(name))

    def pop(self, eligible, eligible_application) -> Item | None:
        chosen = self.choose(eligible, eligible_application)
        if chosen is None:
            return None
        name, app = chosen
        state = self.tenants[name]
        item, _, prompt, _ = state.apps[app].queue.popleft()
        self.charge(name, prompt, app)
        self._leave(state, app)
        return item


TENANTS = {"A": 1.0, "B": 2.0, "C": 0.5}
APPS = {"A": {"x": 1.0, "y": 3.0}, "B": {"x": 2.0, "y": 0.5}, "C": {"x": 1.0}}


@pytest.mark.parametrize("fair", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_random_operations_choose_what_the_two_level_scan_chooses(seed: int, fair: bool) -> None:
    rng = random.Random(seed)
    queue: FairQueue[Item] = make_queue(fair)
    ref = Reference(fair)
    for name, weight in TENANTS.items():
        queue.set_tenant(name, LANE, weight, APPS[name])
        ref.set_tenant(name, weight, APPS[name])
    apps = ["x", "y", None]  # C's y is undeclared: weight 1
    queued: list[Item] = []
    dispatched: list[tuple[str, str | None]] = []
    blocked_tenants: set[str] = set()
    blocked_apps: set[tuple[str, str]] = set()
    asked_none: list[str] = []

    def eligible(tenant: str) -> bool:
        return tenant not in blocked_tenants

    def eligible_application(tenant: str, app: str) -> bool:
        if app is None:
            asked_none.append(tenant)
        return (tenant, app) not in blocked_apps

    for n in range(3000):
        op = rng.random()
        if rng.random() < 0.05:
            blocked_tenants = set(rng.sample(sorted(TENANTS), rng.randint(0, 1)))
            blocked_apps = {(t, a) for t in TENANTS for a in ("x", "y") if rng.random() < 0.3}
        filter_ = eligible_application if rng.random() < 0.7 else None
        if op < 0.40:
            name, app = rng.choice(sorted(TENANTS)), rng.choice(apps)
            item = (name, app, n)
            prompt, estimate = float(rng.randint(0, 12)), float(rng.randint(12, 40))
            queue.push(item, name, prompt, estimate, app)
            ref.push(item, name, prompt, estimate, app)
            queued.append(item)
        elif op < 0.70:
            expected = ref.pop(eligible, filter_)
            if rng.random() < 0.5:
                got = queue.pop(eligible, filter_)
            else:
                got = queue.peek(eligible, filter_)
                assert got is None or queue.take(got)
            assert got == expected, n
            if got is not None:
                queued.remove(got)
                dispatched.append(got[:2])
        elif op < 0.78 and queued:
            victim = rng.choice(queued)
            assert queue.remove(victim) and ref.remove(victim)
            queued.remove(victim)
        elif op < 0.97 and dispatched:  # output of something dispatched earlier
            name, app = rng.choice(dispatched)
            cost = float(rng.randint(1, 30))
            queue.charge(name, cost, app)
            ref.charge(name, cost, app)
        elif op >= 0.97:  # a reload changes weights (counters kept)
            name = rng.choice(sorted(TENANTS))
            weight = rng.choice([0.5, 1.0, 2.0, 3.0])
            new_apps = {a: rng.choice([0.5, 1.0, 4.0]) for a in APPS[name]}
            queue.set_tenant(name, LANE, weight, new_apps)
            ref.set_tenant(name, weight, new_apps)
        for name, state in ref.tenants.items():
            assert queue.counter(name) == pytest.approx(state.counter), (n, name)
            assert queue.queued(name)[0] == state.waiting()
            for app, a in state.apps.items():
                assert queue.application_counter(name, app) == pytest.approx(a.counter), (n, app)
    assert not asked_none, "eligible_application is never asked about own requests"
    assert len(queue) == len(queued)
    while (item := ref.pop(eligible, None)) is not None:  # drain: still the same order
        assert queue.pop(eligible) == item
    blocked_tenants = set()
    while (item := ref.pop(eligible, None)) is not None:
        assert queue.pop() == item
    assert len(queue) == 0
