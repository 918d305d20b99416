"""The LoRA adapters one engine holds, as this replica knows them (``_adapters`` places
requests by them and loads adapters)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable


class AdapterSet:
    """The adapters one engine holds as this replica knows them: least recently used first,
    with this replica's requests in flight on each and the loads under way.

    Cost per adapter request: a dict lookup and an ordered-dict move at dispatch, a dict
    update at release. Memory: one entry per adapter held (at most ``max_adapters``, plus
    those another replica or the engine's own flags loaded).
    """

    def __init__(self) -> None:
        self.held: OrderedDict[str, None] = OrderedDict()
        self.inflight: dict[str, int] = {}
        self.loading: dict[str, asyncio.Task[None]] = {}
        self.reported_max: int | None = None  # vLLM's ``max_lora`` from its /metrics
        # Loaded and unloaded here since the last listing: a listing fetched before the
        # call ended may not show it yet (``listed`` trusts this replica's call once).
        self.loaded_since: set[str] = set()
        self.unloaded_since: set[str] = set()

    def __contains__(self, name: str) -> bool:
        """Held, or being loaded (a request placed now finds it there)."""
        return name in self.held or name in self.loading

    def __len__(self) -> int:
        """The places taken: held or being loaded."""
        return len(self.held) + sum(1 for name in self.loading if name not in self.held)

    def used(self, name: str) -> None:
        """A request for ``name`` was given a slot here."""
        if name in self.held:
            self.held.move_to_end(name)
        self.inflight[name] = self.inflight.get(name, 0) + 1

    def done(self, name: str) -> None:
        """That request gave its slot back."""
        left = self.inflight.get(name, 0) - 1
        if left > 0:
            self.inflight[name] = left
        else:
            self.inflight.pop(name, None)

    def listed(self, names: Iterable[str]) -> None:
        """The adapters the engine's ``/v1/models`` lists now: new ones are held (as least
        recently used), ones it no longer lists are not (another replica unloaded them, or
        the engine restarted), except those this replica is loading. What this replica
        loaded or unloaded since the last listing stands over this one."""
        names = set(names)
        kept, gone = self.loaded_since, self.unloaded_since
        self.loaded_since, self.unloaded_since = set(), set()
        for name in list(self.held):
            if name not in names and name not in self.loading and name not in kept:
                del self.held[name]
        for name in names:
            if name not in self.held and name not in gone:
                self.held[name] = None
                self.held.move_to_end(name, last=False)

    def loaded(self, name: str) -> None:
        """This replica loaded ``name`` here: the most recently used."""
        self.held[name] = None
        self.held.move_to_end(name)
        self.loaded_since.add(name)
        self.unloaded_since.discard(name)

    def unloaded(self, name: str) -> None:
        """This replica unloads ``name`` here."""
        self.held.pop(name, None)
        self.unloaded_since.add(name)
        self.loaded_since.discard(name)

    def victim(self, keep: str) -> str | None:
        """The adapter to unload for another: the least recently used one without requests
        of this replica in flight here (granted, being sent, or running: an unload would
        make vLLM refuse one not sent yet), never ``keep`` or one loading; None: every
        one is busy."""
        for name in self.held:
            if name != keep and name not in self.loading and not self.inflight.get(name):
                return name
        return None
