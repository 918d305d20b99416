"""The bench's aiohttp client sends a request once more when the server closed the
kept-alive connection as it was reused (no answer at all), and never otherwise."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tokenpace.bench._load import stream_aiohttp

EVENT = b'data: {"choices": [{"text": "hi", "token_ids": [7]}]}\n\n'
OK = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
      + str(len(EVENT) + 14).encode() + b"\r\n\r\n" + EVENT + b"data: [DONE]\n\n")


async def _serve(closes: int) -> tuple[asyncio.AbstractServer, list[int]]:
    """A server that reads each request and closes its first ``closes`` connections
    without a byte of answer, then answers one streamed completion per request."""
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(1)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        if len(seen) > closes:
            writer.write(OK)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), seen


@pytest.mark.parametrize("closes", [1, 2])
def test_a_request_closed_unanswered_is_sent_once_more(closes: int) -> None:
    async def body() -> None:
        server, seen = await _serve(closes)
        port = server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                call = stream_aiohttp(session, f"http://127.0.0.1:{port}", {"prompt": "x"})
                if closes == 1:
                    record = await call
                    assert record.token_ids == [7] and len(seen) == 2
                else:  # closed twice: a server that really fails, not a reuse race
                    with pytest.raises(aiohttp.ServerDisconnectedError):
                        await call
                    assert len(seen) == 2
        finally:
            server.close()
            await server.wait_closed()
    asyncio.run(body())
