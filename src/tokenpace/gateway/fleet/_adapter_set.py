"""The LoRA adapters one engine holds, as this replica knows them (``_adapters`` places
requests by them and loads adapters)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Literal, NamedTuple

AdapterState = Literal["busy", "idle", "gone"]
"""What a replica says of an adapter on an engine: ``busy`` (it has requests in flight
for it there), ``idle`` (it used it there, none in flight now) or ``gone`` (it unloaded
it there, or the engine answered that it does not hold it)."""


class AdapterNote(NamedTuple):
    """One replica's latest word on one adapter of one engine, at ``at`` (this replica's
    clock: ``AdapterSet``'s)."""

    state: AdapterState
    at: float


class AdapterSet:
    """The adapters one engine holds as this replica knows them: when each was last used
    (by any replica), this replica's requests in flight on each, the loads under way, and
    what other replicas say (``shared``).

    Cost per adapter request: a dict lookup, an ordered-dict move and two dict stores at
    dispatch, a dict update at release. Memory: one entry per adapter held (at most
    ``max_adapters``, plus those another replica or the engine's own flags loaded), and
    one note per adapter this replica used or unloaded here since the last ``changes``.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.held: OrderedDict[str, None] = OrderedDict()
        self.inflight: dict[str, int] = {}
        self.loading: dict[str, asyncio.Task[None]] = {}
        self.reported_max: int | None = None  # vLLM's ``max_lora`` from its /metrics
        # Loaded and unloaded here since the last listing: a listing fetched before the
        # call ended may not show it yet (``listed`` trusts this replica's call once).
        self.loaded_since: set[str] = set()
        self.unloaded_since: set[str] = set()
        self.used_at: dict[str, float] = {}
        """When a request for each adapter was last given a slot here, by any replica as
        far as this one knows (``shared``): the least recently used idle one is the
        victim of a load."""
        self.busy_elsewhere: set[str] = set()
        """Adapters another replica has requests in flight for here (``shared``): never
        unloaded by this one (an unload would make vLLM refuse those not sent yet)."""
        self._gone_at: dict[str, float] = {}  # this replica unloaded (or lost) it at
        self._listed_at = -math.inf
        self._changes: dict[str, AdapterNote] = {}  # this replica's news, for the others

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
        now = self._clock()
        self.used_at[name] = now
        self._changes[name] = AdapterNote("busy", now)

    def done(self, name: str) -> None:
        """That request gave its slot back."""
        left = self.inflight.get(name, 0) - 1
        if left > 0:
            self.inflight[name] = left
        else:
            self.inflight.pop(name, None)
            self._changes[name] = AdapterNote("idle", self._clock())

    def listed(self, names: Iterable[str]) -> None:
        """The adapters the engine's ``/v1/models`` lists now: new ones are held (as least
        recently used), ones it no longer lists are not (another replica unloaded them, or
        the engine restarted), except those this replica is loading. What this replica
        loaded or unloaded since the last listing stands over this one."""
        names = set(names)
        kept, gone = self.loaded_since, self.unloaded_since
        self.loaded_since, self.unloaded_since = set(), set()
        self._listed_at = self._clock()
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
        now = self._clock()
        self.used_at[name] = now
        self._gone_at.pop(name, None)
        if name not in self._changes:
            self._changes[name] = AdapterNote("idle", now)

    def unloaded(self, name: str) -> None:
        """This replica unloads ``name`` here."""
        self.held.pop(name, None)
        self.unloaded_since.add(name)
        self.loaded_since.discard(name)
        self._lost(name)

    def missing(self, name: str) -> None:
        """The engine answered that it does not hold ``name`` (another replica unloaded
        it, or the engine restarted): loaded again before the next request goes."""
        self.held.pop(name, None)
        self._lost(name)

    def _lost(self, name: str) -> None:
        now = self._clock()
        self._gone_at[name] = now
        self._changes[name] = AdapterNote("gone", now)

    def victim(self, keep: str) -> str | None:
        """The adapter to unload for another: the least recently used one without requests
        in flight here (of this replica: granted, being sent, or running; of another, as
        far as ``shared`` says), never ``keep`` or one loading; None: every one is busy.
        O(adapters held)."""
        best: str | None = None
        best_at = math.inf
        for name in self.held:
            if name == keep or name in self.loading or self.inflight.get(name) \
                    or name in self.busy_elsewhere:
                continue
            at = self.used_at.get(name, -math.inf)
            if at < best_at:
                best, best_at = name, at
        return best

    # -- several replicas ------------------------------------------------------------

    def changes(self) -> dict[str, AdapterNote]:
        """What this replica did here since the last call, for the others: each adapter
        it used, ended its requests of or unloaded, its latest state; with each adapter
        it still has requests in flight for, ``busy`` now (a heartbeat: a replica that
        stops sending them is not busy any more)."""
        out, self._changes = self._changes, {}
        if self.inflight:
            now = self._clock()
            for name in self.inflight:
                out[name] = AdapterNote("busy", now)
        return out

    def shared(self, notes: Iterable[tuple[str, AdapterNote]], now: float,
               busy_s: float) -> None:
        """Adopt what the other replicas said about this engine: ``notes`` are
        ``(adapter, note)`` pairs, their times on this replica's clock. An adapter one of
        them used after this replica last heard otherwise (its own unload, the engine's
        listing) is held; one it unloaded after anybody's last use and the last listing is
        not (unless it is being loaded); one with a ``busy`` note younger than ``busy_s`` is busy elsewhere.
        O(notes)."""
        latest: dict[str, AdapterNote] = {}
        busy: set[str] = set()
        for name, note in notes:
            last = latest.get(name)
            if last is None or note.at > last.at:
                latest[name] = note
            if note.state == "busy" and note.at >= now - busy_s:
                busy.add(name)
        self.busy_elsewhere = busy
        for name, note in latest.items():
            if note.state == "gone":
                if note.at > self.used_at.get(name, -math.inf) and note.at > self._listed_at \
                        and name in self.held and name not in self.loading:
                    del self.held[name]
                continue
            if note.at > self.used_at.get(name, -math.inf):
                self.used_at[name] = note.at
            if name not in self.held and note.at > self._listed_at \
                    and note.at > self._gone_at.get(name, -math.inf):
                self.held[name] = None

