"""``GET /metrics`` and ``GET /health``: who may read them, and what a scrape costs.

The metrics page names tenants and applications, their usage and budgets; ``/health``'s
details name the engines' URLs and the state store's host. With ``metrics_api_keys`` set,
``/metrics`` needs one of them or an admin key as ``Authorization: Bearer``; without, it is
open (the start-up log says so). ``/health`` answers everyone with its status alone, and
the details only to a metrics or admin key.

The page is rendered at most once per ``metrics_cache`` and kept whole in memory until
the next one; scrapes meanwhile, and scrapes that arrive while it renders, get the same
page (``PageCache``). Cyclic garbage collection is paused only while the page renders
(``paused_gc``), never while a client reads it: a slow reader costs the page's memory,
nothing else. Cost: one render (O(active tenants' series), sliced on the event loop) per
interval whatever the number of scrapers; per scrape, the cached chunks written out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from ..admission import bearer_key
from ..config import GatewayConfig
from ..wire import error_response

logger = logging.getLogger("tokenpace.gateway")


class PageCache:
    """The last rendered page and its age; one render at a time, shared by its waiters."""

    def __init__(self, render: Callable[[], Awaitable[list[bytes]]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._render = render
        self._clock = clock
        self._page: list[bytes] | None = None
        self._at = 0.0
        self._rendering: asyncio.Future[list[bytes]] | None = None
        self.renders = 0  # pages rendered so far

    async def page(self, max_age_s: float) -> list[bytes]:
        """A page rendered at most ``max_age_s`` ago (0: the one rendering now, else a new
        one). A caller that goes away does not stop a render others wait for."""
        if self._page is not None and self._clock() - self._at < max_age_s:
            return self._page
        if self._rendering is None:
            self._rendering = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._rendering)

    async def _run(self) -> list[bytes]:
        try:
            page = await self._render()
            self.renders += 1
            self._page, self._at = page, self._clock()
            return page
        finally:
            self._rendering = None


async def stream(page: list[bytes]) -> AsyncIterator[bytes]:
    """The cached chunks as they are (no copy, no collection paused)."""
    for chunk in page:
        yield chunk


def metrics_refusal(config: GatewayConfig, request: Request) -> Response | None:
    """401 or 403 when ``/metrics`` needs a key and the request has none of them."""
    if not config.metrics_key_hashes:
        return None
    key = bearer_key(request.headers.get("authorization"))
    if key and config.is_metrics_key(key):
        return None
    return error_response(401 if not key else 403, "a metrics API key (metrics_api_keys) or "
                          "an admin API key is required", code="invalid_api_key",
                          headers={"www-authenticate": "Bearer"})


def shows_details(config: GatewayConfig, request: Request) -> bool:
    """Whether ``/health`` may show its details: a metrics or admin key."""
    key = bearer_key(request.headers.get("authorization"))
    return bool(key) and config.is_metrics_key(key)  # type: ignore[arg-type]


def warn_if_open(config: GatewayConfig) -> None:
    """The start-up line that says ``/metrics`` is open to anyone who reaches the port."""
    if not config.metrics_key_hashes:
        logger.warning("metrics_api_keys is not set: /metrics is open to anyone who reaches "
                       "this port (it names tenants, their usage and budgets); set it and "
                       "give Prometheus the key (docs/gateway/metrics.md, 'Metrics, health and logs')")
