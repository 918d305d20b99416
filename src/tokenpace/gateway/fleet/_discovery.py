"""Engines found by DNS: a configured url whose host names a set of engines.

A Kubernetes headless Service (or a StatefulSet's service, or any DNS name with several A
/ AAAA records) resolves to one address per ready engine. With ``engines[].discovery:
dns`` each address is an engine with that entry's settings, called as
``http://<address>:<port>``, and the name is resolved again every
``discovery_interval``: scaling a model's engines needs no configuration edit.

A failed resolution (a DNS outage, a timeout, or a name with no address while every pod
restarts) keeps the addresses of the last good one: those engines that are really gone
refuse connections and passive health takes them out, while an outage of the resolver
alone does not empty the pool. Only a successful answer removes an address.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from ..config import EngineConfig

logger = logging.getLogger("tokenpace.gateway")

RESOLVE_TIMEOUT_S = 5.0

Resolve = Callable[[str, int], Awaitable[list[str]]]
"""``resolve(host, port)``: the addresses ``host`` names; raises ``OSError`` (or
``TimeoutError``) when it cannot tell."""


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (A and AAAA records), by the system resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def engine_at(template: EngineConfig, address: str) -> EngineConfig:
    """The engine at ``address`` found under ``template``'s url: its settings, its own url."""
    parts = urlsplit(template.url)
    host = f"[{address}]" if ":" in address else address
    return dataclasses.replace(template, url=f"http://{host}:{parts.port or 80}",
                               discovery=None, discovered_from=template.url)


class Discovery:
    """Expands a configuration's engine list: DNS-named entries become their addresses.

    ``resolve`` is injected so the expansion can be tested without a DNS server.
    """

    def __init__(self, resolve: Resolve = resolve_addresses,
                 timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
        self._resolve = resolve
        self._timeout_s = timeout_s
        self._known: dict[str, tuple[str, ...]] = {}  # entry url -> its last good addresses
        self._failing: set[str] = set()  # entries whose last resolution failed (logged once)

    async def engines(self, configs: Iterable[EngineConfig]) -> list[EngineConfig]:
        """The engines of ``configs``, DNS-named entries resolved now (all at once)."""
        configs = list(configs)
        named = [c for c in configs if c.discovery == "dns"]
        await asyncio.gather(*(self._addresses(c) for c in named))
        names = {c.url for c in named}
        for url in list(self._known):  # entries a reload removed
            if url not in names:
                del self._known[url]
        return self.known(configs)

    def known(self, configs: Iterable[EngineConfig]) -> list[EngineConfig]:
        """The engines of ``configs`` with each DNS-named entry as its last resolved
        addresses (none before its first resolution), in configuration order; an address
        listed twice is one engine (the first entry's)."""
        out: dict[str, EngineConfig] = {}
        for config in configs:
            if config.discovery != "dns":
                out.setdefault(config.url, config)
                continue
            for address in self._known.get(config.url, ()):
                engine = engine_at(config, address)
                out.setdefault(engine.url, engine)
        return list(out.values())

    async def _addresses(self, config: EngineConfig) -> tuple[str, ...]:
        parts = urlsplit(config.url)
        host = parts.hostname or ""
        try:
            async with asyncio.timeout(self._timeout_s):
                found = tuple(sorted(set(await self._resolve(host, parts.port or 80))))
            if not found:
                raise OSError("no address")
        except (OSError, TimeoutError) as exc:
            kept = self._known.get(config.url, ())
            if config.url not in self._failing:
                self._failing.add(config.url)
                logger.warning("engines: cannot resolve %s (%s); keeping its %d engine(s) "
                               "from the last answer", host, exc or type(exc).__name__,
                               len(kept))
            return kept
        self._failing.discard(config.url)
        before = self._known.get(config.url)
        if before != found:
            logger.info("engines: %s resolves to %s", host, ", ".join(found))
        self._known[config.url] = found
        return found
