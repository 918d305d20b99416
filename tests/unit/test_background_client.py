"""The gateway's background client to an engine (``background_client``), against real
sockets: a request that meets an engine's keep-alive close unread goes again once, on a
reused connection only; a rate-control call survives it."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import httpx
import pytest

from tests.unit.test_upstream import Handler, Script, answer_json, closing_on, run
from tokenpace.gateway.engines import background_client, http_send


def client(server: Script) -> httpx.AsyncClient:
    return background_client(server.url, {"authorization": "Bearer k"}, 8, 2.0)


def resetting_on(nth: int) -> Handler:
    """As ``closing_on``, but the ``nth`` request's connection is reset (RST), as a close
    with the request still unread in the engine's socket buffer is."""
    seen: dict[int, int] = {}

    async def handler(request: bytes, writer: asyncio.StreamWriter) -> None:
        count = seen[id(writer)] = seen.get(id(writer), 0) + 1
        if count == nth:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        await answer_json(request, writer)
    return handler


@pytest.mark.parametrize("handler", [closing_on(2), resetting_on(2)], ids=["closed", "reset"])
def test_a_kept_alive_connection_closed_unread_is_sent_again(handler: Handler) -> None:
    async def main() -> None:
        async with Script(handler) as server:
            async with client(server) as c:
                for _ in range(2):
                    resp = await c.post("/tokenize", json={"prompt": "x"})
                    assert resp.json() == {"ok": True}
            # the second call: written on the kept-alive connection, dropped unanswered,
            # answered on a new connection
            assert server.connections == 2 and len(server.requests) == 3
            assert all(b"authorization: Bearer k" in r for r in server.requests)
    run(main)


def test_a_new_connection_closed_unread_is_not_sent_again() -> None:
    async def main() -> None:
        async with Script(closing_on(1)) as server:
            async with client(server) as c:
                with pytest.raises(httpx.RemoteProtocolError):
                    await c.post("/tokenize", json={})
            assert server.connections == 1 and len(server.requests) == 1
    run(main)


def test_a_second_close_of_the_same_call_fails_it() -> None:
    """Once only: an engine that drops every request after the first on each connection
    fails the call on the resend's connection too, if that one was reused."""
    async def main() -> None:
        async with Script(closing_on(2)) as server:
            async with client(server) as c:
                first, second = await asyncio.gather(c.post("/a", json={}), c.post("/b", json={}))
                assert first.status_code == second.status_code == 200  # two connections
                with pytest.raises(httpx.RemoteProtocolError):
                    await c.post("/c", json={})  # reused, dropped; again reused, dropped
            assert server.connections == 2 and len(server.requests) == 4
    run(main)


def test_an_outer_trace_still_sees_the_exchange() -> None:
    async def main() -> None:
        events: list[str] = []

        async def trace(event: str, info: dict) -> None:
            events.append(event)

        async with Script(closing_on(2)) as server:
            async with client(server) as c:
                await c.post("/a", json={})
                await c.post("/a", json={}, extensions={"trace": trace})
        assert events.count("http11.send_request_headers.started") == 2  # both attempts
        assert "connection.connect_tcp.complete" in events  # the resend's new connection
    run(main)


def test_a_rate_change_survives_the_keep_alive_close() -> None:
    """The rate-control call (``http_send``) over the background client: a lowering that
    met the engine's keep-alive close is applied, not refused."""
    seen: dict[int, int] = {}

    async def engine(request: bytes, writer: asyncio.StreamWriter) -> None:
        count = seen[id(writer)] = seen.get(id(writer), 0) + 1
        if count == 2:
            writer.close()
            return
        rates = json.loads(request.split(b"\r\n\r\n", 1)[1])["rates"]
        body = json.dumps({"rates": rates}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    async def main() -> None:
        async with Script(engine) as server:
            async with client(server) as c:
                send = http_send({server.url: c})
                await send(server.url, "paced", 40.0, 7)
                await send(server.url, "paced", 20.0, 8)
            assert [json.loads(r.split(b"\r\n\r\n", 1)[1])["rates"]["paced"]["version"]
                    for r in server.requests] == [7, 8, 8]
    run(main)
