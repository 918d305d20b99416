"""The admin API's tenants and keys on this replica: loaded at start-up from the ledger's
database, kept current by polling its change counter, merged with the file's tenants.

Every ``POLL_INTERVAL_S`` one single-row read (``RegistryStore.version``, in a worker
thread); only when it moved, the rows stamped since (``changes``). A change of keys costs
O(keys changed) on the event loop; a change of tenants rebuilds the served configuration
(``ApiTenants.merged``, O(tenants), in a worker thread) and swaps it in as a reload does,
under the reload lock (``Tenants.plan`` / ``commit``; the dispatcher's queues learn the
new lanes and weights; engines are not touched). A replica applies a change within one
poll interval plus the read: the admin route that made it applies it before answering.

``last_used_at``: ``KeyTable`` notes each use in memory; every ``TOUCH_INTERVAL_S`` the
uses are written in one transaction (a SIGKILL loses at most that interval's; a database
that does not answer loses them, never a request). The database down: the replica keeps
serving what it last applied, and polls again; the admin routes answer 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ..config import GatewayConfig
from ..registry import ApiTenants, Changes, KeyTable, RegistryStore

logger = logging.getLogger("tokenpace.gateway")

POLL_INTERVAL_S = 0.25
TOUCH_INTERVAL_S = 5.0
SWEEP_INTERVAL_S = 60.0
"""How often keys that stopped working (expiry, a grace's end) leave the table (O(keys));
until then their end time refuses them."""
PROBLEM_LOG_INTERVAL_S = 60.0

Commit = Callable[[], Awaitable[None]]


class Registry:
    """This replica's view of the admin store. ``file_config``: the configuration file's
    (a reload replaces it); ``commit()`` (the gateway's) merges and swaps in the served
    configuration after the API tenants changed."""

    def __init__(self, url: str, file_config: GatewayConfig) -> None:
        self.url = url
        self.file_config = file_config
        self.store: RegistryStore | None = None
        self.tenants = ApiTenants()
        self.keys = KeyTable()
        self.version = 0
        self.problems: list[str] = []
        self._polling = asyncio.Lock()
        self._commit: Commit | None = None
        self._logged_at = -PROBLEM_LOG_INTERVAL_S
        self._error_at = -PROBLEM_LOG_INTERVAL_S

    def load(self) -> GatewayConfig:
        """At start-up, blocking: open the store and read every live tenant and key; the
        served configuration. A database that does not answer leaves the file's alone
        (logged); ``run`` keeps trying."""
        try:
            self.store = RegistryStore(self.url)
            changes = self.store.changes(0, live_at=time.time())
        except Exception as exc:  # the store's errors, and LedgerError
            logger.error("admin store unavailable at start-up, serving the file's tenants "
                         "until it answers: %s", exc)
            if self.store is not None:
                self.store.close()
                self.store = None
            return self.file_config
        now = time.time()
        for tenant in changes.tenants:
            self.tenants.apply(tenant)
        for key in changes.keys:
            self.keys.apply(key, now)
        self.version = changes.version
        config, served = self.merged(self.file_config, reload=True)
        self.keys.tenants = served
        return config

    def start(self, commit: Commit) -> None:
        self._commit = commit

    def merged(self, file_config: GatewayConfig, reload: bool = False,
               ) -> tuple[GatewayConfig, frozenset[str]]:
        """The configuration to serve with ``file_config`` and the API tenants, and the
        ids of the API tenants it serves (blocking, O(tenants)); what is left out logged
        (at once on a reload)."""
        config, served, problems = self.tenants.merged(file_config)
        self._log(problems, force=reload)
        self.problems = problems
        return config, served

    async def run(self) -> None:
        """Poll, write the keys' uses, sweep: until cancelled."""
        touched = swept = time.monotonic()
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            try:
                await self.poll()
                now = time.monotonic()
                if now - touched >= TOUCH_INTERVAL_S:
                    touched = now
                    await self.flush_uses()
                if now - swept >= SWEEP_INTERVAL_S:
                    swept = now
                    self.keys.sweep(time.time())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if time.monotonic() - self._error_at >= PROBLEM_LOG_INTERVAL_S:
                    self._error_at = time.monotonic()
                    logger.error("admin store: %s", exc)

    async def flush_uses(self) -> None:
        used = self.keys.take_used()
        if used and self.store is not None:
            await asyncio.to_thread(self.store.touch, used)

    async def poll(self) -> None:
        """Apply what changed since the last poll (one read when nothing did)."""
        async with self._polling:
            if self.store is None:
                self.store = await asyncio.to_thread(RegistryStore, self.url)
            store = self.store
            if await asyncio.to_thread(store.version) == self.version:
                return
            changes = await asyncio.to_thread(store.changes, self.version)
            await self._apply(changes)

    async def _apply(self, changes: Changes) -> None:
        tenants_changed = False
        for tenant in changes.tenants:
            tenants_changed |= self.tenants.apply(tenant)
        if tenants_changed and self._commit is not None:
            await self._commit()
        now = time.time()
        for key in changes.keys:
            self.keys.apply(key, now)
        self.version = max(self.version, changes.version)

    def _log(self, problems: list[str], force: bool = False) -> None:
        if not problems:
            return
        if force or time.monotonic() - self._logged_at >= PROBLEM_LOG_INTERVAL_S:
            self._logged_at = time.monotonic()
            for line in problems:
                logger.warning("%s", line)

    async def close(self) -> None:
        try:
            await self.flush_uses()
        except Exception as exc:
            logger.warning("admin store: the keys' last uses were not written: %s", exc)
        if self.store is not None:
            self.store.close()
            self.store = None
