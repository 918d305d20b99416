"""A cancel that redis-py's ``asyncio.wait_for`` drops on Python 3.11 (CPython gh-86296)
is raised again by the store (``_redis._keeping_cancel``), so a background loop stopped
with ``cancel()`` ends. Seen in CI: the split's keep-alive ran on after its ``close()``
and the suite hung in ``test_a_dead_replicas_streams_stop_counting``."""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests._redis import RedisServer, require_redis_client

require_redis_client()

from tokenpace.gateway.state._redis import RedisStore, _keeping_cancel  # noqa: E402


async def _cancel_as_the_wait_ends(call_factory) -> asyncio.Task[int]:  # type: ignore[no-untyped-def]
    """Start a task awaiting ``asyncio.wait_for`` on a future, then, in one step of the
    loop, complete the future and cancel the task: the race wait_for loses on 3.11."""
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(call_factory(lambda: asyncio.wait_for(future, 10)))
    await asyncio.sleep(0)  # the task now waits inside wait_for
    future.set_result(7)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return task


async def _bare(call):  # type: ignore[no-untyped-def]
    return await call()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancel from 3.12 on")
def test_wait_for_drops_the_cancel_on_this_python() -> None:
    """The race is real here: without the store's check the cancelled task returns 7."""
    task = asyncio.run(_cancel_as_the_wait_ends(_bare))
    assert not task.cancelled() and task.result() == 7


def test_the_lost_cancel_is_raised_again() -> None:
    task = asyncio.run(_cancel_as_the_wait_ends(_keeping_cancel))
    assert task.cancelled()


def test_an_answer_without_a_cancel_goes_through() -> None:
    async def main() -> int:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(future.set_result, 7)
        return await _keeping_cancel(lambda: asyncio.wait_for(future, 10))
    assert asyncio.run(main()) == 7


def test_a_cancel_from_before_the_call_is_not_raised_again() -> None:
    """A release in a ``finally`` after the task was cancelled (its count is already 1)
    still runs its store call to the end."""
    async def main() -> int:
        async def cleanup() -> int:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return await _keeping_cancel(lambda: asyncio.sleep(0, 7))
            return 0
        task = asyncio.create_task(cleanup())
        await asyncio.sleep(0)
        task.cancel()
        return await task
    assert asyncio.run(main()) == 7


def test_the_store_neither_loses_the_cancel_nor_calls_it_an_outage(
        redis_server: RedisServer) -> None:
    async def main() -> None:
        store = RedisStore(redis_server.url, timeout_s=2.0)
        await store.start()
        try:
            task = await _cancel_as_the_wait_ends(lambda call: store._run(call))
            assert task.cancelled()
            assert store.healthy and store.failures == 0
            await store.split_alive("replica-0")  # the store still answers
        finally:
            await store.close()
    asyncio.run(main())
