"""Feeding a client that reads slower than its engine writes, from memory.

A streamed answer is relayed one ``send`` per engine read. When the client's connection
keeps up, that ``send`` writes at once and nothing here is used. When it does not (its
transport's buffer is over its high-water mark: ``ClientFlow.paused``), waiting in
``send`` would stop the reading of the engine's stream and keep the engine's slot until
the client caught up. ``ClientPipe`` instead keeps the bytes and writes them from a task
of its own as the client reads, so the relay reads the engine on, the request ends when
the engine's answer is complete (its slot back, its usage settled) and the client drains
what is left from memory.

Bounds: a request keeps at most ``stream_buffer_bytes`` and a tenant's requests together
``tenant_stream_buffer_bytes``. Beyond either, the relay waits for the client before it
reads the engine again (backpressure: the slot is then held, as when nothing is kept),
so a tenant's slow readers hold at most that much memory. The whole relay, drain
included, stays within the request's ``request_timeout``.

The connection's write side comes from the server in the request's scope,
``scope["extensions"]["tokenpace.flow"]`` (``server._protocol.ClientFlow``: ``paused``,
``abort()``); without it (another ASGI server) every body is sent as it comes, as before.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from starlette.types import Scope, Send

SLICE_BYTES = 64 * 1024
"""The most one write from the backlog hands the connection: what sits in the transport's
buffer beyond the counted backlog."""


class _NoFlow:
    """The write side of a server that gives none: never paused."""

    __slots__ = ()
    paused = False

    def abort(self) -> None:
        pass


NO_FLOW = _NoFlow()


def client_flow(scope: Scope) -> Any:
    """The connection's write side from ``scope`` (one dict lookup), else ``NO_FLOW``."""
    extensions = scope.get("extensions")
    flow = extensions.get("tokenpace.flow") if extensions else None
    return NO_FLOW if flow is None else flow


class ClientPipe:
    """The bytes a slow client has yet to read, and the task that writes them.

    ``held`` is zero while the client keeps up: the relay then sends itself (``direct``).
    ``book`` holds each tenant's bytes kept (``Runtime.backlogs``), ``tenant`` the key.

    Cost when the client keeps up: none (the relay reads ``held`` and ``flow.paused``).
    When it does not: per engine read one deque append and two additions; per write to
    the client one join of up to ``SLICE_BYTES``.
    """

    __slots__ = ("_send", "flow", "_limit", "_tenant_limit", "_book", "_tenant", "held",
                 "_chunks", "_writer", "_more", "_room", "_closing")

    def __init__(self, send: Send, flow: Any, limit: int, tenant_limit: int,
                 book: dict[str, int], tenant: str) -> None:
        self._send = send
        self.flow = flow
        self._limit, self._tenant_limit = limit, tenant_limit
        self._book, self._tenant = book, tenant
        self.held = 0
        self._chunks: deque[bytes] = deque()
        self._writer: asyncio.Task[None] | None = None
        self._more: asyncio.Future[None] | None = None  # the writer waits for bytes
        self._room: asyncio.Future[None] | None = None  # the relay waits for room
        self._closing = False

    @property
    def direct(self) -> bool:
        """Whether a body may be sent now without waiting: nothing kept, client keeping up."""
        return not self.held and not self.flow.paused

    async def hold(self, body: bytes) -> None:
        """Keep ``body`` for the client; return at once unless a bound is exceeded, then
        once the client has read enough to be back within it."""
        self._add(body)
        # Over the tenant's bound, each of its requests waits for its own client only.
        while self.held > self._limit or (
                self.held and self._book.get(self._tenant, 0) > self._tenant_limit):
            if self._writer is None or self._writer.done():
                return  # nothing left to wait for (the client is gone)
            self._room = asyncio.get_running_loop().create_future()
            await self._room

    def put(self, body: bytes) -> None:
        """Keep ``body`` (an answer's last event) whatever the bounds."""
        self._add(body)

    def _add(self, body: bytes) -> None:
        n = len(body)
        self._chunks.append(body)
        self.held += n
        book = self._book
        book[self._tenant] = book.get(self._tenant, 0) + n
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write())
        elif self._more is not None and not self._more.done():
            self._more.set_result(None)

    async def drain(self) -> None:
        """Wait until the client has been handed everything kept."""
        self._closing = True
        writer = self._writer
        if writer is None:
            return
        if self._more is not None and not self._more.done():
            self._more.set_result(None)
        await asyncio.shield(writer)

    def discard(self) -> None:
        """Drop what is kept (the request is over, the client did not read it): its bytes
        leave the tenant's count, the writer stops. Idempotent."""
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()
        self._release(self.held)
        self._chunks.clear()

    def _release(self, n: int) -> None:
        if not n:
            return
        self.held -= n
        book, tenant = self._book, self._tenant
        left = book.get(tenant, 0) - n
        if left > 0:
            book[tenant] = left
        else:
            book.pop(tenant, None)
        room = self._room
        if room is not None and not room.done():
            room.set_result(None)

    async def _write(self) -> None:
        chunks, loop = self._chunks, asyncio.get_running_loop()
        try:
            while True:
                if not chunks:
                    if self._closing:
                        return
                    self._more = loop.create_future()
                    await self._more
                    continue
                part, size = [], 0
                while chunks and size < SLICE_BYTES:
                    chunk = chunks.popleft()
                    part.append(chunk)
                    size += len(chunk)
                # uvicorn's send waits here until the client has read enough.
                await self._send({"type": "http.response.body", "body": b"".join(part),
                                  "more_body": True})
                self._release(size)
        finally:
            room = self._room
            if room is not None and not room.done():
                room.set_result(None)
