"""The fair queue: the VTC paper's cases in a deterministic simulation, and queue mechanics.

Bound from the paper: for two always-backlogged tenants the weighted service difference
stays within 2 x max(cost.prompt x max_input, cost.completion x M), M being the tokens one
engine batch holds (here batch x output tokens per request).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit._fair_simulation import SimTenant, always_backlogged, on_off, simulate
from tokenpace.fairness import CostModel, FairQueue, LaneSpec

COST = CostModel(prompt=1.0, completion=2.0)
BATCH, PROMPT, OUTPUT = 8, 64, 32
BOUND = 2 * max(COST.prompt * PROMPT, COST.completion * BATCH * OUTPUT)


def two_backlogged(fair: bool) -> list[float]:
    result = simulate(
        [SimTenant("a", always_backlogged(PROMPT, OUTPUT), weight=1.0),
         SimTenant("b", always_backlogged(PROMPT, OUTPUT), weight=2.0)],
        steps=3000, batch=BATCH, cost=COST, fair=fair)
    return result.weighted_difference("a", "b", {"a": 1.0, "b": 2.0})


def test_weighted_service_difference_stays_bounded_with_vtc() -> None:
    diff = two_backlogged(fair=True)
    assert len(diff) == 3000
    assert max(diff) <= BOUND


def test_fcfs_baseline_fails_the_same_check() -> None:
    assert max(two_backlogged(fair=False)) > BOUND


@pytest.mark.parametrize("sizes", [((16, 200), (400, 4)), ((400, 4), (16, 200))])
def test_bound_holds_for_unequal_request_shapes(sizes: tuple[tuple[int, int], tuple[int, int]]) -> None:
    (pa, oa), (pb, ob) = sizes
    result = simulate([SimTenant("a", always_backlogged(pa, oa)),
                       SimTenant("b", always_backlogged(pb, ob))],
                      steps=3000, batch=BATCH, cost=COST)
    bound = 2 * max(COST.prompt * max(pa, pb), COST.completion * BATCH * max(oa, ob))
    assert max(result.weighted_difference("a", "b", {"a": 1, "b": 1})) <= bound


def returning_tenant(lift: bool) -> float:
    """B is idle for the first half, then always backlogged: the most its service after
    returning exceeds A's over any prefix of the second half."""
    half = 1500
    result = simulate([SimTenant("a", always_backlogged(PROMPT, OUTPUT)),
                       SimTenant("b", on_off(PROMPT, OUTPUT, lambda step: step >= half))],
                      steps=2 * half, batch=BATCH, cost=COST, lift=lift)
    a, b = result.service["a"], result.service["b"]
    return max((b[k] - b[half]) - (a[k] - a[half]) for k in range(half, 2 * half))


def test_tenant_returning_from_idle_gets_no_more_than_its_share() -> None:
    assert returning_tenant(lift=True) <= BOUND


def test_without_the_lift_the_returning_tenant_monopolises() -> None:
    assert returning_tenant(lift=False) > BOUND


def test_lanes_share_as_configured_and_stay_work_conserving() -> None:
    lanes = [LaneSpec("interactive", 0, 0.1), LaneSpec("batch", 10, 0.25)]
    result = simulate(
        [SimTenant("a", always_backlogged(PROMPT, OUTPUT), lane="interactive"),
         SimTenant("b", always_backlogged(PROMPT, OUTPUT), lane="batch")],
        steps=3000, batch=BATCH, cost=COST, lanes=lanes)
    hi, lo = result.dispatched["interactive"][-1], result.dispatched["batch"][-1]
    assert lo / (hi + lo) == pytest.approx(0.25, abs=0.02)
    # Only the batch lane has work: it gets the whole engine.
    alone = simulate([SimTenant("b", always_backlogged(PROMPT, OUTPUT), lane="batch")],
                     steps=300, batch=BATCH, cost=COST, lanes=lanes)
    per_request = COST.of(PROMPT, OUTPUT)
    assert alone.dispatched["batch"][-1] >= per_request * BATCH * (300 // OUTPUT)


def test_strict_priority_without_min_share_starves_the_lower_lane() -> None:
    lanes = [LaneSpec("interactive", 0, 0.0), LaneSpec("batch", 10, 0.0)]
    result = simulate(
        [SimTenant("a", always_backlogged(PROMPT, OUTPUT, per_step=BATCH), lane="interactive"),
         SimTenant("b", always_backlogged(PROMPT, OUTPUT), lane="batch")],
        steps=1000, batch=BATCH, cost=COST, lanes=lanes)
    assert result.dispatched["batch"][-1] == 0


# -- mechanics ---------------------------------------------------------------------------


def make_queue(fair: bool = True) -> FairQueue[str]:
    queue: FairQueue[str] = FairQueue([LaneSpec("default")], clock=lambda: 0.0, fair=fair)
    queue.set_tenant("a", "default", 1.0)
    queue.set_tenant("b", "default", 1.0)
    return queue


def test_fifo_within_a_tenant_and_eligibility() -> None:
    queue = make_queue()
    for item in ("a1", "a2", "a3"):
        queue.push(item, "a", 10, 20)
    queue.push("b1", "b", 10, 20)
    assert queue.pop(lambda t: t == "a") == "a1"
    assert queue.pop() == "b1"  # b's counter (0) is below a's (10)
    assert queue.pop(lambda t: t == "b") is None
    assert [queue.pop(), queue.pop()] == ["a2", "a3"]
    assert queue.pop() is None and len(queue) == 0


def test_remove_and_queued_cost() -> None:
    queue = make_queue()
    queue.push("a1", "a", 10, 30)
    queue.push("a2", "a", 10, 40)
    assert queue.queued("a") == (2, 70)
    assert queue.remove("a1") and not queue.remove("a1")
    assert queue.queued("a") == (1, 40)
    assert queue.pop() == "a2"


def test_adopted_lane_costs_decide_the_lane_and_own_dispatches_add_to_them() -> None:
    """Replicas hand in every replica's lane costs (set_lane_costs): the lane choice goes by
    them plus this queue's dispatches since, and by its own window again after None."""
    lanes = [LaneSpec("interactive", 0, 0.0), LaneSpec("batch", 10, 0.25)]
    queue: FairQueue[str] = FairQueue(lanes, clock=lambda: 0.0)
    queue.set_tenant("i", "interactive", 1.0)
    queue.set_tenant("b", "batch", 1.0)
    queue.push("b0", "b", 1, 100)
    assert not queue.shares_matter()  # one lane waiting: no choice between lanes
    assert queue.pop() == "b0"  # own window: batch 100 of 100
    for n in range(4):
        queue.push(f"i{n}", "i", 1, 10)
        queue.push(f"b{n + 1}", "b", 1, 10)
    assert queue.shares_matter()
    assert queue.pop() == "i0"  # batch 100 of 110 here: strict priority
    queue.set_lane_costs({"interactive": 300.0, "batch": 90.0})  # everyone's: batch 0.23
    assert queue.pop() == "b1"  # promoted
    # 100 of 400 now, counting b1: not below 0.25 (on the adopted figures alone, 90 of
    # 390 would promote batch again).
    assert queue.pop() == "i1"
    assert queue.lane_costs() == {"interactive": 20.0, "batch": 110.0}  # still its own
    queue.set_lane_costs(None)
    assert [queue.pop(), queue.pop()] == ["i2", "i3"]  # own window: batch 110 of 130
    # A lower lane without a min_share never needs the shares.
    plain = FairQueue[str]([LaneSpec("interactive", 0, 0.0), LaneSpec("batch", 10, 0.0)],
                           clock=lambda: 0.0)
    plain.set_tenant("i", "interactive", 1.0)
    plain.set_tenant("b", "batch", 1.0)
    plain.push("i0", "i", 1, 10)
    plain.push("b0", "b", 1, 10)
    assert not plain.shares_matter()


def test_peek_then_take_dispatches_as_pop_does() -> None:
    """A dispatcher that asks a shared store first peeks, then takes once it may: the same
    choice and the same accounting as pop; an item removed meanwhile is not taken."""
    popped, taken = make_queue(), make_queue()
    for queue in (popped, taken):
        queue.push("a1", "a", 10, 30)
        queue.push("b1", "b", 5, 25)
        queue.push("a2", "a", 10, 30)
    order = []
    while (item := taken.peek()) is not None:
        assert taken.peek() == item  # peeking changes nothing
        assert taken.take(item)
        order.append(item)
        assert popped.pop() == item
        assert (taken.counter("a"), taken.counter("b")) == (popped.counter("a"), popped.counter("b"))
        assert taken.lane_costs() == popped.lane_costs()
    assert order == ["a1", "b1", "a2"] and len(taken) == 0
    taken.push("a3", "a", 10, 30)
    assert taken.peek() == "a3" and taken.remove("a3")
    assert not taken.take("a3") and taken.counter("a") == popped.counter("a")


def test_debt_and_weight_change_apply_to_future_service_only() -> None:
    queue = make_queue()
    queue.push("a1", "a", 100, 100)
    queue.push("b1", "b", 10, 10)
    queue.pop(lambda t: t == "a")
    queue.push("a2", "a", 100, 100)
    assert queue.debt("a") == 100 and queue.debt("b") == 0
    queue.set_tenant("a", "default", 4.0)
    assert queue.counter("a") == 100  # unchanged by the new weight
    queue.charge("a", 40)
    assert queue.counter("a") == 110


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 50)), min_size=1, max_size=60))
def test_pop_always_picks_the_smallest_counter(pushes: list[tuple[str, int]]) -> None:
    queue: FairQueue[int] = FairQueue([LaneSpec("default")], clock=lambda: 0.0)
    for t in "abc":
        queue.set_tenant(t, "default", {"a": 1.0, "b": 2.0, "c": 0.5}[t])
    owner = {}
    for i, (tenant, prompt) in enumerate(pushes):
        queue.push(i, tenant, prompt, prompt)
        owner[i] = tenant
    while len(queue):
        backlogged = {owner[i] for i in owner}
        smallest = min(queue.counter(t) for t in backlogged)
        item = queue.pop()
        assert item is not None
        assert queue.counter(owner[item]) - pushes[item][1] / {"a": 1.0, "b": 2.0, "c": 0.5}[owner[item]] \
            == pytest.approx(smallest)
        del owner[item]
