"""A paced tenant's rate split when several gateway replicas serve it (``state`` in Redis).

Each replica sees only its own streams, so the split's book lives in the state store: per
tenant, every replica's stream count per engine, the share each engine paces the tenant
at, and the last version given out, changed by one replica at a time under a lock in the
store. A change is two store round trips around the control calls it makes:

1. ``split_read`` takes the tenant's lock (retried every ``LOCK_RETRY_S`` while another
   replica's change holds it, for at most ``LOCK_WAIT_S``; changes of one replica queue
   in process first) and reads the book;
2. the splitter adds or removes the stream, lowers and raises shares by control call;
3. ``split_write`` writes this replica's stream change, the shares and the version, and
   releases the lock.

Versions are per tenant and kept in the book, so replicas number one tenant's changes in
one sequence whatever their clocks say. A replica's counts hold while it marks itself
alive (every third of the state lease, and with every read and write); the counts of a
replica that stopped doing so for a lease time are ignored, then pruned, so a crashed
replica's streams stop lowering the others' shares. A lock whose holder crashed expires
after ``LOCK_MS``.

What the store cannot answer fails the change: a stream about to start gets 503
``state_unavailable`` (it is not sent: its share could not be counted); a stream's end
that cannot be written is kept and written with the replica's next change of that tenant
(until then its count lowers the others' shares: the tenant gets less, never more).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ..state import StateStore, StateUnavailable
from ._rate_split import Split, SplitBook

logger = logging.getLogger("tokenpace.gateway")

LOCK_MS = 12_000  # longer than a change takes: two control calls of at most 5 s each
LOCK_WAIT_S = 5.0
LOCK_RETRY_S = 0.005


class SplitBusy(StateUnavailable):
    """Another replica held the tenant's split for longer than ``LOCK_WAIT_S``."""


class SharedSplitBook(SplitBook):
    """The splits of every tenant, kept in a shared ``store`` for all replicas."""

    def __init__(self, store: StateStore, replica: str | None = None) -> None:
        self._store = store
        self.replica = replica or f"{os.getpid()}-{os.urandom(4).hex()}"
        # Stream changes a write could not deliver, per tenant: sent with the next one.
        self._unwritten: dict[str, dict[str, int]] = {}
        self._local: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._task: asyncio.Task[None] | None = None

    @asynccontextmanager
    async def hold(self, tenant_id: str) -> AsyncIterator[Split]:
        # This replica's changes of the tenant queue in process first: one of them at a
        # time polls the store's lock, not each (cost: a lock per tenant changing here).
        entry = self._local.setdefault(tenant_id, (asyncio.Lock(), [0]))
        entry[1][0] += 1
        try:
            async with entry[0]:
                async with self._hold_shared(tenant_id) as split_:
                    yield split_
        finally:
            entry[1][0] -= 1
            if entry[1][0] == 0 and self._local.get(tenant_id) is entry:
                del self._local[tenant_id]

    @asynccontextmanager
    async def _hold_shared(self, tenant_id: str) -> AsyncIterator[Split]:
        token = os.urandom(8).hex()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LOCK_WAIT_S
        while (fields := await self._store.split_read(tenant_id, self.replica, token,
                                                      LOCK_MS)) is None:
            if loop.time() > deadline:
                raise SplitBusy(f"tenant {tenant_id!r}'s rate split stayed locked")
            await asyncio.sleep(LOCK_RETRY_S)
        split_ = _parse(fields, self._unwritten.get(tenant_id, {}))
        try:
            yield split_
        finally:
            added = dict(self._unwritten.pop(tenant_id, {}))
            for url, n in split_.added.items():
                added[url] = added.get(url, 0) + n
            body = json.dumps({"d": {u: n for u, n in added.items() if n},
                               "a": {u: repr(r) for u, r in split_.applied.items()},
                               "v": str(split_.version)})
            try:
                await self._store.split_write(tenant_id, self.replica, token, body)
            except StateUnavailable:
                self._unwritten[tenant_id] = added
                raise

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self._store.split_renew_s)
            try:
                await self._store.split_alive(self.replica)
            except StateUnavailable:
                pass  # the store logs it; the next read or write marks us again

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


def _parse(fields: dict[str, str], unwritten: dict[str, int]) -> Split:
    """The book's fields as a ``Split``: streams summed over live replicas (with this
    replica's unwritten changes), shares, version."""
    streams: dict[str, int] = {}
    applied: dict[str, float] = {}
    for name, value in fields.items():
        kind, _, rest = name.partition("|")
        if kind == "n":
            url = rest.partition("|")[2]
            streams[url] = streams.get(url, 0) + int(value)
        elif kind == "a":
            applied[rest] = float(value)
    for url, n in unwritten.items():
        streams[url] = streams.get(url, 0) + n
    streams = {u: n for u, n in streams.items() if n > 0}
    return Split(streams, {u: r for u, r in applied.items() if u in streams},
                 int(fields.get("v", "0")))
