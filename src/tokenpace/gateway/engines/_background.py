"""The gateway's client for its background calls to one engine (``/tokenize``, rate
control, adapter loads, the counts of aborted and ended requests): ``httpx``, with the hot
path's rule for kept-alive connections.

An engine's HTTP server closes a connection that stayed idle past its keep-alive timeout
(vLLM: 5 s). The gateway drops its idle connections sooner, but a loaded engine can run
that timer before it reads a request that already arrived (uvloop runs due timers before
it polls sockets), so a request written on a kept-alive connection can meet the close
unread: ``httpx`` then raises ``RemoteProtocolError`` ("Server disconnected without
sending a response") or a ``ReadError`` (a reset), and a rate-control call failed that way
refuses the tenant's request. ``ResendStale`` sends such a request once more, as
``Upstream`` does for completions: only when its connection was reused (no connect in
this attempt) and failed before the answer's head was read. Every background call may
be repeated (``/tokenize``, reads of counts, versioned rate changes, adapter loads that
vLLM answers "already loaded"), so a head cut midway, which ``httpx`` does not tell apart
from no answer, is sent again too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import httpx

logger = logging.getLogger("tokenpace.gateway")

_STALE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""What a request written on a connection the engine closed unread raises."""


class ResendStale(httpx.AsyncBaseTransport):
    """``inner``'s requests, each sent again once where a kept-alive connection was closed
    before its answer's head (module docstring). Cost: one trace callback per request
    (httpcore calls it at each stage of the exchange, a few times per request)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        seen: set[str] = set()
        given = request.extensions
        outer = given.get("trace")

        async def trace(event: str, info: Mapping[str, Any]) -> None:
            seen.add(event)
            if outer is not None:
                await outer(event, info)

        request.extensions = {**given, "trace": trace}
        try:
            return await self._inner.handle_async_request(request)
        except _STALE as exc:
            if "connection.connect_tcp.started" in seen:
                raise  # a new connection: the engine is failing, not its keep-alive timer
            url = request.url
            logger.info("engine %s://%s:%s: a kept-alive connection was closed as %s %s was "
                        "sent on it (%s); sending it again", url.scheme, url.host, url.port,
                        request.method, url.path, type(exc).__name__)
        # The failed connection left the pool; the resend takes another (or opens one).
        request.extensions = given
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def background_client(base_url: str, headers: Mapping[str, str], max_connections: int,
                      keepalive_s: float) -> httpx.AsyncClient:
    """One engine's background client: ``max_connections`` at most, idle ones dropped
    after ``keepalive_s``, a stale kept-alive connection's request sent again once. Each
    call sets its own timeout; the defaults bound connecting (5 s) and writing (30 s),
    not the wait for an answer."""
    limits = httpx.Limits(max_connections=max_connections,
                          max_keepalive_connections=max_connections,
                          keepalive_expiry=keepalive_s)
    return httpx.AsyncClient(
        base_url=base_url, headers=dict(headers),
        timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
        transport=ResendStale(httpx.AsyncHTTPTransport(limits=limits)))
