"""``Guard``: the cancel scope a request's waits run in (client gone, request_timeout)."""

from __future__ import annotations

import asyncio

import pytest

from tokenpace.gateway.relay import Guard


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_cancel_interrupts_the_wait_and_the_block_ends_quietly() -> None:
    async def main() -> tuple[bool, bool]:
        guard = Guard()
        asyncio.get_running_loop().call_later(0.01, guard.cancel)
        reached = False
        async with guard:
            await asyncio.sleep(10)
            reached = True
        await asyncio.sleep(0)  # no cancellation is left over for later waits
        return guard.cancelled_caught, reached

    assert run(main()) == (True, False)


def test_the_deadline_interrupts_the_wait() -> None:
    async def main() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        async with Guard(start + 0.05) as guard:
            await asyncio.sleep(10)
        return guard.cancelled_caught, loop.time() - start

    caught, took = run(main())  # type: ignore[misc]
    assert caught and 0.04 <= took < 5


def test_a_block_that_ends_in_time_is_not_marked() -> None:
    async def main() -> bool:
        loop = asyncio.get_running_loop()
        async with Guard(loop.time() + 10) as guard:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)
        return guard.cancelled_caught

    assert run(main()) is False


def test_cancelled_before_the_block_ends_its_first_wait() -> None:
    async def main() -> bool:
        guard = Guard()
        guard.cancel()
        async with guard:
            await asyncio.sleep(10)
        return guard.cancelled_caught

    assert run(main()) is True


def test_a_cancellation_that_found_no_wait_does_not_leak_past_the_block() -> None:
    async def main() -> str:
        guard = Guard()
        guard.cancel()
        async with guard:
            pass  # no await: the cancellation is still pending at the block's end
        await asyncio.sleep(0.01)  # would raise CancelledError if it leaked
        return "went on"

    assert run(main()) == "went on"


def test_a_cancellation_from_elsewhere_passes_through() -> None:
    async def victim(started: asyncio.Event) -> None:
        async with Guard():
            started.set()
            await asyncio.sleep(10)

    async def main() -> None:
        started = asyncio.Event()
        task = asyncio.create_task(victim(started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_other_errors_in_the_block_propagate() -> None:
    async def main() -> None:
        async with Guard(asyncio.get_running_loop().time() + 10):
            raise KeyError("x")

    with pytest.raises(KeyError):
        run(main())
