"""The hot-path client to the engine: a connect that fails is retried once."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.gateway._engine import EngineServer
from tokenpace.gateway._upstream import Upstream


class FirstConnectFails(aiohttp.TCPConnector):
    """A real connector whose first connection attempt is refused."""

    attempts = 0

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        FirstConnectFails.attempts += 1
        if FirstConnectFails.attempts == 1:
            raise aiohttp.ClientConnectorError(req.connection_key, ConnectionRefusedError(111, "refused"))
        return await super().connect(req, traces, timeout)


class Flaky(Upstream):
    def _connector(self) -> aiohttp.TCPConnector:
        return FirstConnectFails()


def test_a_failed_connect_is_retried_once_and_succeeds() -> None:
    engine = EngineServer().start()
    try:
        async def main() -> tuple[int, bytes]:
            upstream = Flaky(engine.url, 8, 2.0)
            try:
                resp = await upstream.post("/v1/completions",
                                           b'{"model": "fake", "prompt": "hi", "max_tokens": 2}',
                                           {"content-type": "application/json", "x-request-id": "r1"})
                body = await resp.read()
                resp.release()
                return resp.status, body
            finally:
                await upstream.close()
        status, body = asyncio.run(main())
        assert status == 200 and b'"completion_tokens":2' in body.replace(b" ", b"")
        assert FirstConnectFails.attempts == 2
        assert len(engine.engine.requests) == 1  # sent once: the failed attempt never left
    finally:
        engine.stop()
