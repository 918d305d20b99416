"""A paced tenant's rate split kept in Redis for several replicas (``_shared_split``),
against a real ``redis-server``, with scripted engines (``tests.unit.test_rate_split``)."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests._redis import RedisServer, require_redis_client

require_redis_client()

from tests.unit.test_rate_split import R, Engines  # noqa: E402
from tokenpace.gateway.engines import RateSplitter  # noqa: E402
from tokenpace.gateway.engines import SharedSplitBook  # noqa: E402
from tokenpace.gateway.state import StateUnavailable  # noqa: E402
from tokenpace.gateway.state import RedisStore  # noqa: E402

SLACK_S = 2.0  # store calls' timeout: a loaded machine must not turn these into latency tests


async def _replicas(url: str, engines: Engines, n: int = 2, lease_s: float = 10.0,
                    clocks: list[int] | None = None) -> list[tuple[RedisStore, RateSplitter]]:
    out = []
    for i in range(n):
        store = RedisStore(url, timeout_s=SLACK_S, lease_s=lease_s)
        await store.start()
        wall = (lambda c=clocks[i]: c) if clocks else None
        book = SharedSplitBook(store, replica=f"replica-{i}")
        splitter = (RateSplitter(engines.send, book=book) if wall is None
                    else RateSplitter(engines.send, book=book, wall_ns=wall))
        await book.start()
        out.append((store, splitter))
    return out


async def _close(replicas: list[tuple[RedisStore, RateSplitter]]) -> None:
    for store, splitter in replicas:
        await splitter.close()
        await store.close()


def test_two_replicas_split_one_rate_over_their_streams(redis_server: RedisServer) -> None:
    """Replica 0 starts a stream on e1, replica 1 one on e2: each sees the other's stream
    in the store, so e1 is lowered to R/2 before e2's request carries R/2; when replica
    0's stream ends, replica 0 raises e2 back to R."""
    async def main() -> None:
        engines = Engines()
        (_, one), (_, two) = replicas = await _replicas(redis_server.url, engines)
        try:
            share, v1 = await one.start("t", R, "e1")
            assert share == R and engines.calls == []
            share, v2 = await two.start("t", R, "e2")
            assert share == R / 2 and engines.calls == [("e1", R / 2)]
            assert v2 > v1
            engines.adopt("e2", share, v2)
            one.end("t", R, "e1")
            await one.drain()
            assert engines.calls[-1] == ("e2", R) and engines.rate["e2"] == R
        finally:
            await _close(replicas)
    asyncio.run(main())


def test_versions_follow_one_sequence_per_tenant_whatever_the_replicas_clocks(
        redis_server: RedisServer) -> None:
    """Replica 1's clock is far behind replica 0's: its changes still number above the
    ones replica 0 gave out (the last version is kept in the store)."""
    async def main() -> None:
        engines = Engines()
        replicas = await _replicas(redis_server.url, engines, clocks=[10**18, 5])
        (_, ahead), (_, behind) = replicas
        try:
            _, v_ahead = await ahead.start("t", R, "e1")
            _, v_behind = await behind.start("t", R, "e2")
            assert v_ahead >= 10**18 and v_behind > v_ahead
            assert engines.version["e1"] > v_ahead  # the lowering, numbered by replica 1
        finally:
            await _close(replicas)
    asyncio.run(main())


def test_a_dead_replicas_streams_stop_counting(redis_server: RedisServer) -> None:
    """A replica that stops marking itself alive (crashed: no end for its streams) is
    ignored once its mark expires: the survivor's next change gives its engine all of R."""
    async def main() -> None:
        engines = Engines()
        replicas = await _replicas(redis_server.url, engines, lease_s=0.5)
        (store0, dead), (_, alive) = replicas
        try:
            await dead.start("t", R, "e1")
            await dead.book.close()  # it stops marking itself alive, as a crashed one would
            await store0.close()
            share, _ = await alive.start("t", R, "e2")
            assert share == R / 2  # e1's stream still counts: its replica may be alive
            await asyncio.sleep(1.0)  # two lease times
            share, _ = await alive.start("t", R, "e2")
            assert share == R, "a dead replica's stream still lowers the tenant's share"
        finally:
            await alive.close()
            await replicas[1][0].close()
    asyncio.run(main())


def test_a_start_the_store_cannot_count_fails(redis_server: RedisServer) -> None:
    async def main() -> None:
        engines = Engines()
        replicas = await _replicas(redis_server.url, engines)
        try:
            redis_server.kill()
            with pytest.raises(StateUnavailable):
                await replicas[0][1].start("t", R, "e1")
        finally:
            await _close(replicas)
    asyncio.run(main())


@pytest.mark.parametrize("seed", range(6))
def test_random_starts_and_ends_on_two_replicas_never_exceed_the_rate(
        redis_server: RedisServer, seed: int) -> None:
    """As the in-process test, with each start and end on one of two replicas at random:
    the rates in force on engines running the tenant's streams never add up to more than
    R, and once all is quiet they add up to R exactly while streams remain."""
    async def main() -> None:
        engines = Engines(delay=0.003, seed=seed)
        replicas = await _replicas(redis_server.url, engines)
        splitters = [s for _, s in replicas]
        rng = random.Random(seed)
        running: list[tuple[str, RateSplitter]] = []
        pending: list[asyncio.Task[None]] = []

        async def arrive(url: str, splitter: RateSplitter, share: float, version: int) -> None:
            await asyncio.sleep(rng.random() * 0.006)
            engines.streams[url] = engines.streams.get(url, 0) + 1
            running.append((url, splitter))
            engines.adopt(url, share, version)

        async def begin(url: str, splitter: RateSplitter) -> None:
            share, version = await splitter.start("t", R, url)
            pending.append(asyncio.create_task(arrive(url, splitter, share, version)))

        try:
            for _ in range(40):
                if running and rng.random() < 0.45:
                    url, splitter = running.pop(rng.randrange(len(running)))
                    engines.streams[url] -= 1
                    splitter.end("t", R, url)
                else:
                    pending.append(asyncio.create_task(
                        begin(rng.choice(["e1", "e2", "e3"]), rng.choice(splitters))))
                await asyncio.sleep(rng.random() * 0.004)
            while not all(task.done() for task in pending):
                await asyncio.gather(*pending)
            for splitter in splitters:
                await splitter.drain()
            assert engines.worst <= R + 1e-9, engines.worst
            if running:
                total = sum(engines.rate[u] for u, n in engines.streams.items() if n > 0)
                assert total == pytest.approx(R)
        finally:
            await _close(replicas)
    asyncio.run(main())
