"""Gateway replicas sharing slots and fair-queue counters in a real ``redis-server``: real
gateway processes over HTTP in front of the fake engine, which counts what it runs at once.

``max_concurrency``, ``max_queued`` and engine ``max_inflight`` are global leases; a killed
replica's slots come back within the lease time; two backlogged tenants get their fair
shares through two replicas (shared VTC counters). Counts are taken at the engine, and the
tests wait for states (every request either at the engine or queued in a gateway), not for
times, except the lease expiry, which is measured from the kill with its margin stated.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._redis import RedisServer, require_redis_client
from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_A, KEY_B, GatewayProcess, base_config

require_redis_client()

BODY = {"model": "fake", "prompt": "hello", "max_tokens": 4}



@pytest.fixture
def held_engine() -> Iterator[EngineServer]:
    """A fake engine whose completions wait at its gate until the test opens it."""
    server = EngineServer().start()
    server.engine.gate = threading.Event()
    yield server
    server.engine.gate.set()
    server.stop()


def start_replicas(engine: EngineServer, tmp_path: Path, redis_url: str, n: int,
                   edit: Callable[[dict[str, Any]], None] = lambda c: None,
                   **state: Any) -> list[GatewayProcess]:
    out = []
    for i in range(n):
        home = tmp_path / f"replica-{i}"
        home.mkdir()
        config = base_config(engine.url, home / "usage.db")
        # A generous timeout: on a loaded 2-core box a 100 ms Redis call can time out and
        # answer 503; timeouts themselves are tested in tests/state.
        config["state"] = {"url": redis_url, "timeout": "1s", **state}
        edit(config)
        out.append(GatewayProcess(home, config).start())
    return out


def post(gw: GatewayProcess, key: str = KEY_A, body: dict[str, Any] = BODY) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {key}"})


def queued(gws: list[GatewayProcess]) -> float:
    return sum(gw.metric("tokenpace_gateway_queued_requests", tenant=t) or 0.0
               for gw in gws for t in ("team-a", "team-b"))


def wait_until(what: Callable[[], bool], timeout_s: float, message: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, message()
        time.sleep(0.05)


def settled(engine: EngineServer, gws: list[GatewayProcess], total: int) -> Callable[[], bool]:
    """Every one of ``total`` requests is at the engine or queued in a gateway."""
    return lambda: len(engine.engine.requests) + queued(gws) == total


def test_tenant_concurrency_is_global_across_two_replicas(
        held_engine: EngineServer, tmp_path: Path, redis_server: RedisServer) -> None:
    def edit(config: dict[str, Any]) -> None:
        config["tenants"][0]["max_concurrency"] = 2
    gws = start_replicas(held_engine, tmp_path, redis_server.url, 2, edit)
    engine = held_engine.engine
    try:
        with ThreadPoolExecutor(6) as pool:
            answers = [pool.submit(post, gws[i % 2]) for i in range(6)]
            wait_until(settled(held_engine, gws, 6), 30, lambda: (
                f"engine has {len(engine.requests)} requests, gateways queue {queued(gws)}; "
                f"per-process limits would let 4 through"))
            # Held at the gate: what reached the engine is what the limit let through.
            assert len(engine.requests) == 2 and engine.active == 2, len(engine.requests)
            engine.gate.set()  # type: ignore[union-attr]
            codes = [a.result().status_code for a in answers]
        assert codes == [200] * 6, codes
        assert engine.peak == 2, engine.peak
    finally:
        for gw in gws:
            gw.stop()


def test_engine_max_inflight_is_global_across_two_replicas(
        held_engine: EngineServer, tmp_path: Path, redis_server: RedisServer) -> None:
    def edit(config: dict[str, Any]) -> None:
        config["engines"][0]["max_inflight"] = 3
    gws = start_replicas(held_engine, tmp_path, redis_server.url, 2, edit)
    engine = held_engine.engine
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(post, gws[i % 2], (KEY_A, KEY_B)[i // 2 % 2])
                       for i in range(8)]
            wait_until(settled(held_engine, gws, 8), 30, lambda: (
                f"engine has {len(engine.requests)} requests, gateways queue {queued(gws)}; "
                f"per-process limits would let 6 through"))
            assert len(engine.requests) == 3 and engine.active == 3, len(engine.requests)
            engine.gate.set()  # type: ignore[union-attr]
            codes = [a.result().status_code for a in answers]
        assert codes == [200] * 8, codes
        assert engine.peak == 3, engine.peak
    finally:
        for gw in gws:
            gw.stop()


LEASE_S = 2.0


def test_a_sigkilled_replicas_slots_come_back_within_the_lease(
        held_engine: EngineServer, tmp_path: Path, redis_server: RedisServer) -> None:
    def edit(config: dict[str, Any]) -> None:
        config["tenants"][0]["max_concurrency"] = 1
    gws = start_replicas(held_engine, tmp_path, redis_server.url, 2, edit,
                         lease=f"{LEASE_S:g}s", timeout="0.5s")
    engine = held_engine.engine
    victim, survivor = gws
    try:
        with ThreadPoolExecutor(2) as pool:
            pool.submit(post, victim)  # holds team-a's only slot at the gate
            wait_until(lambda: len(engine.requests) == 1, 30, lambda: "nothing reached the engine")
            waiting: Future[httpx.Response] = pool.submit(post, survivor)
            wait_until(lambda: queued([survivor]) == 1, 30,
                       lambda: f"the survivor did not queue; engine has {len(engine.requests)}")
            assert len(engine.requests) == 1  # the victim's lease holds the global slot
            assert victim.server is not None
            victim.server.proc.kill()  # SIGKILL: no release, no shutdown
            killed = time.monotonic()
            victim.server.proc.wait(10)
            # Renewals stop with the process: its lease expires at most LEASE_S after the
            # kill; the survivor polls every 25 ms. 2 s of margin for a loaded box.
            wait_until(lambda: len(engine.requests) == 2, LEASE_S + 2.0,
                       lambda: "the killed replica's slot did not come back within the lease")
            took = time.monotonic() - killed
            engine.gate.set()  # type: ignore[union-attr]
            assert waiting.result().status_code == 200
        assert took <= LEASE_S + 2.0
        rows = survivor.rows(1)
        assert [r.finish_reason for r in rows] == ["length"], rows
    finally:
        for gw in gws:
            gw.stop()


ROUTES = {
    # (replica, key) per client thread
    "spread": [(0, KEY_A), (1, KEY_A), (0, KEY_B), (1, KEY_B)] * 2,
    "skewed": [(0, KEY_A)] * 3 + [(1, KEY_A)] * 3 + [(1, KEY_B)] * 6,
}


@pytest.mark.parametrize("routing", ["spread", "skewed"])
def test_two_backlogged_tenants_share_fairly_through_two_replicas(
        engine: EngineServer, tmp_path: Path, redis_server: RedisServer, routing: str) -> None:
    """Two equal-weight tenants, both always backlogged, engine max_inflight 2 (global).

    spread: both tenants' requests reach both replicas: each replica chooses between them
    by the shared counters; shares 0.5 +- 0.1.
    skewed: team-a through both replicas, team-b through replica 1 only. Replica 0 only
    ever has team-a to send; replica 1 sees (through the shared counters) that team-a is
    ahead and sends team-b, so team-b gets most of replica 1's dispatches; with per-replica
    counters replica 1 would alternate (team-b ~0.5 of its dispatches). team-b needs more
    clients than team-a's on replica 1 to stay backlogged: a tenant that stops waiting,
    even briefly, is lifted to the others' counter and loses its credit (VTC's rule).
    """
    def edit(config: dict[str, Any]) -> None:
        config["engines"][0]["max_inflight"] = 2
        for tenant in config["tenants"]:
            tenant.update(lane="interactive", weight=1)
    gws = start_replicas(engine, tmp_path, redis_server.url, 2, edit)
    body = {**BODY, "max_tokens": 16}
    stop = threading.Event()

    def client(gw: GatewayProcess, key: str) -> None:
        while not stop.is_set():
            assert post(gw, key, body).status_code == 200

    try:
        with ThreadPoolExecutor(len(ROUTES[routing])) as pool:
            running = [pool.submit(client, gws[i], key) for i, key in ROUTES[routing]]
            time.sleep(2.0)  # warm-up: both tenants backlogged on every replica they use
            t0 = time.time()
            time.sleep(8.0)
            t1 = time.time()
            stop.set()
            for r in running:
                r.result()
        served = [{t: sum(r.completion_tokens for r in gw.rows(0)
                          if r.tenant == t and t0 <= r.started_at <= t1)
                   for t in ("team-a", "team-b")} for gw in gws]
        total = {t: served[0][t] + served[1][t] for t in ("team-a", "team-b")}
        share_b = total["team-b"] / sum(total.values())
        on_1 = served[1]["team-b"] / sum(served[1].values())
        print(f"{routing}: served per replica {served}, team-b share {share_b:.3f}, "
              f"of replica 1's service {on_1:.3f}")
        assert sum(total.values()) >= 16 * 40, total
        if routing == "spread":
            # Documented bound (docs/gateway/replicas.md): 0.5 +- 0.1 each.
            assert 0.4 <= share_b <= 0.6, served
        else:
            # Measured on a loaded 2-core box: team-b 0.48-0.51 overall, 0.59-0.71 of
            # replica 1's service; with per-replica counters (the wiring broken on purpose)
            # 0.30 and 0.46. Bound (docs/gateway/replicas.md): >= 0.4 overall. Replica 1's share is
            # not asserted: it rides on the slot race between the replicas, and at a load
            # average of 9 it came to 0.59 against the 0.58 once set for it.
            assert share_b >= 0.4, served
    finally:
        stop.set()
        for gw in gws:
            gw.stop()


def test_closed_refuses_a_request_that_cannot_get_its_slots_while_redis_is_down(
        engine: EngineServer, tmp_path: Path, redis_server: RedisServer) -> None:
    """team-b has no budget: only its slots need Redis, and without them it gets a 503."""
    (gw,) = start_replicas(engine, tmp_path, redis_server.url, 1)
    try:
        assert post(gw, KEY_B).status_code == 200
        redis_server.kill()
        down = post(gw, KEY_B)
        assert down.status_code == 503, down.text
        assert down.headers["retry-after"] == "1"
        assert down.json()["error"]["code"] == "state_unavailable"
        redis_server.start()
        deadline = time.monotonic() + 10
        while (answer := post(gw, KEY_B)).status_code != 200:
            assert answer.status_code == 503 and time.monotonic() < deadline, answer.text
            time.sleep(0.2)
        assert len(engine.engine.requests) == 2  # the refused one never reached the engine
    finally:
        gw.stop()


def test_open_dispatches_under_fallback_limits_and_gives_them_back_after_redis_returns(
        held_engine: EngineServer, tmp_path: Path, redis_server: RedisServer) -> None:
    """max_concurrency 2 over replicas: 2 is 1 per replica while Redis is down; the slot
    taken in the fallback is given back to the fallback when its request ends, after Redis
    came back, and the shared limit of 2 applies again."""
    def edit(config: dict[str, Any]) -> None:
        config["tenants"][0]["max_concurrency"] = 2
        config["on_state_failure"] = "open"
    (gw,) = start_replicas(held_engine, tmp_path, redis_server.url, 1, edit, replicas=2)
    engine = held_engine.engine
    try:
        redis_server.kill()
        with ThreadPoolExecutor(3) as pool:
            first = [pool.submit(post, gw) for _ in range(2)]
            wait_until(settled(held_engine, [gw], 2), 30, lambda: (
                f"engine has {len(engine.requests)}, gateway queues {queued([gw])}"))
            assert len(engine.requests) == 1  # fallback limit: 2 / 2 replicas
            assert gw.metric("tokenpace_gateway_state_up") == 0.0
            health = gw.health()["state"]
            # The first request's running slots, the second's queued place.
            assert health["fallback_leases"] == 2, health
            redis_server.start()
            # The waiting request polls; once Redis answers it takes a shared slot (Redis
            # holds none: the first request's slot is the fallback's).
            wait_until(lambda: len(engine.requests) == 2, 15,
                       lambda: "the queued request did not get a shared slot after Redis returned")
            engine.gate.set()  # type: ignore[union-attr]
            assert [a.result().status_code for a in first] == [200, 200]
        wait_until(lambda: gw.health()["state"]["fallback_leases"] == 0,
                   5, lambda: "the fallback's slot was not given back")
        # Shared again, nothing leaked in Redis: 2 of 3 held requests go, the third waits.
        engine.gate.clear()  # type: ignore[union-attr]
        engine.requests.clear()
        engine.reset_peak()
        with ThreadPoolExecutor(3) as pool:
            again = [pool.submit(post, gw) for _ in range(3)]
            wait_until(settled(held_engine, [gw], 3), 30, lambda: (
                f"engine has {len(engine.requests)}, gateway queues {queued([gw])}"))
            assert len(engine.requests) == 2
            engine.gate.set()  # type: ignore[union-attr]
            assert [a.result().status_code for a in again] == [200] * 3
        # The fallback's decisions were counted: the first request's slots, the second's place.
        assert gw.metric("tokenpace_gateway_state_fallbacks_total", operation="acquire") >= 1
        assert gw.metric("tokenpace_gateway_state_fallbacks_total", operation="admit") >= 1
    finally:
        gw.stop()


def test_release_and_settlement_in_one_call_give_the_budget_back(
        engine: EngineServer, tmp_path: Path, redis_server: RedisServer) -> None:
    """A dispatched request the engine refuses costs nothing: its shared slots and its
    reservation go back in the same store call (FINISH), and the shared budget is full."""
    import asyncio

    from tests.gateway.test_replicas_http import _level

    def edit(config: dict[str, Any]) -> None:
        # Refill 0.1 per second: a reservation of 126 left unsettled shows for minutes.
        config["tenants"][0]["budgets"] = [{"tokens": 10_000, "per": "24h"}]
    (gw,) = start_replicas(engine, tmp_path, redis_server.url, 1, edit)
    try:
        refused = post(gw, body={**BODY, "max_tokens": 60, "fake_error": 400})
        assert refused.status_code == 400, refused.text
        assert len(engine.engine.requests) == 1  # it was dispatched, then refused
        deadline = time.monotonic() + 5
        while (level := asyncio.run(_level(redis_server.url, 10_000, "24h"))) < 10_000 - 1e-6:
            assert time.monotonic() < deadline, f"the reservation was not given back: {level}"
            time.sleep(0.05)
        assert gw.rows(1)[0].finish_reason == "upstream_error"
    finally:
        gw.stop()


def test_max_queued_is_global_across_two_replicas(
        held_engine: EngineServer, tmp_path: Path, redis_server: RedisServer) -> None:
    def edit(config: dict[str, Any]) -> None:
        config["tenants"][0].update(max_concurrency=1, max_queued=1)
    gws = start_replicas(held_engine, tmp_path, redis_server.url, 2, edit)
    engine = held_engine.engine
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(post, gws[0])
            wait_until(lambda: len(engine.requests) == 1, 30, lambda: "nothing reached the engine")
            waiting = pool.submit(post, gws[1])
            wait_until(lambda: queued(gws) == 1, 30, lambda: "the second request did not queue")
            # Replica 0 has nobody waiting, but the tenant's one queued place is taken.
            full = post(gws[0])
            assert full.status_code == 429, full.text
            assert full.json()["error"]["code"] == "queue_full"
            assert "1 waiting on all replicas" in full.json()["error"]["message"]
            engine.gate.set()  # type: ignore[union-attr]
            assert [running.result().status_code, waiting.result().status_code] == [200, 200]
    finally:
        for gw in gws:
            gw.stop()
