"""The gateway's connections to its engines, opened as engines join and closed as they
leave.

Two per engine: an ``Upstream`` for completions (the hot path) and an ``httpx`` client for
background calls (``/tokenize``, rate control). Both live in the dictionaries the runtime
shares, keyed by engine url, so a request finds its engine's by one lookup. An engine that
leaves (a reload dropped it, DNS no longer names it) keeps its connections until its
requests in flight are done: they finish as if nothing had changed.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from ..config import EngineConfig
from ..engines import Upstream, background_client, compile_router_headers
from ._slots import EngineSlots

logger = logging.getLogger("tokenpace.gateway")

ENGINE_KEEPALIVE_S = 4.0
"""Idle connections to an engine are dropped after this long, before vLLM's server closes
them (after 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE): bursts a few seconds apart reuse them
instead of opening one per request. Should an engine close one first (a shorter timeout,
a proxy in between) as a request is sent on it, the request goes again on a new one
(``Upstream``; the background calls' ``background_client`` alike)."""
RETIRE_POLL_S = 1.0


class Connections:
    """Every engine's connections, in the dictionaries the runtime reads."""

    def __init__(self) -> None:
        self.clients: dict[str, httpx.AsyncClient] = {}
        self.upstreams: dict[str, Upstream] = {}
        self._retiring: dict[str, asyncio.Task[None]] = {}  # url -> the wait to close them

    def open(self, engine: EngineConfig) -> None:
        """Connections for ``engine`` (none are made until the first call); an engine back
        before its connections were closed keeps them. An engine already open takes its
        (possibly reloaded) router ``headers``: requests sent from now on carry the new
        ones, those in flight sent theirs already."""
        retiring = self._retiring.pop(engine.url, None)
        if retiring is not None:
            retiring.cancel()
        upstream = self.upstreams.get(engine.url)
        if upstream is not None:
            current = upstream.router_headers
            if (current.templates if current is not None else ()) != engine.headers:
                upstream.router_headers = compile_router_headers(engine.headers)
            return
        self.clients[engine.url] = background_client(
            engine.url, engine.auth_headers(), engine.max_inflight + 8, ENGINE_KEEPALIVE_S)
        upstream = Upstream(engine.url, engine.max_inflight + 8, ENGINE_KEEPALIVE_S,
                            headers=engine.auth_headers())
        upstream.router_headers = compile_router_headers(engine.headers)
        self.upstreams[engine.url] = upstream

    def retire(self, engine: EngineSlots, grace_s: float) -> None:
        """Close ``engine``'s connections once its requests in flight are done (checked
        every second), or after ``grace_s`` (the request timeout) at the latest."""
        url = engine.url
        task = asyncio.create_task(self._retire(engine, grace_s))
        self._retiring[url] = task
        task.add_done_callback(lambda done: self._retiring.pop(url, None)
                               if self._retiring.get(url) is done else None)

    async def _retire(self, engine: EngineSlots, grace_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while engine.inflight > 0 and loop.time() < deadline:
            await asyncio.sleep(RETIRE_POLL_S)
        await self._close(engine.url)
        logger.info("engine %s: connections closed (it left the configuration)", engine.url)

    async def _close(self, url: str) -> None:
        client = self.clients.pop(url, None)
        upstream = self.upstreams.pop(url, None)
        if client is not None:
            await client.aclose()
        if upstream is not None:
            await upstream.close()

    async def close(self) -> None:
        """Close everything (shutdown)."""
        for task in list(self._retiring.values()):
            task.cancel()
        for url in list(self.upstreams):
            await self._close(url)
