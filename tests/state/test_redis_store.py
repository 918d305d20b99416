"""The Redis state store against a real ``redis-server`` (started per test on a free port).

Margins: timing checks measure at the source (the call's own duration, Redis's own clock)
and allow for a busy 2-core CI machine, as each assertion says.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests._redis import RedisServer, require_redis_client

require_redis_client()

from tokenpace.fairness import BudgetRefusal, BudgetSpec  # noqa: E402
from tokenpace.gateway.state import (
    Admission,
    LocalStore,
    Reservation,
    SlotClaim,
    SlotRefusal,
    StateStore,
    StateUnavailable,
    StoreLease,
    open_store,
    parse_state,
    queued_slot,
    running_slot,
)
from tokenpace.gateway.state import FailoverStore  # noqa: E402
from tokenpace.gateway.state import RedisStore  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Tests of atomicity and leases give Redis calls a generous timeout: a loaded CI machine
# must not turn them into tests of latency. The failure tests use TIMEOUT_S.
SLACK_S = 2.0
TIMEOUT_S = 0.2


def run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(coro_fn())


async def redis_time(store: RedisStore) -> float:
    seconds, micros = await store._redis.time()
    return seconds + micros / 1e6


def test_budget_refusal_is_exact_and_matches_the_in_process_store(redis_server: RedisServer) -> None:
    # 100 per day: refill 1/864 per s, so the few ms between the two stores' calls move
    # the figures by < 0.01.
    spec, short = BudgetSpec(100, 86400), BudgetSpec(1000, 86400)

    async def body() -> None:
        shared, local = RedisStore(redis_server.url, timeout_s=SLACK_S), LocalStore()
        try:
            firsts = [await store.reserve("a", [short, spec], 60) for store in (shared, local)]
            assert all(isinstance(first, Reservation) for first in firsts)
            for first in firsts:  # the levels after it, for the response's headers
                assert isinstance(first, Reservation)
                assert first.levels == pytest.approx((940, 40), abs=0.01)
                headroom = first.headroom()
                assert headroom is not None and headroom.budget == spec
                assert headroom.remaining == pytest.approx(40, abs=0.01)
                assert headroom.reset_s == pytest.approx(60 * 864, abs=1.0)
            refusals = [await store.reserve("a", [short, spec], 60) for store in (shared, local)]
            for refusal in refusals:
                assert isinstance(refusal, BudgetRefusal) and refusal.budget == spec
                assert refusal.remaining == pytest.approx(40, abs=0.01)
                assert refusal.cost == 60
                assert refusal.retry_after_s == pytest.approx(20 * 864, abs=1.0)
                assert refusal.reset_s == pytest.approx(60 * 864, abs=1.0)
            too_big = await shared.reserve("a", [spec], 101)
            assert isinstance(too_big, BudgetRefusal) and too_big.retry_after_s == float("inf")
            assert isinstance(firsts[0], Reservation)
            await shared.settle(firsts[0], 10)
            levels = await shared.budget_levels("a", [spec, short])
            assert levels[spec.key] == pytest.approx(90, abs=0.01)
            assert levels[short.key] == pytest.approx(990, abs=1.0)
        finally:
            await shared.close()

    run(body)


def test_processes_reserving_together_never_overspend(redis_server: RedisServer) -> None:
    """4 processes x 60 reservations of 10 against 1000 per hour: at most the budget plus
    its refill over the run (Redis's clock) is granted, and contention did happen."""
    async def clock() -> float:
        store = RedisStore(redis_server.url, timeout_s=SLACK_S)
        try:
            return await redis_time(store)
        finally:
            await store.close()

    start = run(clock)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.state._reserver", redis_server.url,
                               "t", "10", "60"], stdout=subprocess.PIPE, env=env, cwd=ROOT)
             for _ in range(4)]
    granted = [int(p.communicate(timeout=60)[0]) for p in procs]
    elapsed = run(clock) - start
    total = 10 * sum(granted)
    bound = 1000 + elapsed * 1000 / 3600
    assert total <= bound, (granted, bound)
    assert total >= 1000 - 10, granted  # the budget was really used up by several processes
    assert sum(1 for g in granted if g) >= 2


def test_slots_are_global_and_traded_atomically(redis_server: RedisServer) -> None:
    async def body() -> None:
        one, two = (RedisStore(redis_server.url, timeout_s=SLACK_S) for _ in range(2))
        try:
            engine = SlotClaim("engine:e1", 2)
            queued = await one.acquire([queued_slot("a", 1)])
            assert isinstance(queued, StoreLease)
            assert isinstance(await two.acquire([queued_slot("a", 1)]), SlotRefusal)
            running = await one.acquire([running_slot("a", 2), engine], releasing=queued)
            assert isinstance(running, StoreLease) and queued.released
            assert await two.held(["queued:a", "running:a", "engine:e1"]) == {
                "queued:a": 0, "running:a": 1, "engine:e1": 1}
            other = await two.acquire([running_slot("b", None), engine])
            assert isinstance(other, StoreLease)
            refused = await two.acquire([running_slot("c", None), engine])
            assert isinstance(refused, SlotRefusal) and refused.claim == engine and refused.held == 2
            await one.release(running)
            await one.release(running)  # idempotent
            assert isinstance(await two.acquire([running_slot("c", None), engine]), StoreLease)
        finally:
            await one.close()
            await two.close()

    run(body)


def test_a_killed_holders_slots_come_back_within_the_lease(redis_server: RedisServer) -> None:
    lease_s = 1.5
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-m", "tests.state._holder", redis_server.url,
                               str(lease_s), "engine:e1", "2", "2"],
                              stdout=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"

        async def body() -> float:
            store = RedisStore(redis_server.url, lease_s=lease_s, timeout_s=SLACK_S)
            try:
                # Renewed: still held after two lease times.
                await asyncio.sleep(2 * lease_s)
                assert isinstance(await store.acquire([SlotClaim("engine:e1", 2)]), SlotRefusal)
                holder.send_signal(signal.SIGKILL)
                holder.wait(5)
                killed = await redis_time(store)
                while not isinstance(await store.acquire([SlotClaim("engine:e1", 2)]), StoreLease):
                    await asyncio.sleep(0.02)
                return await redis_time(store) - killed
            finally:
                await store.close()

        back_after = run(body)
        # At most the lease time after the last renewal (which was before the kill), plus
        # polling and a loaded machine: 0.5 s margin.
        assert back_after <= lease_s + 0.5, back_after
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(5)


async def _timed(call: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    started = time.perf_counter()
    try:
        result: Any = await call()
    except StateUnavailable as exc:
        result = exc
    return time.perf_counter() - started, result


# A call may wait its timeout plus event-loop latency on a busy CI machine (0.15 s).
MAX_WAIT_S = TIMEOUT_S + 0.15


@pytest.mark.parametrize("failure", ["kill", "stop"])
def test_closed_fails_fast_and_recovers(redis_server: RedisServer, failure: str) -> None:
    """Killed (connection refused) or frozen (SIGSTOP: nothing answers): every call ends
    within the timeout with StateUnavailable; after it is back, the store recovers."""
    spec = BudgetSpec(1000, 3600)

    async def body() -> None:
        store = open_store(parse_state({"url": redis_server.url, "timeout": "200ms"}, "closed"),
                           workers=2)
        assert isinstance(store, FailoverStore)
        store.primary.probe_s = 0.2
        await store.start()
        try:
            assert isinstance(await store.reserve("a", [spec], 100), Reservation)
            if failure == "kill":
                redis_server.kill()
            else:
                assert redis_server.proc is not None
                redis_server.proc.send_signal(signal.SIGSTOP)
            waits = []
            for _ in range(10):
                for call in (lambda: store.reserve("a", [spec], 100),
                             lambda: store.acquire([running_slot("a", 4)]),
                             lambda: store.lift("l", "a")):
                    took, result = await _timed(call)
                    waits.append(took)
                    assert isinstance(result, StateUnavailable)
                await asyncio.sleep(0.03)
            assert max(waits) <= MAX_WAIT_S, max(waits)
            assert not store.healthy
            if failure == "kill":
                redis_server.start()
            else:
                assert redis_server.proc is not None
                redis_server.proc.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 5
            while True:
                took, result = await _timed(lambda: store.reserve("a", [spec], 100))
                if isinstance(result, Reservation):
                    break
                assert time.monotonic() < deadline, "the store did not recover within 5 s"
                await asyncio.sleep(0.05)
            assert store.healthy
            level = (await store.budget_levels("a", [spec]))[spec.key]
            if failure == "kill":
                # The append-only file kept the first reservation: 1000 - 100 - 100.
                assert level == pytest.approx(800, abs=1)
            else:
                # A frozen Redis runs the calls that timed out once it thaws: each such
                # reservation stays taken (never given back, never granted: the safe side).
                assert level <= 800 + 1
        finally:
            if redis_server.proc is not None:
                redis_server.proc.send_signal(signal.SIGCONT)
            await store.close()

    run(body)


def test_open_falls_back_to_divided_limits_and_recovers(redis_server: RedisServer) -> None:
    spec = BudgetSpec(1000, 3600)

    async def body() -> None:
        store = open_store(parse_state({"url": redis_server.url, "replicas": 2, "timeout": "200ms"},
                                       "open"))
        assert isinstance(store, FailoverStore)
        store.primary.probe_s = 0.2
        await store.start()
        try:
            held = await store.acquire([running_slot("a", 4)])
            assert isinstance(held, StoreLease) and held.store is store.primary
            admitted = await store.admit("b", [spec], 100, queued_slot("b", 4), "l")
            assert isinstance(admitted, Admission)
            redis_server.kill()
            # Admitted through Redis, dispatched and settled while it is down: no error.
            running = await store.dispatch([running_slot("b", 4)], admitted.queued, "l", 100)
            assert isinstance(running, StoreLease) and running.store is store.fallback
            await store.finish(running, admitted.reservation, 10)
            assert store.lost_settlements == 1
            # Fallback: 1000 / 2 per replica, 4 / 2 slots.
            took, first = await _timed(lambda: store.reserve("a", [spec], 400))
            assert isinstance(first, Reservation) and first.store is store.fallback
            assert took <= MAX_WAIT_S
            refusal = await store.reserve("a", [spec], 200)
            assert isinstance(refusal, BudgetRefusal) and refusal.budget.tokens == 500
            slots = [await store.acquire([running_slot("a", 4)]) for _ in range(3)]
            assert [isinstance(s, StoreLease) for s in slots] == [True, True, False]
            assert store.fallbacks["reserve"] == 2 and store.fallbacks["acquire"] == 3
            assert store.fallbacks["dispatch"] == 1
            scraped = _scrape(store)
            assert scraped[("tokenpace_gateway_state_up", ("redis",))] == 0.0
            assert scraped[("tokenpace_gateway_state_fallbacks_total", ("reserve",))] == 2.0
            assert scraped[("tokenpace_gateway_state_failures_total", ())] >= 1.0
            await store.settle(first, 100)  # settled where it was reserved
            assert (await store.fallback.budget_levels("a", [spec]))[spec.key] == pytest.approx(400)
            await store.release(held)  # Redis is down: no error, the lease will expire
            redis_server.start()
            deadline = time.monotonic() + 5
            while True:
                result = await store.reserve("a", [spec], 100)
                if isinstance(result, Reservation) and result.store is store.primary:
                    break
                assert time.monotonic() < deadline, "the store did not recover within 5 s"
                await asyncio.sleep(0.05)
            assert store.healthy
            assert _scrape(store)[("tokenpace_gateway_state_up", ("redis",))] == 1.0
        finally:
            await store.close()

    run(body)


def _scrape(store: StateStore) -> dict[tuple[str, tuple[str, ...]], float]:
    """The state collector's samples, as Prometheus would read them at scrape time."""
    from prometheus_client import CollectorRegistry

    from tokenpace.gateway.state import StateCollector

    registry = CollectorRegistry()
    registry.register(StateCollector(store))
    return {(sample.name, tuple(sample.labels.values())): sample.value
            for family in registry.collect() for sample in family.samples}


def test_shared_counters_and_lift(redis_server: RedisServer) -> None:
    async def body() -> None:
        one, two = (RedisStore(redis_server.url, timeout_s=SLACK_S) for _ in range(2))
        try:
            one.charge("batch", "a", 30.0)
            one.charge("batch", "a", 12.5)
            assert (await one.counters("batch", ["a"]))["a"] == 42.5  # pending ones count
            await one.flush()
            assert await two.counters("batch", ["a", "b"]) == {"a": 42.5, "b": 0.0}
            # Nobody backlogged: b is lifted to the largest counter of the lane.
            assert await two.lift("batch", "b") == 42.5
            assert await two.lift("batch", "c") == 42.5  # b never took a queued place
            waiting = await one.acquire([queued_slot("c", None)])
            assert isinstance(waiting, StoreLease)
            await two.lift("batch", "c")
            assert await two.counters("batch", ["c"]) == {"c": 42.5}
            # c is backlogged with counter 42.5: d is lifted to 42.5; a counter above the
            # floor is never lowered.
            two.charge("batch", "a", 100.0)
            await two.flush()
            assert await one.lift("batch", "d") == 42.5
            assert await one.lift("batch", "a") == 142.5
            # c's place given back: it left the backlog, and the lane's largest counter
            # (a's 142.5) is what a newcomer is lifted to.
            await one.release(waiting)
            assert await one.lift("batch", "e") == 142.5
            # The lift read the lane's backlog set, not the lane's tenants, and dropped
            # those it found out of the backlog: only e (about to queue) is left.
            assert set(await one._redis.smembers(one._k("q", "batch"))) == {"e"}
            await one.record_dispatch("batch", 100.0)
            await two.record_dispatch("interactive", 300.0)
            assert await one.lane_costs(["batch", "interactive", "x"], 30.0) == {
                "batch": 100.0, "interactive": 300.0, "x": 0.0}
        finally:
            await one.close()
            await two.close()

    run(body)


def test_lane_costs_batched_and_read_with_the_counters(redis_server: RedisServer) -> None:
    """An uncontended dispatch's cost goes out with the next flush (its own replica counts
    it at once); one ``read_fairness`` returns the counters and every replica's lane costs,
    also after Redis lost its script cache (a restart); seconds older than the window drop
    out (Redis's own clock, whole seconds: a 2 s window holds the current and the previous
    second, and the older writes are 2.2 s old)."""
    async def body() -> None:
        one, two = (RedisStore(redis_server.url, timeout_s=SLACK_S) for _ in range(2))
        try:
            one.count_dispatch("batch@e1", 40.0)
            one.count_dispatch("batch@e1", 60.0)
            one.charge("batch", "a", 5.0)
            assert await one.lane_costs(["batch@e1"], 30.0) == {"batch@e1": 100.0}
            assert await two.lane_costs(["batch@e1"], 30.0) == {"batch@e1": 0.0}
            await one.flush()
            await two.record_dispatch("interactive@e1", 300.0)
            await two._redis.script_flush()  # as after a restart: the pipeline's EVALSHA fails
            view = await two.read_fairness({"batch": ["a", "b"]},
                                           ["batch@e1", "interactive@e1", "batch@e2"], 30.0)
            assert view.counters == {"batch": {"a": 5.0, "b": 0.0}}
            assert view.lane_costs == {"batch@e1": 100.0, "interactive@e1": 300.0,
                                       "batch@e2": 0.0}
            await two._redis.script_flush()
            one.count_dispatch("batch@e1", 1.0)
            await one.flush()  # the flush's script runs again on its own: nothing lost
            await asyncio.sleep(2.2)
            one.count_dispatch("batch@e1", 7.0)
            await one.flush()
            assert (await two.lane_costs(["batch@e1"], 2.0)) == {"batch@e1": 7.0}
            assert (await one.read_fairness({}, [], 30.0)).lane_costs is None
        finally:
            await one.close()
            await two.close()

    run(body)


@pytest.mark.parametrize("kind", ["redis", "memory"])
def test_stage_calls_admit_dispatch_finish(redis_server: RedisServer, kind: str) -> None:
    """The three per-request calls (one script each with Redis) decide the same on both
    stores: a full queue refuses before the budget, admission lifts an idle tenant, dispatch
    trades the queued place for running slots, finish releases and settles."""
    spec = BudgetSpec(1000, 86400)

    async def body() -> None:
        store: StateStore = (RedisStore(redis_server.url, timeout_s=SLACK_S) if kind == "redis"
                             else LocalStore())
        try:
            store.charge("batch", "b", 70.0)
            if isinstance(store, RedisStore):
                await store.flush()
            admitted = await store.admit("a", [spec], 300, queued_slot("a", 1), "batch")
            assert isinstance(admitted, Admission)
            assert admitted.counter == 70.0  # lifted to b's counter (b idle: the largest)
            full = await store.admit("a", [spec], 300, queued_slot("a", 1), "batch")
            assert isinstance(full, SlotRefusal) and full.claim.key == "queued:a"
            poor = await store.admit("a", [spec], 800, queued_slot("a", 5), "batch")
            assert isinstance(poor, BudgetRefusal)
            assert poor.remaining == pytest.approx(700, abs=0.01)  # nothing taken by refusals
            engine = SlotClaim("engine:e1", 1)
            blocker = await store.acquire([engine])
            assert isinstance(blocker, StoreLease)
            busy = await store.dispatch([running_slot("a", 2), engine], admitted.queued, "batch", 300)
            assert isinstance(busy, SlotRefusal) and busy.claim == engine
            await store.release(blocker)
            running = await store.dispatch([running_slot("a", 2), engine], admitted.queued,
                                           "batch", 300)
            assert isinstance(running, StoreLease) and admitted.queued.released
            assert await store.held(["queued:a", "running:a", "engine:e1"]) == {
                "queued:a": 0, "running:a": 1, "engine:e1": 1}
            assert (await store.lane_costs(["batch"], 30.0))["batch"] == 300.0
            await store.finish(running, admitted.reservation, 120)
            assert await store.held(["running:a", "engine:e1"]) == {"running:a": 0, "engine:e1": 0}
            level = (await store.budget_levels("a", [spec]))[spec.key]
            assert level == pytest.approx(880, abs=0.01)
        finally:
            await store.close()

    run(body)


def test_bench_state_quick(tmp_path: Any) -> None:
    """`tokenpace bench state --quick` keeps working (it starts its own redis-server)."""
    from tests._redis import redis_server_binary

    redis_server_binary()  # skip or fail like the other tests when it is missing
    out = tmp_path / "state.json"
    done = subprocess.run([sys.executable, "-m", "tokenpace.cli", "bench", "state", "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    import json
    result = json.loads(out.read_text())
    assert result["round_trips_per_request"] == 3
    for name in ("memory", "redis"):
        assert result[name]["latency_median_us"] > 0 and result[name]["cpu_us_per_request"] > 0
    for name in ("memory_conversations", "redis_conversations"):
        assert result["dispatcher"][name]["requests_per_s"] > 0


def test_renewal_restores_lost_leases_but_never_released_ones(redis_server: RedisServer) -> None:
    async def body() -> None:
        store = RedisStore(redis_server.url, timeout_s=SLACK_S)
        try:
            kept = await store.acquire([SlotClaim("engine:e1", 4)])
            gone = await store.acquire([SlotClaim("engine:e1", 4)])
            assert isinstance(kept, StoreLease) and isinstance(gone, StoreLease)
            # A renewal already on its way when `gone` is released arrives after the release:
            late = [store._k("r", gone.id), store._k("s", "engine:e1")]
            await store.release(gone)
            assert await store._script("RENEW", late, [store.lease_ms, gone.id, 1]) == 0
            assert (await store.held(["engine:e1"]))["engine:e1"] == 1
            # Redis lost its data (restarted without persistence): renewal takes `kept` again.
            await store._redis.flushall()
            assert (await store.held(["engine:e1"]))["engine:e1"] == 0
            await store.renew()
            assert store.lost_leases == 1
            assert (await store.held(["engine:e1"]))["engine:e1"] == 1
        finally:
            await store.close()

    run(body)


def test_password_in_the_url(tmp_path: Any) -> None:
    server = RedisServer(tmp_path / "redis-auth", password="s3cret").start()
    spec = BudgetSpec(100, 60)

    async def body() -> None:
        good = RedisStore(server.url, timeout_s=SLACK_S)
        bad = RedisStore(server.url.replace("s3cret", "wrong"), timeout_s=SLACK_S)
        try:
            assert isinstance(await good.reserve("a", [spec], 10), Reservation)
            assert good.describe()["url"] == server.url.replace("s3cret", "***")
            with pytest.raises(StateUnavailable):
                await bad.reserve("a", [spec], 10)
            assert not bad.healthy
        finally:
            await good.close()
            await bad.close()

    try:
        run(body)
    finally:
        server.stop()


def test_rediss_url_with_tls(tmp_path: Any) -> None:
    server = RedisServer(tmp_path / "redis-tls", tls=True).start()
    assert server.url.startswith("rediss://")
    assert parse_state(server.url).url == server.url

    async def body() -> None:
        store = RedisStore(server.url, timeout_s=SLACK_S)
        try:
            assert isinstance(await store.reserve("a", [BudgetSpec(100, 60)], 10), Reservation)
            assert store.healthy
        finally:
            await store.close()

    try:
        run(body)
    finally:
        server.stop()


def test_a_burst_beyond_the_connection_pool_waits_instead_of_failing(
        redis_server: RedisServer) -> None:
    """300 calls at once on 64 pooled connections: the extra ones wait for a connection
    (within their deadline) rather than fail, and the store stays healthy. A burst of
    requests is not an outage."""
    async def body() -> None:
        store = RedisStore(redis_server.url, timeout_s=SLACK_S)
        try:
            results = await asyncio.gather(*(store.acquire([SlotClaim(f"burst:{i}", 1)])
                                             for i in range(300)))
            assert all(isinstance(r, StoreLease) for r in results)
            assert store.healthy and store.failures == 0
        finally:
            await store.close()
    run(body)


def test_a_script_missing_from_the_cache_counts_as_an_outage_and_a_script_error_does_not() -> None:
    """After a Redis restart the script cache is empty: redis-py raises ``NoScriptError``
    with the NOSCRIPT code stripped from its message. That is the store not answering the
    request as asked (503, retried), not a bug in a script, which must surface as itself."""
    from redis.exceptions import NoScriptError, ResponseError

    async def body() -> None:
        store = RedisStore("redis://127.0.0.1:1/0", timeout_s=0.5)

        async def missing() -> None:
            raise NoScriptError("No matching script. Please use EVAL.")

        async def broken() -> None:
            raise ResponseError("ERR user_script:1: attempt to compare nil with number")

        with pytest.raises(StateUnavailable):
            await store._run(missing)
        store.healthy, store._retry_at = True, 0.0
        with pytest.raises(ResponseError):
            await store._run(broken)
        await store.close()
    asyncio.run(body())


def test_close_returns_when_a_cancellation_is_absorbed_inside_a_call() -> None:
    """redis-py can absorb a cancellation that lands inside one of its calls (the call
    returns, the task goes on): ``close`` must still end the background loop, as it did
    not when it only cancelled it (``bench state --quick`` then hung for ever)."""
    async def body() -> None:
        store = RedisStore("redis://127.0.0.1:1/0", timeout_s=0.5, flush_s=0.01)
        inside = asyncio.Event()
        absorb = True

        async def absorbing_flush() -> None:  # what such a call does with a cancellation
            inside.set()
            try:
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                if not absorb:
                    raise

        store.flush = absorbing_flush  # type: ignore[method-assign]
        await store.start()
        await asyncio.wait_for(inside.wait(), 5)
        closing = asyncio.ensure_future(store.close())
        done, _ = await asyncio.wait({closing}, timeout=5)
        absorb = False  # a failing store must not hang the test too: let it end now
        if not done:
            store._task.cancel()  # type: ignore[union-attr]
            await closing
        assert done, "close() still waiting for the background loop after 5 s"
    asyncio.run(body())


def test_adapter_notes_go_with_the_flush_and_wait_out_an_outage(
        redis_server: RedisServer) -> None:
    """``adapter_note`` costs no round trip (it goes with the next flush, newer values
    winning); while Redis is down the notes wait for the flush after it is back; a read
    while it is down is a StateUnavailable, not a wait."""
    async def body() -> None:
        store = RedisStore(redis_server.url, timeout_s=TIMEOUT_S, probe_s=0.1)
        try:
            store.adapter_note("http://e1", "a|r1", "busy:1000")
            store.adapter_note("http://e1", "a|r1", "idle:2000")
            store.adapter_note("http://e2", "b|r1", "gone:3000")
            assert await store.adapters_read(["http://e1"]) == {"http://e1": {}}
            await store.flush()
            assert await store.adapters_read(["http://e1", "http://e2", "http://e3"]) == {
                "http://e1": {"a|r1": "idle:2000"}, "http://e2": {"b|r1": "gone:3000"},
                "http://e3": {}}
            redis_server.kill()
            store.adapter_note("http://e1", "c|r1", "busy:4000")
            with pytest.raises(StateUnavailable):
                await store.flush()
            with pytest.raises(StateUnavailable):
                await store.adapters_read(["http://e1"])
            redis_server.start()
            deadline = time.monotonic() + 5
            while True:
                try:
                    await store.flush()
                    break
                except StateUnavailable:
                    assert time.monotonic() < deadline, "the store did not recover within 5 s"
                    await asyncio.sleep(0.05)
            assert (await store.adapters_read(["http://e1"]))["http://e1"] == {
                "a|r1": "idle:2000", "c|r1": "busy:4000"}
        finally:
            await store.close()

    run(body)
