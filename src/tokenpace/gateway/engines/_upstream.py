"""The gateway's client to the engines: completions over HTTP/1.1, streamed and not, and
the frequent background calls (health, gauges).

A general HTTP client does much per call that this one call never needs: aiohttp built a
request object, URL, header multidict, timer and payload writer for every completion and
was a tenth of the gateway's CPU in a burst (py-spy, docs/benchmarks/gateway.md). Here one request
is one pre-formatted ``bytes`` written to a kept-alive connection, and the answer is
parsed in C by httptools (llhttp, the parser uvicorn uses for the client side), whose
callbacks hand the body over as it arrives.

One ``Upstream`` per engine (``http://`` or ``https://``): a pool of keep-alive connections (at most ``max_connections``,
idle ones dropped after ``keepalive_s``, before the engine would close them), with that
engine's own headers (its ``Authorization``). What the hot path relies on:

- ``post`` returns once the response head arrived; the body is then read with ``read``
  (all of it) or ``chunk`` (what arrived, as it arrives), and the response ends with
  ``release`` (the connection goes back to the pool once the body is complete) or
  ``close`` (the connection is closed: the engine sees the client go and aborts the
  request).
- A cancelled ``post`` closes its connection, so the engine aborts what it was sent.
- A failed connect (nothing was sent) is retried once on a fresh connection, and so is a
  request on a kept-alive connection that the engine closed without a byte of answer: an
  HTTP/1.1 server closes an idle connection only while it is not reading a request (uvicorn's
  keep-alive timer is cancelled by the first byte that arrives), so a request that meets
  that close was never read.
- Reading is paused while more than ``HIGH_WATER`` bytes wait unread (a slow client does
  not make the gateway buffer an engine's whole answer).
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from collections import deque
from contextlib import suppress
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools

from ._router_headers import RouterHeaders

logger = logging.getLogger("tokenpace.gateway")

CONNECT_TIMEOUT_S = 5.0
HIGH_WATER = 256 * 1024
"""Unread body bytes at which a connection stops reading from the engine until the relay
catches up (a completion's events are far smaller; a slow client is what reaches it)."""
LINGER_S = 5.0
"""How long a response released before its body ended (the relay saw ``[DONE]`` but not
the chunked terminator yet) may take to end, so its connection can be reused, before the
connection is closed."""


class UpstreamError(Exception):
    """A failed engine call: connect, send, or a read that ended before the answer did."""


class StaleConnection(UpstreamError):
    """A kept-alive connection closed by the engine before any byte of its answer."""


class ConnectFailed(UpstreamError):
    """No connection to the engine could be opened (nothing was sent)."""


class Upstream:
    """One engine's completions endpoint: a keep-alive connection pool."""

    def __init__(self, base_url: str, max_connections: int, keepalive_s: float,
                 headers: Mapping[str, str] | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine url {base_url!r}: expected http(s)://host:port")
        self._host = parts.hostname
        self._tls = parts.scheme == "https"
        self._port = parts.port or (443 if self._tls else 80)
        # https: the system's trusted certificates, unless a context is given.
        self._ssl = (ssl_context or ssl.create_default_context()) if self._tls else None
        self._prefix = parts.path.encode()  # an engine served under a path
        # Per-engine headers, formatted once: every request writes them as they are.
        self._static = _header_bytes({"host": parts.netloc, **(headers or {})})
        self._max = max_connections
        self._keepalive_s = keepalive_s
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []  # most recently used last (reused first)
        self._open = 0  # connections counted against max_connections
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False
        # The headers a router in front of engines reads (``engines[].headers``), rendered
        # per completion by the proxy; None: none. Set by the connections' owner when they
        # open and when a reload changes them.
        self.router_headers: RouterHeaders | None = None

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> Response:
        """Send a POST; return once the response head arrived.

        A failed connect raises ``ConnectFailed`` at once: nothing was sent, and the
        gateway sends the request to another engine of its pool rather than to this one
        again (``fleet``'s ``Fleet.connect_failed``). A request that was written is sent
        again only where the engine closed a kept-alive connection without reading it
        (module docstring), never after a byte of answer.
        """
        return await self._send(b"POST ", path, body, headers)

    async def fetch(self, method: str, path: str, timeout_s: float,
                    headers: Mapping[str, str] | None = None) -> tuple[int, Mapping[str, str], bytes]:
        """A whole bodiless exchange (the background calls: health, gauges): status,
        headers (lower-case names) and body. Raises ``UpstreamError`` or ``TimeoutError``
        (after ``timeout_s``); the connection is closed then, and reused otherwise. A failed
        connect is not retried: the next periodic call is the retry."""
        resp = None
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._send(method.encode() + b" ", path, b"", headers or {})
                content = await resp.read()
        except BaseException:
            if resp is not None:
                resp.close()
            raise
        resp.release()
        return resp.status, resp.headers, content

    async def _send(self, method: bytes, path: str, body: bytes,
                    headers: Mapping[str, str]) -> Response:
        # Cost: one bytes join and one write; the head is parsed in C on arrival.
        request = b"".join((method, self._prefix, path.encode(), b" HTTP/1.1\r\n",
                            self._static, _header_bytes(headers),
                            b"content-length: %d\r\n\r\n" % len(body), body))
        conn = await self._acquire()
        try:
            return await conn.exchange(request)
        except StaleConnection:
            # The engine never read it (see the module docstring): once more, on a new
            # connection, as the other idle ones may be as old.
            logger.info("engine %s: a kept-alive connection was closed as %s was sent on "
                        "it; sending on a new one", self.base_url, headers.get("x-request-id"))
            conn = await self._acquire(fresh=True)
            return await conn.exchange(request)

    async def close(self) -> None:
        """Close the idle connections now and each busy one when its answer ends; calls
        waiting for a connection fail."""
        self._closed = True
        for conn in list(self._idle):
            conn.shut()
        self._idle.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(UpstreamError("the upstream client is closed"))

    # -- the pool ------------------------------------------------------------------

    async def _acquire(self, fresh: bool = False) -> _Connection:
        """A connection: the most recently used idle one, or a new one (``fresh``: never
        an idle one, which are left in the pool)."""
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise UpstreamError("the upstream client is closed")
            now = loop.time()
            while self._idle and not fresh:
                conn = self._idle.pop()
                if conn.usable and now - conn.idle_since < self._keepalive_s:
                    return conn
                conn.shut()
            if self._open < self._max:
                break
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken, then cancelled: the turn goes to the next one
                else:
                    waiter.cancel()
                    with suppress(ValueError):
                        self._waiters.remove(waiter)
                raise
        self._open += 1
        conn = _Connection(self)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await loop.create_connection(lambda: conn, self._host, self._port, ssl=self._ssl)
        except (OSError, TimeoutError) as exc:
            conn.forget()
            raise ConnectFailed(f"cannot connect to {self.base_url}: {exc!r}") from exc
        except BaseException:
            conn.forget()
            raise
        return conn

    def _reuse(self, conn: _Connection, now: float) -> None:
        """A connection whose answer ended: idle in the pool, or closed when the pool is."""
        if self._closed:
            conn.shut()
            return
        conn.idle_since = now
        self._idle.append(conn)
        self._wake()

    def _forgot(self) -> None:
        self._open -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _discard_idle(self, conn: _Connection) -> None:
        with suppress(ValueError):
            self._idle.remove(conn)


class Response:
    """An engine's answer whose head arrived; its body is read with ``read`` or ``chunk``."""

    __slots__ = ("status", "_conn", "_headers", "_raw_headers")

    def __init__(self, conn: _Connection, status: int, raw_headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self._conn = conn
        self._raw_headers = raw_headers
        self._headers: dict[str, str] | None = None

    @property
    def headers(self) -> Mapping[str, str]:
        """Response headers, names in lower case (built when first asked for)."""
        if self._headers is None:
            self._headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                             for name, value in self._raw_headers}
        return self._headers

    async def chunk(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some), or ``b""``
        once the body is complete. Raises ``UpstreamError`` when the connection ends first."""
        return await self._conn.take()

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while data := await self._conn.take():
            parts.append(data)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the answer: its connection is reused once the body has ended."""
        self._conn.release()

    def close(self) -> None:
        """Abandon the answer: the connection is closed (the engine aborts the request)."""
        self._conn.shut()


class _Connection(asyncio.Protocol):
    """One kept-alive connection to the engine and the answer it is receiving."""

    def __init__(self, pool: Upstream) -> None:
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._head: asyncio.Future[Response] | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False  # the current answer's body has ended
        self._released = False  # ... and its reader is done with it
        self._error: UpstreamError | None = None
        self._paused = False
        self._counted = True  # holds one of the pool's max_connections
        self._linger: asyncio.TimerHandle | None = None
        self._keep_alive = False  # the engine lets the connection serve another request
        self._reused = False  # it served an answer before the current one
        self._answered = False  # a byte of the current answer arrived
        self.idle_since = 0.0

    @property
    def usable(self) -> bool:
        return self._transport is not None and self._error is None

    # -- the reader's side -----------------------------------------------------------

    async def exchange(self, request: bytes) -> Response:
        """Write ``request`` and wait for the response head."""
        assert self._transport is not None
        self._headers = []
        self._body = []
        self._complete = self._released = self._answered = False
        head = self._head = self._loop.create_future()
        self._transport.write(request)
        try:
            return await head
        except BaseException:
            self.shut()  # cancelled, or failed: the engine must not run what it got
            raise

    async def take(self) -> bytes:
        while True:
            if self._body:
                body = self._body
                data = body[0] if len(body) == 1 else b"".join(body)
                self._body = []
                self._buffered = 0
                if self._paused and self._transport is not None:
                    self._paused = False
                    self._transport.resume_reading()
                return data
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def release(self) -> None:
        self._released = True
        if self._linger is not None:
            return
        if self._complete:
            self._reuse()
        elif self.usable:
            # The relay has what it needs ([DONE]); the chunked terminator is on its way.
            self._linger = self._loop.call_later(LINGER_S, self.shut)
        else:
            self.shut()

    def shut(self) -> None:
        """Close the connection and give up its place in the pool."""
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self._error is None:
            self._error = UpstreamError("the connection was closed")
        self._wake()
        if self._transport is not None:
            transport, self._transport = self._transport, None
            transport.close()
        self.forget()

    def forget(self) -> None:
        if self._counted:
            self._counted = False
            self._pool._forgot()

    def _reuse(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self._keep_alive and self.usable:
            self._reused = True
            self._pool._reuse(self, self._loop.time())
        else:
            self.shut()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        # Per read (each streamed chunk): one attribute store, so that a close before any
        # byte of answer can be told from one mid-answer (only the former is retried).
        self._answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed answer from the engine: {exc}"))
            self.shut()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if not self._complete:
            kind = StaleConnection if self._reused and not self._answered else UpstreamError
            self._fail(kind("the engine closed the connection"
                            + (f" ({exc!r})" if exc else "")))
        elif self._error is None:
            self._error = UpstreamError("the engine closed the connection")
        self._pool._discard_idle(self)
        self.forget()

    # -- httptools callbacks -----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        head = self._head
        if head is not None and not head.done():
            head.set_result(Response(self, self._parser.get_status_code(), self._headers))

    def on_body(self, body: bytes) -> None:
        if self._released:
            return  # the reader has what it wanted; the rest is dropped
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()
        self._wake()
        if self._released:
            self._reuse()

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error
        head = self._head
        if head is not None and not head.done():
            head.set_exception(error)
        self._wake()


_LINE_BREAK = re.compile(r"[\r\n\0]")


def _header_bytes(headers: Mapping[str, str]) -> bytes:
    """``name: value`` lines; a header that could split the request is refused."""
    out = []
    for name, value in headers.items():
        if _LINE_BREAK.search(name) or _LINE_BREAK.search(value):
            raise ValueError(f"header {name!r}: line breaks and NUL are not allowed")
        out.append(f"{name}: {value}\r\n")
    return "".join(out).encode("latin-1")


