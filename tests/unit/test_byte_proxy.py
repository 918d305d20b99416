"""The byte relay of ``bench gateway --control byte-proxy``: what goes in one side comes out
of the other unchanged, both ways, and the ends of a connection reach the other side.

Real sockets on loopback, in process (the bench runs the relay in its own process; the
relay itself is the same code). No timing is asserted."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
import uvloop

from tokenpace.bench import _byte_proxy
from tokenpace.bench._fast_upstream import _Protocol as FastUpstream

Runner = Callable[[Awaitable[None]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    """Run a test's coroutine on asyncio's loop and on uvloop's (the bench runs the relay
    on uvloop, whose transports are not ``asyncio.Transport`` subclasses)."""
    return asyncio.run if request.param == "asyncio" else uvloop.run  # type: ignore[return-value]


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _with_relay(handler: Handler,
                      body: Callable[[int, int], Awaitable[None]]) -> None:
    """Run ``body(relay_port, upstream_port)`` with an upstream serving ``handler`` and the
    relay in front of it."""
    upstream = await asyncio.start_server(handler, "127.0.0.1", 0)
    up_port = upstream.sockets[0].getsockname()[1]
    relay = await _byte_proxy.start(0, "127.0.0.1", up_port)
    try:
        await body(relay.sockets[0].getsockname()[1], up_port)
    finally:
        relay.close()
        upstream.close()


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.read()
    except ConnectionResetError:
        return b"<reset>"


def test_bytes_cross_unchanged_both_ways_and_half_closes_pass_on(run: Runner) -> None:
    # Several megabytes each way, in odd-sized writes: more than the socket buffers hold, so
    # the relay's flow control (pause the side whose peer cannot take more) is exercised.
    request = os.urandom(3_000_000)
    answer = os.urandom(5_000_000)
    received: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read())  # until the client's EOF arrives through the relay
        for i in range(0, len(answer), 70_001):
            writer.write(answer[i:i + 70_001])
            await writer.drain()
        writer.close()

    async def client(port: int, _: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(0, len(request), 33_333):
            writer.write(request[i:i + 33_333])
            await writer.drain()
        writer.write_eof()  # half-close: the upstream's read() ends only if this passes on
        got = await asyncio.wait_for(reader.read(), 30)  # ends only if the upstream's close does
        writer.close()
        assert received == [request]
        assert got == answer

    run(_with_relay(upstream, client))


def test_a_client_that_leaves_closes_the_upstream_connection(run: Runner) -> None:
    seen: asyncio.Queue[bytes] = asyncio.Queue()

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.readexactly(5)
        await seen.put(first)
        await seen.put(await _read_all(reader))  # what follows the client's disconnect
        writer.close()

    async def client(port: int, _: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        assert await asyncio.wait_for(seen.get(), 10) == b"hello"
        writer.close()  # full close, no more data: the upstream must see its connection end
        assert await asyncio.wait_for(seen.get(), 10) in (b"", b"<reset>")

    run(_with_relay(upstream, client))


def test_an_upstream_that_hangs_up_ends_the_client_connection(run: Runner) -> None:
    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(4)
        writer.write(b"bye")
        writer.close()  # the engine closing a connection: the client must get EOF after "bye"

    async def client(port: int, _: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.read(), 10) == b"bye"
        writer.close()

    run(_with_relay(upstream, client))


def test_an_unreachable_upstream_drops_the_client(run: Runner) -> None:
    async def body() -> None:
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        dead_port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()  # nothing listens there now
        relay = await _byte_proxy.start(0, "127.0.0.1", dead_port)
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", relay.sockets[0].getsockname()[1])
            writer.write(b"GET / HTTP/1.1\r\n\r\n")
            assert await asyncio.wait_for(_read_all(reader), 10) in (b"", b"<reset>")
            writer.close()
        finally:
            relay.close()

    run(body())


def test_http_keep_alive_streams_arrive_as_they_do_direct(run: Runner) -> None:
    # A real HTTP client on one keep-alive connection, against the bench's canned upstream
    # (streamed completions, chunked encoding): the same bytes through the relay as direct.
    async def body() -> None:
        loop = asyncio.get_running_loop()
        upstream = await loop.create_server(FastUpstream, "127.0.0.1", 0)
        up_port = upstream.sockets[0].getsockname()[1]
        relay = await _byte_proxy.start(0, "127.0.0.1", up_port)
        relay_port = relay.sockets[0].getsockname()[1]
        payload = {"model": "m", "prompt": "x", "max_tokens": 40, "stream": True}
        try:
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(connector=connector) as session:
                bodies = {}
                for name, port in (("direct", up_port), ("relay", relay_port),
                                   ("relay again", relay_port)):
                    async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                            json=payload) as resp:
                        assert resp.status == 200
                        bodies[name] = await resp.read()
            assert bodies["relay"] == bodies["direct"] == bodies["relay again"]
            assert bodies["direct"].count(b"data: ") == 40 + 2  # tokens, usage, [DONE]
        finally:
            relay.close()
            upstream.close()

    run(body())
