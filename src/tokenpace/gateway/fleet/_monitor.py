"""The background work that keeps a fleet's view of its engines current: engines joining
and leaving (a reload, DNS discovery), their health, their load and their model names.

``Monitor`` runs on the event loop, from ``start`` until ``stop``: one health loop for all
engines, one load reader per engine (``read_load``), one DNS loop when some engine is
named by DNS, and a model-name lookup per engine that joins without configured
``models``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from ..config import EngineConfig, GatewayConfig
from ..engines import UpstreamError
from ._connections import Connections
from ._discovery import Discovery
from ._fields import learn_request_fields
from ._fleet import Fleet
from ._health import DOWN_AFTER_FAILURES, HEALTH_TIMEOUT_S, ProbeSchedule
from ._load import read_load
from ._policy import policy_problem, reported_capacity, reported_policy
from ._slots import EngineSlots

logger = logging.getLogger("tokenpace.gateway")

START_MODELS_TIMEOUT_S = 3.0


class Monitor:
    """Keeps ``fleet`` current by asking its engines, through ``connections``.

    ``config`` returns the configuration in force (read again at each use: a reload
    replaces it); ``engine_changed(url)`` is called when an engine comes back up or
    leaves, for what was learned about it elsewhere (prompt bounds); ``reloading`` is
    held by a reload between its plan and its commit, and a DNS round does not apply its
    answer meanwhile. ``discovery``: the DNS resolver of DNS-named engines (None: none
    yet; one is made when a reload names one).
    """

    def __init__(self, fleet: Fleet, connections: Connections, clock: Callable[[], float],
                 config: Callable[[], GatewayConfig], engine_changed: Callable[[str], None],
                 reloading: asyncio.Lock, discovery: Discovery | None = None) -> None:
        self._fleet = fleet
        self._connections = connections
        self._clock = clock  # the fleet's: an engine's down_since is on it
        self._config = config
        self._engine_changed = engine_changed
        self._reloading = reloading
        self.discovery = discovery
        self.policies: dict[str, str] = {}  # url -> policy its /health reports
        self._models_problem: dict[str, int] = {}  # engine -> status last warned about
        self._load_tasks: dict[str, asyncio.Task[None]] = {}  # engine url -> its reader
        self._tasks: set[asyncio.Task[None]] = set()
        self._watching = False  # engines' gauge readers started (start-up done)

    # -- start-up and shutdown ---------------------------------------------------------

    async def join_named(self) -> None:
        """Before any request: the engines DNS names join, then the model names of every
        engine without configured ``models`` are asked for (a request for a model is
        routed, or refused with 404, by them). At most ``START_MODELS_TIMEOUT_S`` per
        engine, all at once."""
        if self.discovery is not None:
            self.apply(await self.discovery.engines(self._config().engines))
        await asyncio.gather(*(self._learn_models(e, START_MODELS_TIMEOUT_S)
                               for e in self._fleet.unlearned()))

    def start(self) -> None:
        """Start the health loop, every engine's load reader and the DNS loop."""
        self._spawn(self._health_loop())
        for engine in self._fleet.engines:
            self._watch(engine)
        self._watching = True
        if self.discovery is not None:
            self._spawn(self._discovery_loop())

    def stop(self) -> None:
        """Cancel everything started here (the connections are the caller's to close)."""
        for task in [*self._tasks, *self._load_tasks.values()]:
            task.cancel()
        self._load_tasks.clear()
        self._watching = False

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background until it ends or ``stop``."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- membership --------------------------------------------------------------------

    def apply(self, engines: list[EngineConfig]) -> None:
        """Make ``engines`` the engine list (a reload, DNS discovery): an engine that joins
        gets connections and its gauge reader before the dispatcher may choose it, and its
        model names are learned at once when not configured; one that leaves gets no new
        request, and its connections close once its requests in flight are done."""
        for config in engines:
            self._connections.open(config)  # no-op for engines already known
        added, removed = self._fleet.set_engines(engines)
        for engine in removed:
            task = self._load_tasks.pop(engine.url, None)
            if task is not None:
                task.cancel()
            self._engine_changed(engine.url)
            self._connections.retire(engine, self._config().request_timeout_s)
            logger.warning("engine %s left the configuration (%d request(s) in flight finish "
                           "there)", engine.url, engine.inflight)
        for engine in added:
            if self._watching:  # before, start-up starts every engine's reader itself
                self._watch(engine)
            if engine.models is None and self._watching:  # start-up learns them all at once
                self._spawn(self._learn_models(engine, START_MODELS_TIMEOUT_S))
            logger.warning("engine %s joined%s", engine.url, f" (found under "
                           f"{engine.config.discovered_from})" if engine.config.discovered_from
                           else "")

    def known(self, configs: Iterable[EngineConfig]) -> list[EngineConfig]:
        """The engines of ``configs``, DNS-named entries as last resolved (no lookup)."""
        return self.discovery.known(configs) if self.discovery is not None else list(configs)

    async def resolve(self, configs: Iterable[EngineConfig]) -> list[EngineConfig]:
        """The engines of ``configs``, DNS-named entries resolved now; the first DNS-named
        entry starts the DNS loop."""
        engines = list(configs)
        if any(e.discovery for e in engines):
            if self.discovery is None:
                self.discovery = Discovery()
                self._spawn(self._discovery_loop())
            engines = await self.discovery.engines(engines)
        return engines

    async def _discovery_loop(self) -> None:
        """Resolve the DNS-named engines every ``discovery_interval`` and apply what
        changed (``Discovery``)."""
        assert self.discovery is not None
        while True:
            await asyncio.sleep(self._config().discovery_interval_s)
            config = self._config()
            engines = await self.discovery.engines(config.engines)
            async with self._reloading:  # not between a reload's plan and its commit
                if self._config() is config:
                    self.apply(engines)

    # -- health ------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        """Engine health every 2 s: down after two failed checks in a row, up after one good
        one. An engine that is down (by these checks, or taken out by a refused connection)
        is probed sooner: 0.25 s after it went, then doubling up to every 2 s
        (``ProbeSchedule``)."""
        fleet = self._fleet
        failures: dict[str, int] = {}
        schedule = ProbeSchedule()
        clock = self._clock
        while True:
            for engine in fleet.engines:
                # A shutting-down engine is probed as one that is down (soon, then less
                # often): its first failed probe is the end of its shutdown.
                stopping = engine.stopping_since is not None
                if not schedule.due(engine.url, engine.healthy and not stopping,
                                    engine.down_since or engine.stopping_since, clock()):
                    continue
                upstream = self._connections.upstreams.get(engine.url)
                if upstream is None:  # it left the configuration
                    continue
                try:
                    status, headers, _ = await upstream.fetch("GET", "/health", HEALTH_TIMEOUT_S)
                    ok = status == 200
                except (UpstreamError, TimeoutError):
                    ok = False
                if ok:
                    self._note_policy(engine.config, reported_policy(headers))
                    engine.reported_capacity = reported_capacity(headers)
                    if engine.config.models is None or self._config().adapters:
                        await self._learn_models(engine, HEALTH_TIMEOUT_S)
                    if engine.fields_wanted and not engine.fields_learned:
                        engine.fields_learned = True
                        self._spawn(self._learn_fields(engine))
                failures[engine.url] = 0 if ok else failures.get(engine.url, 0) + 1
                # One slow answer from a busy engine is not an outage.
                healthy = ok or (engine.healthy and not stopping
                                 and failures[engine.url] < DOWN_AFTER_FAILURES)
                if healthy != engine.healthy:
                    logger.warning("engine %s is %s", engine.url, "healthy" if healthy else "DOWN")
                    engine.fields_learned = healthy and engine.fields_learned
                    # Back up, it may serve another model or chat template: learn again.
                    self._engine_changed(engine.url)
                fleet.set_health(engine, healthy)
                schedule.checked(engine.url, engine.healthy and engine.stopping_since is None,
                                 clock())
            await asyncio.sleep(schedule.sleep_s(clock()))

    def _note_policy(self, engine: EngineConfig, reported: str) -> None:
        """Remember the engine's scheduling policy; log a mismatch when it first shows."""
        if self.policies.get(engine.url) == reported:
            return
        self.policies[engine.url] = reported
        problem = policy_problem(engine.url, engine.scheduling_policy, reported)
        if problem:
            logger.warning("%s", problem)

    # -- load and model names ----------------------------------------------------------

    def _watch(self, engine: EngineSlots) -> None:
        """Start reading ``engine``'s saturation gauges (``read_load``)."""
        self._load_tasks[engine.url] = asyncio.create_task(self._read_load(engine))

    async def _read_load(self, engine: EngineSlots) -> None:
        await read_load(self._fleet, engine, self._connections.upstreams[engine.url])

    async def _learn_fields(self, engine: EngineSlots) -> None:
        """The request fields the engine reads (``_fields``), off the health loop."""
        upstream = self._connections.upstreams.get(engine.url)
        if upstream is not None:
            engine.request_fields = await learn_request_fields(engine.url, upstream)

    async def _learn_models(self, engine: EngineSlots, timeout_s: float) -> None:
        """The model names an engine without ``models`` in the configuration serves, from
        its ``/v1/models`` (at start-up, then with every good health check: an engine
        restarted with another model moves to that model's pool)."""
        upstream = self._connections.upstreams.get(engine.url)
        if upstream is None:  # it left the configuration
            return
        try:
            status, _, content = await upstream.fetch("GET", "/v1/models", timeout_s)
        except (UpstreamError, TimeoutError):
            return
        listing = _model_ids(content) if status == 200 else None
        if listing is None:
            # Once per engine and answer, not with every health check (every 2 s).
            if engine.models is None and self._models_problem.get(engine.url) != status:
                self._models_problem[engine.url] = status
                logger.warning("engine %s: cannot read its model names from /v1/models "
                               "(HTTP %s); set engines[].models", engine.url, status)
            return
        self._models_problem.pop(engine.url, None)
        names, adapters = listing
        engine.adapters.listed(adapters)
        # An adapter it lists is a model of its own too: a pool of the engines that list
        # it, for requests that name it without an ``adapters`` entry (those with one go
        # to their base's pool, ``admission.route``).
        names = names | adapters.keys()
        if engine.config.models is None and self._fleet.set_models(engine, names):
            logger.info("engine %s serves %s", engine.url, ", ".join(sorted(names)))


def _model_ids(content: bytes) -> tuple[frozenset[str], dict[str, str]] | None:
    """The models of an OpenAI ``/v1/models`` answer: the ``id`` of every entry without a
    ``parent``, and each LoRA adapter's (an entry with one, as vLLM lists them) -> its
    parent. None: not such an answer, or no model in it."""
    try:
        data = json.loads(content).get("data")
    except (ValueError, AttributeError):
        return None
    if not isinstance(data, list):
        return None
    names: set[str] = set()
    adapters: dict[str, str] = {}
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        parent = entry.get("parent")
        if isinstance(parent, str) and parent and parent != entry["id"]:
            adapters[entry["id"]] = parent
        else:
            names.add(entry["id"])
    return (frozenset(names), adapters) if names else None
