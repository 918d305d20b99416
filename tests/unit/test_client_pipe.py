"""``relay.ClientPipe``: what a slow reader's stream may keep, and when the relay waits.

The client is an ASGI ``send`` that takes a body only when the test lets it read, on a
connection whose write side says it is full (``paused``), as uvicorn's does then.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tokenpace.gateway.relay import ClientPipe


class SlowClient:
    """An ASGI ``send`` that returns once the test lets the client read (``read``)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.flow = SimpleNamespace(paused=True, abort=lambda: None)
        self._reading = asyncio.Event()

    def read(self) -> None:
        self._reading.set()

    async def send(self, message: dict) -> None:
        await self._reading.wait()
        self.bodies.append(message["body"])


async def _settle() -> None:
    for _ in range(10):  # let every ready task run
        await asyncio.sleep(0)


def test_within_the_bounds_the_relay_does_not_wait_and_the_client_gets_every_byte() -> None:
    async def run() -> None:
        client, book = SlowClient(), {}
        pipe = ClientPipe(client.send, client.flow, 100, 1000, book, "a")
        assert not pipe.direct  # the client's connection is full
        await asyncio.wait_for(pipe.hold(b"x" * 60), 5)  # returns without the client
        pipe.put(b"y" * 100)  # an answer's last event goes in whatever the bounds
        assert book == {"a": 160} and pipe.held == 160
        client.read()
        await asyncio.wait_for(pipe.drain(), 5)
        assert b"".join(client.bodies) == b"x" * 60 + b"y" * 100
        assert book == {} and pipe.held == 0

    asyncio.run(run())


def test_over_the_request_bound_the_relay_waits_for_the_client() -> None:
    async def run() -> None:
        client, book = SlowClient(), {}
        pipe = ClientPipe(client.send, client.flow, 100, 1000, book, "a")
        await pipe.hold(b"x" * 60)
        over = asyncio.get_running_loop().create_task(pipe.hold(b"x" * 60))
        await _settle()
        assert not over.done() and pipe.held == 120  # 120 bytes kept, over 100: it waits
        client.read()
        await asyncio.wait_for(over, 5)
        assert pipe.held <= 100
        await pipe.drain()
        assert len(b"".join(client.bodies)) == 120 and book == {}

    asyncio.run(run())


def test_over_the_tenant_bound_each_request_waits_for_its_own_client() -> None:
    async def run() -> None:
        first, second, book = SlowClient(), SlowClient(), {}
        one = ClientPipe(first.send, first.flow, 1000, 100, book, "a")
        two = ClientPipe(second.send, second.flow, 1000, 100, book, "a")
        other = ClientPipe(second.send, second.flow, 1000, 100, book, "b")
        await one.hold(b"x" * 80)
        waiting = asyncio.get_running_loop().create_task(two.hold(b"x" * 40))
        await _settle()
        assert not waiting.done() and book["a"] == 120  # over the tenant's 100
        await asyncio.wait_for(other.hold(b"z" * 80), 5)  # another tenant is not held
        second.read()  # the second request's client reads: it goes on, the first still kept
        await asyncio.wait_for(waiting, 5)
        assert book["a"] == 80
        one.discard()  # the first request ended unread: its bytes leave the tenant's count
        await asyncio.wait_for(other.drain(), 5)
        assert book == {}

    asyncio.run(run())
