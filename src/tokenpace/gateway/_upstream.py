"""The hot-path client to the engines: completions, streamed and not.

aiohttp parses HTTP in C (its ``_http_parser`` extension) and hands the body over as bytes
as they arrive; httpx, which the gateway's background calls (health, gauges, ``/tokenize``,
``/v1/models``) still use, parses in pure Python and was the largest single cost per
request and per streamed chunk (docs/benchmarks.md). One session per engine, with that
engine's own headers (``headers``: e.g. the engine's ``Authorization``), and a pool as
large as the engine's ``max_inflight``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping

import aiohttp

logger = logging.getLogger("tokenpace.gateway")

UpstreamError = (aiohttp.ClientError, TimeoutError)
"""What a failed engine call raises (connect, send, read)."""


class Upstream:
    """One engine's completions endpoint."""

    def __init__(self, base_url: str, max_connections: int, keepalive_s: float,
                 headers: Mapping[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = dict(headers or {})
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        # created on first use, inside the running loop (aiohttp binds to it)
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=self._connector(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                headers=self._headers, auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    def _connector(self) -> aiohttp.TCPConnector:
        return aiohttp.TCPConnector(limit=self._max_connections,
                                    keepalive_timeout=self._keepalive_s)

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> aiohttp.ClientResponse:
        """Send a POST and return once the response head arrived (the body is the caller's
        to read, then ``release`` or ``close``). A failed *connect* (the request never left)
        is retried once on a fresh connection: the engine may just have closed an idle one,
        or restarted."""
        session = self._open()
        url = self.base_url + path
        try:
            return await session.post(url, data=body, headers=headers)
        except aiohttp.ClientConnectorError:
            logger.warning("engine %s: connect failed for %s; retrying once", self.base_url,
                           headers.get("x-request-id"))
            return await session.post(url, data=body, headers=headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The response body as the network delivers it (one item per read)."""
    async for data in resp.content.iter_any():
        yield data
