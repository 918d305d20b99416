"""``state`` / ``on_state_failure`` parsing, ``--workers`` refusal and the in-process store."""

from __future__ import annotations

import asyncio

import pytest

from tokenpace.fairness import BudgetRefusal, BudgetSpec
from tokenpace.gateway.state import (
    LocalStore,
    SlotRefusal,
    StateConfigError,
    StoreLease,
    check_workers,
    parse_state,
    queued_slot,
    running_slot,
)


def test_default_is_in_process_and_closed() -> None:
    config = parse_state(None)
    assert not config.shared and config.on_failure == "closed"


def test_url_forms() -> None:
    assert parse_state("redis://127.0.0.1:6379/0").url == "redis://127.0.0.1:6379/0"
    tls = parse_state("rediss://:s3cret@redis.example:6380/2", "open")
    assert tls.on_failure == "open" and tls.redacted_url() == "rediss://:***@redis.example:6380/2"
    full = parse_state({"url": "redis://r:6379", "replicas": 3, "lease": "5s", "timeout": "50ms"})
    assert (full.replicas, full.lease_s, full.timeout_s) == (3, 5.0, 0.05)
    assert full.fallback_divisor(workers=1) == 3
    assert parse_state("redis://r:6379").fallback_divisor(workers=4) == 4


@pytest.mark.parametrize("state, failure, named", [
    ("http://r:6379", None, "state"),
    ("redis://", None, "state"),
    ("redis://r:6379/x", None, "state"),
    (42, None, "state"),
    ({"replicas": 2}, None, "state.url"),
    ({"url": "redis://r", "replica": 2}, None, "state.replica"),
    ({"url": "redis://r", "replicas": 0}, None, "state.replicas"),
    ({"url": "redis://r", "lease": "100ms"}, None, "state.lease"),
    ({"url": "redis://r", "timeout": "5s"}, None, "state.timeout"),
    ("redis://r", "sometimes", "on_state_failure"),
])
def test_bad_values_name_the_key(state: object, failure: object, named: str) -> None:
    with pytest.raises(StateConfigError, match=f"^{named}:"):
        parse_state(state, failure)


def test_workers_need_shared_state() -> None:
    assert check_workers(1, parse_state(None)) is None
    message = check_workers(2, parse_state(None))
    assert message is not None and "--workers 2" in message and "'state'" in message
    assert check_workers(3, parse_state("redis://r:6379")) is None
    assert check_workers(0, parse_state("redis://r:6379")) is not None


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_local_budget_exact_refusal_and_settle() -> None:
    clock = FakeClock()
    store = LocalStore(clock)
    spec = BudgetSpec(100, 10)  # refill 10/s

    async def run() -> None:
        first = await store.reserve("a", [spec], 60)
        assert not isinstance(first, BudgetRefusal)
        refusal = await store.reserve("a", [spec], 60)
        assert isinstance(refusal, BudgetRefusal)
        assert refusal.remaining == pytest.approx(40)
        assert refusal.retry_after_s == pytest.approx(2.0)
        assert refusal.reset_s == pytest.approx(6.0)
        await store.settle(first, 10)  # used 10 of 60: 50 come back
        assert (await store.budget_levels("a", [spec]))[spec.key] == pytest.approx(90)

    asyncio.run(run())


def test_fallback_divides_every_limit() -> None:
    clock = FakeClock()
    store = LocalStore(clock, divisor=2)
    spec = BudgetSpec(100, 10)

    async def run() -> None:
        assert not isinstance(await store.reserve("a", [spec], 50), BudgetRefusal)
        refusal = await store.reserve("a", [spec], 1)
        assert isinstance(refusal, BudgetRefusal) and refusal.budget.tokens == 50
        leases = [await store.acquire([running_slot("a", 5)]) for _ in range(3)]
        assert [isinstance(x, StoreLease) for x in leases] == [True, True, False]
        assert isinstance(leases[2], SlotRefusal) and leases[2].held == 2

    asyncio.run(run())


def test_local_lift_forfeits_idle_credit() -> None:
    store = LocalStore(FakeClock())

    async def run() -> None:
        store.charge("l", "a", 100.0)
        # Nobody backlogged: b is lifted to the largest counter of the lane.
        assert await store.lift("l", "b") == 100.0
        store.charge("l", "b", 50.0)
        lease = await store.acquire([queued_slot("b", None)])
        assert isinstance(lease, StoreLease)
        # b is backlogged at 150: c is lifted to 150, the smallest backlogged counter.
        assert await store.lift("l", "c") == 150.0
        await store.release(lease)
        store.charge("l", "c", 500.0)
        # b left the backlog (its place given back): d goes to c's 650, the only one waiting.
        await store.acquire([queued_slot("c", None)])
        assert await store.lift("l", "d") == 650.0

    asyncio.run(run())


def test_local_levels_survive_a_restart_when_restored() -> None:
    clock = FakeClock()
    spec = BudgetSpec(100, 10)
    store = LocalStore(clock)
    store.restore_levels("a", [spec], {spec.key: 25.0, "other/1s": 1.0})

    async def run() -> None:
        refusal = await store.reserve("a", [spec], 30)
        assert isinstance(refusal, BudgetRefusal) and refusal.remaining == pytest.approx(25)

    asyncio.run(run())
