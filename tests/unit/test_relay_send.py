"""The relay's upstream send: a connect that fails is retried once on a fresh connection."""

from __future__ import annotations

import asyncio

import httpx

from tests.gateway._engine import EngineServer
from tokenpace.gateway._proxy import _send


class FirstConnectFails(httpx.AsyncHTTPTransport):
    """A real transport whose first connection attempt fails as a refused connect would."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        if self.attempts == 1:
            raise httpx.ConnectError("connection refused", request=request)
        return await super().handle_async_request(request)


def test_a_failed_connect_is_retried_once_and_succeeds() -> None:
    engine = EngineServer().start()
    try:
        async def main() -> tuple[int, int]:
            transport = FirstConnectFails()
            async with httpx.AsyncClient(base_url=engine.url, transport=transport) as client:
                request = client.build_request("POST", "/v1/completions",
                                               json={"model": "fake", "prompt": "hi", "max_tokens": 2})
                resp = await _send(client, request)
                return resp.status_code, transport.attempts
        assert asyncio.run(main()) == (200, 2)
        assert len(engine.engine.requests) == 1  # sent once: the failed attempt never left
    finally:
        engine.stop()
