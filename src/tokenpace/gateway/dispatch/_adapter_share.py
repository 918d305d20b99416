"""LoRA adapters' whereabouts, shared by the replicas of one state store.

Each replica learns what an engine holds from its ``/v1/models`` (every health check) and
from its own loads. With several replicas that is not enough: one may unload an adapter
that another has requests in flight for (vLLM then refuses those not sent yet), or load
an adapter elsewhere that another just loaded. So each replica also tells the others,
per engine and adapter, its latest word (``fleet.AdapterSet.changes``): ``busy`` (it
gave a request for it a slot there, and again every ``ADAPTER_SHARE_S`` while it has
requests in flight: a heartbeat), ``idle`` (its last one ended) or ``gone`` (it unloaded
it, or the engine answered that it does not hold it).

Every ``ADAPTER_SHARE_S`` a replica sends its words with the store's next flush (no round
trip of its own) and reads every adapter engine's words [1 round trip]
(``AdapterSet.shared``): an adapter another replica loaded or used is held here; one it
unloaded after anybody's last use is loaded again before this replica's next request
goes there; one with another replica's heartbeat younger than ``ADAPTER_BUSY_S`` is never
this replica's victim, so a replica that dies stops protecting its adapters within that
time. The least recently used adapter is the one least recently used by any replica.

What is left to chance, bounded: words younger than one interval plus a flush are not
seen yet, so two replicas may load one adapter on two engines (a hot adapter spreads
anyway), and an unload may race a request another replica just sent there: that request
gets vLLM's 404 and goes again with the adapter loaded first (``relay.not_taken``). A
store that does not answer leaves each replica with what it knows itself.

Cost: per interval, one note per adapter a replica used, ended or unloaded (or has
requests in flight for) on each engine, and one read of O(engines x adapters x
replicas) notes; nothing on a request's path. Store format: engine url -> field
``<adapter>|<replica>`` -> ``<state>:<unix ms>``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Collection, Mapping

from ..fleet import AdapterNote, EngineSlots
from ..state import StateStore, StateUnavailable

logger = logging.getLogger("tokenpace.gateway")

ADAPTER_SHARE_S = 0.25
"""How often a replica sends its adapter words and reads the others'."""
ADAPTER_BUSY_S = 4 * ADAPTER_SHARE_S
"""A replica's heartbeat for an adapter protects it from the others' unloads this long
(three missed heartbeats: a replica stopped, or its store calls fail)."""
_STATES = frozenset(("busy", "idle", "gone"))


class AdapterShare:
    """One replica's side of the adapter words (see the module)."""

    def __init__(self, store: StateStore, replica: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        """``clock``: the ``AdapterSet``s' clock; ``wall``: unix seconds, what the
        replicas' words carry."""
        self.store = store
        self.replica = replica or f"{os.getpid()}-{os.urandom(4).hex()}"
        self._clock = clock
        self._wall = wall
        self._task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()
        """Set once the first read was tried (answered or not)."""

    async def sync(self, engines: Collection[EngineSlots]) -> None:
        """Send this replica's words on ``engines`` and adopt the others'. Raises
        ``StateUnavailable`` when the store does not answer the read (the words wait in
        the store for its next flush)."""
        offset = self._wall() - self._clock()
        for engine in engines:
            for name, note in engine.adapters.changes().items():
                self.store.adapter_note(engine.url, f"{name}|{self.replica}",
                                        f"{note.state}:{round((note.at + offset) * 1000)}")
        view = await self.store.adapters_read([e.url for e in engines])
        now = self._clock()
        offset = self._wall() - now
        for engine in engines:
            fields = view.get(engine.url)
            if fields is not None:
                engine.adapters.shared(self.decode(fields, offset), now, ADAPTER_BUSY_S)

    def decode(self, fields: Mapping[str, str], offset: float) -> list[tuple[str, AdapterNote]]:
        """One engine's words, this replica's own left out, their times on the local
        clock (``local = unix - offset``); malformed ones skipped."""
        out: list[tuple[str, AdapterNote]] = []
        for field, value in fields.items():
            name, sep, who = field.rpartition("|")
            state, _, ms = value.partition(":")
            if not sep or who == self.replica or state not in _STATES:
                continue
            try:
                at = int(ms) / 1000.0 - offset
            except ValueError:
                continue
            out.append((name, AdapterNote(state, at)))  # type: ignore[arg-type]
        return out

    def start(self, engines: Callable[[], Collection[EngineSlots]]) -> None:
        """Sync every ``ADAPTER_SHARE_S`` from now on, over the engines ``engines()``
        returns then (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._keep(engines))

    async def _keep(self, engines: Callable[[], Collection[EngineSlots]]) -> None:
        while True:
            try:
                await self.sync(engines())
            except StateUnavailable:
                pass
            except Exception:  # keep sharing whatever one round did
                logger.exception("sharing the adapters' whereabouts failed")
            self.ready.set()
            await asyncio.sleep(ADAPTER_SHARE_S)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
