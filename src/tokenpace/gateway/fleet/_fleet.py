"""The engines the gateway dispatches to, and each one's standing: membership (who is in
the fleet, which pools each serves), health, drain, shutdown, load.

Every change is applied on the event loop, between two requests' steps, and told to the
dispatcher through ``Dispatch`` (a ``typing.Protocol``: the fleet does not import
``dispatch``), which re-ranks its engines and dispatches what the change lets through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from ..config import EngineConfig, GatewayConfig
from ._slots import EngineSlots

EJECT_LAST_AFTER = 2
"""Refused connections in a row that take the last engine up of a pool out of dispatch (any
other engine goes out on the first)."""


class Dispatch(Protocol):
    """What the fleet asks of the dispatcher when an engine's membership or standing
    changes (``dispatch.Dispatcher`` is one). Each call is O(pools of the engine) or, for
    ``pump(None)``, O(pools), plus what dispatching the waiters costs."""

    def join(self, engine: EngineSlots, models: Iterable[str]) -> None:
        """Add ``engine`` to the pool of each of ``models`` (a pool is made for a new
        model name), on both sides: ``pool.engines`` and ``engine.pools``."""

    def rerank(self) -> None:
        """Membership or standing changed: engine orders cached per tenant are stale."""

    def pump(self, engine: EngineSlots | None) -> None:
        """Dispatch what waits in ``engine``'s pools (None: in every pool) while engines
        have room."""

    def forget(self, engine: EngineSlots) -> None:
        """``engine`` left the fleet: drop what the dispatcher keeps about it."""


class Fleet:
    """The engine list and every engine's standing, for one dispatcher.

    ``engines`` is replaced as a whole by ``set_engines`` (readers may hold the old list).
    Setting a standing an engine already has changes nothing; a change costs a few stores
    and a ``Dispatch`` call.
    """

    def __init__(self, config: GatewayConfig, clock: Callable[[], float],
                 dispatch: Dispatch) -> None:
        self._clock = clock
        self._dispatch = dispatch
        # The engines named by address; those found by DNS (``engines[].discovery``) join
        # through ``set_engines``, as do engines a reload adds.
        self.engines = [EngineSlots(e) for e in config.engines if e.discovery is None]
        self._departed: dict[str, EngineSlots] = {}  # removed with requests in flight

    def publish(self) -> None:
        """Set every engine's gauges (start-up)."""
        for engine in self.engines:
            engine.publish()

    def configure(self, config: GatewayConfig) -> None:
        """Drain or undrain each engine as its (re)loaded configuration says (``drain``);
        ``set_engines`` changes the engine list."""
        for engine in self.engines:
            self.set_draining(engine, engine.config.drain)

    # -- membership --------------------------------------------------------------------

    def set_engines(self, configs: Iterable[EngineConfig]) -> tuple[list[EngineSlots],
                                                                   list[EngineSlots]]:
        """Make the engines those of ``configs`` (a reload, or DNS discovery finding
        addresses come and go); returns (added, removed).

        An added engine joins its pools at once when its models are configured (else once
        they are learned: ``unlearned``). A removed engine leaves its pools: nothing new is
        dispatched to it, its requests in flight finish and release their slots as usual;
        the caller closes its connections once they are done. A kept engine takes its new
        settings (its learned capacity and gauges stay). Tenants pinned by rendezvous
        hashing move only where their first engine came or went (about 1/N of them).
        Cost: O(engines + pools), on configuration changes only.
        """
        wanted = {c.url: c for c in configs}
        current = {e.url: e for e in self.engines}
        removed = [e for url, e in current.items() if url not in wanted]
        for engine in removed:
            for pool in engine.pools:
                pool.engines.remove(engine)
            engine.pools = []
            self._dispatch.forget(engine)
            engine.unpublish()
        # Engines that left with requests in flight: one that comes back before they end
        # is the same object again, so its slots count them.
        departed = {url: e for url, e in self._departed.items() if e.inflight > 0}
        departed.update((e.url, e) for e in removed)
        added: list[EngineSlots] = []
        engines: list[EngineSlots] = []
        for url, cfg in wanted.items():
            engine = current.get(url)
            if engine is None:
                engine = departed.pop(url, None) or EngineSlots(cfg)
                engine.config = cfg
                if cfg.models is not None:
                    engine.models = frozenset(cfg.models)
                added.append(engine)
                if engine.models is not None:
                    self._dispatch.join(engine, engine.models)
                engine.publish()
            else:
                engine.config = cfg
                if cfg.models is not None:
                    self.set_models(engine, frozenset(cfg.models))
            engines.append(engine)
        self.engines = engines
        self._departed = departed
        self._dispatch.rerank()
        self._dispatch.pump(None)
        return added, removed

    def set_models(self, engine: EngineSlots, models: frozenset[str]) -> bool:
        """The model names ``engine`` serves, as learned from it; True when they changed.

        Requests already waiting for a pool it leaves stay queued for the pool's other
        engines (or time out); a pool it joins can dispatch to it at once.
        """
        if engine.models == models:
            return False
        for pool in list(engine.pools):
            if pool.model not in models:
                pool.engines.remove(engine)
                engine.pools.remove(pool)
        self._dispatch.join(engine, models - {pool.model for pool in engine.pools})
        engine.models = models
        self._dispatch.rerank()
        self._dispatch.pump(engine)
        return True

    def unlearned(self) -> list[EngineSlots]:
        """Engines whose model names are not known yet (they have not answered /v1/models)."""
        return [engine for engine in self.engines if engine.models is None]

    # -- standing ----------------------------------------------------------------------

    def set_health(self, engine: EngineSlots, healthy: bool) -> None:
        if healthy == engine.healthy:
            return
        engine.healthy = healthy
        self._dispatch.rerank()
        engine.down_since = None if healthy else self._clock()
        engine.up_gauge.set(int(healthy))
        engine.forget_load()
        if not healthy and engine.stopping_since is not None:  # it is gone: no longer stopping
            engine.stopping_since = None
            engine.draining_gauge.set(int(engine.draining))
        if healthy:
            engine.connect_failures = 0
            engine.held.set()  # read its gauges now, not at the next interval
            self._dispatch.pump(engine)

    def set_draining(self, engine: EngineSlots, draining: bool) -> None:
        """Drain ``engine`` (no new dispatches; what runs there finishes) or undrain it."""
        if draining == engine.draining:
            return
        engine.draining = draining
        engine.draining_gauge.set(int(engine.drained))
        self._dispatch.rerank()
        self._dispatch.pump(engine)  # its waiters may go elsewhere now, or to it again

    def set_stopping(self, engine: EngineSlots) -> bool:
        """``engine`` said it is shutting down (vLLM draining on SIGTERM): no new dispatches,
        its requests in flight finish, as for a drain; not counted as a failure. It stays so
        while its ``/health`` answers (a draining vLLM answers it), and ends when the engine
        goes down (``set_health``), to come back as any restarted engine. True when it was
        not shutting down before."""
        if engine.stopping_since is not None:
            return False
        engine.stopping_since = self._clock()
        engine.draining_gauge.set(1)
        self._dispatch.rerank()
        self._dispatch.pump(engine)
        return True

    def connect_failed(self, engine: EngineSlots) -> bool:
        """A request's connection to ``engine`` was refused (nothing was sent): take the
        engine out of dispatch at once, for every request, until a health probe answers
        (passive health). True when it is out now.

        A network blip must not empty a pool: the last engine up in one of its pools
        stays in after one refusal and goes out after ``EJECT_LAST_AFTER`` in a row (its
        request is sent to it once more meanwhile); a request that reaches it resets the
        count (``EngineSlots.connect_ok``). Cost: a counter, and a pool scan on a failure
        only.
        """
        engine.connect_failures += 1
        engine.refused_counter.inc()
        if not engine.healthy:
            return True
        if engine.connect_failures < EJECT_LAST_AFTER and self._last_up(engine):
            return False
        self.set_health(engine, False)
        return True

    @staticmethod
    def _last_up(engine: EngineSlots) -> bool:
        """Whether ``engine`` is the only engine up in one of its pools."""
        return any(all(e is engine or not e.accepts for e in pool.engines)
                   for pool in engine.pools)

    def set_load(self, engine: EngineSlots, waiting: float | None, kv_usage: float | None,
                 running: float | None = None) -> None:
        """Saturation gauges read from the engine's /metrics (None: not reported)."""
        engine.record_reading(running, waiting, kv_usage)
        self._dispatch.pump(engine)
