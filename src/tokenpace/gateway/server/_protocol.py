"""Client connections with deadlines and a limit: uvicorn's HTTP protocol, guarded.

uvicorn bounds neither the time a client takes to send its request's headers (a
connection that sends one byte a second, or none, stays open) nor, by default, the number
of connections. ``guarded_protocol`` returns its httptools protocol with three bounds, all
enforced in the protocol's own callbacks, before the gateway's application runs:

- **Headers** within ``header_timeout`` of the request's first byte (of the connection,
  for its first request, so a connection that never sends anything is closed too): else
  a 408 and the connection is closed.
- **Body** within ``body_timeout`` plus one second per ``body_min_rate`` bytes received
  (a large body sent at a fair rate finishes; a trickle is cut): else a 408 and the
  connection is closed. The application waiting for that body sees the client go
  (``http.disconnect``): its request ends as ``client_disconnected``, ledger row written.
- **Connections**: beyond ``max_connections`` open at once, a new connection takes the
  place of the one idle the longest (no request under way: opened or answered, its next
  request's headers not complete), which is closed; only when every connection has a
  request under way is the new connection's request answered 503 with ``retry-after``
  and the connection closed. So idle connections, however many, cannot keep a client
  that sends a request out; requests under way can, up to the limit.

It also hands the application each connection's write side (``ClientFlow``): the relay
reads whether the client keeps up before each write, so a slow reader is fed from memory
while the engine's stream is read on (``relay.ClientPipe``).

Cost: per connection one timer handle; per request two timer handles (headers, body), one
dict in the scope, two ordered-dict operations (the idle connections) and one length
addition per body chunk; nothing per response byte.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..wire import error_body


class ClientFlow:
    """A connection's write side as the relay sees it (``relay.ClientPipe``), given to the
    application in the request's scope as ``scope["extensions"]["tokenpace.flow"]``:
    ``paused`` while the transport's buffer is over its high-water mark (uvicorn's ``send``
    would wait for the client), ``abort()`` drops the connection at once, buffer and all."""

    __slots__ = ("paused", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.paused = False
        self._transport = transport

    def abort(self) -> None:
        self._transport.abort()


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds of ``guarded_protocol`` (from the configuration, read at start-up)."""

    header_timeout_s: float
    body_timeout_s: float
    body_min_rate: int  # bytes per second that extend the body's deadline by one second
    max_connections: int


def _json_response(status: str, code: int, message: str, error: str,
                   extra: bytes = b"") -> bytes:
    body = json.dumps(error_body(code, message, error)).encode()
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n"
            + extra + b"\r\n" + body)


async def _over_limit(scope: Any, receive: Any, send: Any) -> None:
    """The answer to a request on a connection beyond ``max_connections``."""
    body = json.dumps(error_body(
        503, "the gateway has too many client connections open (max_connections); retry "
        "shortly", "too_many_connections")).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"retry-after", b"1"),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def guarded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits`` (pass it as ``uvicorn.Config(http=...)``)."""

    # The connections with no request under way, idle the longest first (this server's).
    idle: OrderedDict[HttpToolsProtocol, None] = OrderedDict()

    class GuardedProtocol(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _flow: ClientFlow | None = None
        _over = False
        _body_started = 0.0
        _body_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._flow = ClientFlow(transport)
            if len(self.connections) > limits.max_connections:  # this one included
                # Room is made by closing the connection idle the longest, if any.
                oldest = next(iter(idle), None)
                if oldest is not None:
                    del idle[oldest]
                    oldest.transport.close()
                else:
                    self._over = True
            idle[self] = None
            self._arm(limits.header_timeout_s, self._headers_late)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            cycle = self.cycle  # a pipelined request's, if one started now
            if not self.transport.is_closing() and (cycle is None or cycle.response_complete):
                idle[self] = None

        def connection_lost(self, exc: Exception | None) -> None:
            idle.pop(self, None)
            self._disarm()
            if self._flow is not None:
                self._flow.paused = False  # sends are dropped from now on: none waits
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["extensions"] = {"tokenpace.flow": self._flow}  # type: ignore[typeddict-unknown-key]
            if self._timer is None:
                self._arm(limits.header_timeout_s, self._headers_late)

        def on_headers_complete(self) -> None:
            self._disarm()
            idle.pop(self, None)
            if self._over:
                app, self.app = self.app, _over_limit
                try:
                    super().on_headers_complete()
                finally:
                    self.app = app
            else:
                super().on_headers_complete()
            self._body_started = self.loop.time()
            self._body_bytes = 0
            self._arm(limits.body_timeout_s, self._body_late)

        def on_body(self, body: bytes) -> None:
            self._body_bytes += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._flow is not None:
                self._flow.paused = True

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._flow is not None:
                self._flow.paused = False

        def _arm(self, delay: float, callback: Any) -> None:
            self._disarm()
            self._timer = self.loop.call_later(delay, callback)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _headers_late(self) -> None:
            self._timer = None
            cycle = self.cycle  # the previous request's, if any: it was answered
            self._cut(f"the request's headers did not arrive within header_timeout "
                      f"({limits.header_timeout_s:g} s)",
                      answer=cycle is None or cycle.response_complete)

        def _body_late(self) -> None:
            self._timer = None
            allowed = self._body_started + limits.body_timeout_s + (
                self._body_bytes / limits.body_min_rate if limits.body_min_rate else 0.0)
            now = self.loop.time()
            if now < allowed:  # enough arrived meanwhile: the deadline moves on
                self._timer = self.loop.call_at(allowed, self._body_late)
                return
            self._cut(f"the request's body did not arrive within body_timeout "
                      f"({limits.body_timeout_s:g} s) plus 1 s per body_min_rate "
                      f"({limits.body_min_rate} bytes) received",
                      answer=not self.cycle.response_started)

        def _cut(self, message: str, answer: bool) -> None:
            """Answer 408 (``answer``: no answer to this request was started) and close the
            connection; the application waiting for the body sees the client go."""
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if answer:
                self.transport.write(_json_response("408 Request Timeout", 408, message,
                                                    "request_timeout"))
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the application's later sends are dropped
                cycle.message_event.set()
            self.transport.close()

    return GuardedProtocol
