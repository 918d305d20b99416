"""A paced tenant's rate split over engines (``_rate_split``), with scripted engines.

Each fake engine keeps the rate in force and its version the way the engine does (an
older version is not adopted); a request's own share is applied when it "arrives", which
the tests can delay, as a slow API server would.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from tokenpace.gateway.engines import NewerVersion, RateSplitter, SplitFailed, split

R = 60.0


class Engines:
    def __init__(self, delay: float = 0.0, seed: int = 0) -> None:
        self.rate: dict[str, float] = {}
        self.version: dict[str, int] = {}
        self.calls: list[tuple[str, float]] = []
        self.failing: set[str] = set()
        self.rng = random.Random(seed)
        self.delay = delay
        self.streams: dict[str, int] = {}
        self.worst = 0.0

    def adopt(self, url: str, rate: float, version: int) -> None:
        if version >= self.version.get(url, -1):
            self.rate[url], self.version[url] = rate, version
        self.check()

    def check(self) -> None:
        """The sum of what engines with streams pace the tenant at."""
        total = sum(self.rate.get(u, 0.0) for u, n in self.streams.items() if n > 0)
        self.worst = max(self.worst, total)

    async def send(self, url: str, user: str, rate: float, version: int) -> None:
        if self.delay:
            await asyncio.sleep(self.rng.random() * self.delay)
        if url in self.failing:
            raise RuntimeError("down")
        self.calls.append((url, rate))
        self.adopt(url, rate, version)


def test_split_is_proportional_to_streams() -> None:
    assert split(R, {"a": 2, "b": 1, "c": 0}) == {"a": 40.0, "b": 20.0}
    assert split(R, {}) == {}


def test_one_engine_needs_no_control_call() -> None:
    async def main() -> None:
        engines = Engines()
        splitter = RateSplitter(engines.send)
        for _ in range(3):
            share, _ = await splitter.start("t", R, "e1")
            assert share == R
        splitter.end("t", R, "e1")
        await splitter.drain()
        assert engines.calls == []
    asyncio.run(main())


def test_spreading_lowers_the_others_first_and_ending_raises_them_back() -> None:
    async def main() -> None:
        engines = Engines()
        splitter = RateSplitter(engines.send)
        await splitter.start("t", R, "e1")
        share, _ = await splitter.start("t", R, "e2")
        assert share == R / 2 and engines.calls == [("e1", R / 2)]
        share, _ = await splitter.start("t", R, "e2")
        assert share == 2 * R / 3 and engines.calls[-1] == ("e1", R / 3)
        splitter.end("t", R, "e2")
        splitter.end("t", R, "e2")
        await splitter.drain()
        assert engines.calls[-1] == ("e1", R), engines.calls
        assert splitter.shares("t") == {"e1": R}
        splitter.end("t", R, "e1")
        await splitter.drain()
        assert splitter.shares("t") == {}
    asyncio.run(main())


def test_a_lowering_that_fails_refuses_the_stream_and_changes_nothing() -> None:
    async def main() -> None:
        engines = Engines()
        splitter = RateSplitter(engines.send)
        await splitter.start("t", R, "e1")
        engines.failing.add("e1")
        with pytest.raises(SplitFailed):
            await splitter.start("t", R, "e2")
        assert splitter.shares("t") == {"e1": R}
        engines.failing.clear()
        assert (await splitter.start("t", R, "e1"))[0] == R  # still alone on e1: no call
        assert engines.calls == []
    asyncio.run(main())


def test_an_engine_holding_a_newer_version_is_numbered_past() -> None:
    async def main() -> None:
        far = 10**18

        async def send(url: str, user: str, rate: float, version: int) -> None:
            if version < far:
                raise NewerVersion(far)

        splitter = RateSplitter(send, wall_ns=lambda: 5)
        await splitter.start("t", R, "e1")
        with pytest.raises(SplitFailed):
            await splitter.start("t", R, "e2")
        share, version = await splitter.start("t", R, "e2")  # the lowering is adopted now
        assert share == R / 2 and version > far
    asyncio.run(main())


@pytest.mark.parametrize("seed", range(20))
def test_random_starts_and_ends_never_exceed_the_rate(seed: int) -> None:
    """Streams start and end on three engines in a random order, control calls and the
    requests' own arrival at random delays: the rates in force on the engines that run
    the tenant's streams never add up to more than R, and once all is quiet they add up
    to R exactly while streams remain."""
    async def main() -> None:
        engines = Engines(delay=0.003, seed=seed)
        splitter = RateSplitter(engines.send)
        rng = random.Random(seed)
        running: list[str] = []
        pending: list[asyncio.Task[None]] = []

        async def arrive(url: str, share: float, version: int) -> None:
            # The request reaches its engine late; there it is a stream from the moment
            # it is added, with the rate it carries adopted first (if not older).
            await asyncio.sleep(rng.random() * 0.006)
            engines.streams[url] = engines.streams.get(url, 0) + 1
            running.append(url)
            engines.adopt(url, share, version)

        async def begin(url: str) -> None:
            share, version = await splitter.start("t", R, url)
            pending.append(asyncio.create_task(arrive(url, share, version)))

        for _ in range(60):
            if running and rng.random() < 0.45:
                url = running.pop(rng.randrange(len(running)))
                engines.streams[url] -= 1
                splitter.end("t", R, url)
            else:
                pending.append(asyncio.create_task(begin(rng.choice(["e1", "e2", "e3"]))))
            await asyncio.sleep(rng.random() * 0.004)
        while not all(task.done() for task in pending):  # begin() adds its arrive()
            await asyncio.gather(*pending)
        await splitter.drain()
        assert engines.worst <= R + 1e-9, engines.worst
        if running:
            total = sum(engines.rate[u] for u, n in engines.streams.items() if n > 0)
            assert total == pytest.approx(R)
    asyncio.run(main())
