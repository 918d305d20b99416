"""The gateway's ASGI application: routes, start-up and shutdown, reload.

Start-up opens the ledger and its journal, restores budget levels from it (budgets survive
a restart), records the requests the process before left in flight (``_recovery``), then
starts the background work: the fleet's ``Monitor`` (engine health, load, discovery,
model names), budget snapshots, idle series, the ledger checked against the engines'
books (``reconcile``). Shutdown waits a bounded time for settlements, writes a last
snapshot and closes the ledger, whose journal keeps what it could not write.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .. import metrics
from ..admission import adapter_of, authenticate, authorization_of, bearer_key, tenant_models
from ..config import (
    ConfigError,
    EngineConfig,
    GatewayConfig,
    keep_engine_keys,
    load_config,
    paused_gc,
)
from ..dispatch import make_dispatcher
from ..engines import RateSplitter, SharedSplitBook, http_send
from ..exchange import Runtime
from ..fleet import UNKNOWN, Connections, Discovery, Monitor, policy_problem
from ..ledger import BudgetState, UsageRecord, open_ledger, redact
from ..reconcile import Reconciler, tenant_of_user
from ._recovery import correct_settled, recover_in_flight, snapshot_times
from ..state import StateStore, open_store
from ..tenants import ReloadPlan, SharedBudgetLevels, Tenants
from ..wire import POOLING_PATHS, GatewayError, Kind, clip, error_response
from ._admin import AdminApi
from ._batches import BatchService
from ._proxy import handle
from ._registry import Registry
from ._scrape import PageCache, metrics_refusal, shows_details, stream, warn_if_open
from ._secrets import register_secrets
from ._tokenize import PATHS as TOKENIZE_PATHS, handle_tokenize
from ._me import me
from ._usage_api import usage_completions

logger = logging.getLogger("tokenpace.gateway")

SNAPSHOT_INTERVAL_S = 1.0
SETTLE_WAIT_S = 5.0
"""How long shutdown waits for settlements still running (a shared store's scripts, an
engine asked what a cut stream generated) before it writes the last rows and levels."""
RECONCILE_OFF_POLL_S = 10.0
"""With ``reconcile_interval: 0``, how often the loop looks whether a reload turned it on."""
PUBLISH_SLICE = 100
"""Tenants whose fairness gauges a scrape sets between two turns for requests."""


_COMPLETION_PATHS: dict[str, Kind] = {"/v1/chat/completions": "chat",
                                     "/v1/completions": "completion",
                                     "/v1/responses": "responses",
                                     "/v1/messages": "messages",
                                     **POOLING_PATHS}  # type: ignore[dict-item]


class Gateway:
    """Owns the runtime; ``app`` is the ASGI application to serve."""

    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.rt: Runtime | None = None
        # Processes serving this port (--workers): open-mode fallback limits divide by it.
        self.workers = 1
        self._started = int(time.time())  # the "created" of /v1/models entries
        self._reloading = asyncio.Lock()
        self.connections = Connections()  # replaced at start-up
        self._background: set[asyncio.Task[None]] = set()
        # Engines named by DNS (``engines[].discovery``): None when there are none; the
        # monitor's from start-up on.
        self._discovery = Discovery() if any(e.discovery for e in config.engines) else None
        self._monitor: Monitor | None = None  # made at start-up
        self.app = self  # the ASGI application to serve (``__call__``)
        self.batches = BatchService(lambda: self.rt)
        self._page = PageCache(self._render_page)  # /metrics, rendered once per metrics_cache
        # The admin API's tenants and keys (made at start-up, from the ledger's database).
        self.registry: Registry | None = None
        admin = AdminApi(lambda: self.config, lambda: self.registry)
        b = self.batches
        self._routes = Starlette(
            routes=[
                Route("/v1/chat/completions", self._not_started, methods=["POST"]),
                Route("/v1/completions", self._not_started, methods=["POST"]),
                Route("/v1/responses", self._not_started, methods=["POST"]),
                Route("/v1/messages", self._not_started, methods=["POST"]),
                *(Route(path, self._not_started, methods=["POST"]) for path in POOLING_PATHS),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/files", b.create_file, methods=["POST"]),
                Route("/v1/files", b.list_files, methods=["GET"]),
                Route("/v1/files/{file_id}", b.get_file, methods=["GET"]),
                Route("/v1/files/{file_id}", b.delete_file, methods=["DELETE"]),
                Route("/v1/files/{file_id}/content", b.file_content, methods=["GET"]),
                Route("/v1/batches", b.create_batch, methods=["POST"]),
                Route("/v1/batches", b.list_batches, methods=["GET"]),
                Route("/v1/batches/{batch_id}", b.get_batch, methods=["GET"]),
                Route("/v1/batches/{batch_id}/cancel", b.cancel_batch, methods=["POST"]),
                *(Route(path, self._tokenize, methods=["POST"]) for path in TOKENIZE_PATHS),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/tokenpace/v1/me", self._me, methods=["GET"]),
                Route("/v1/organization/usage/completions", self._usage, methods=["GET"]),
                Route("/admin/reload", self._admin_reload, methods=["POST"]),
                Route("/admin/engines/drain", self._admin_drain, methods=["POST"]),
                Route("/admin/tenants", admin.create_tenant, methods=["POST"]),
                Route("/admin/tenants", admin.list_tenants, methods=["GET"]),
                Route("/admin/tenants/{tenant_id}", admin.get_tenant, methods=["GET"]),
                Route("/admin/tenants/{tenant_id}", admin.update_tenant, methods=["PATCH"]),
                Route("/admin/tenants/{tenant_id}", admin.delete_tenant, methods=["DELETE"]),
                Route("/admin/tenants/{tenant_id}/keys", admin.create_key, methods=["POST"]),
                Route("/admin/tenants/{tenant_id}/keys", admin.list_keys, methods=["GET"]),
                Route("/admin/keys/{key_id}/rotate", admin.rotate_key, methods=["POST"]),
                Route("/admin/keys/{key_id}", admin.revoke_key, methods=["DELETE"]),
                Route("/admin/audit", admin.audit, methods=["GET"]),
            ],
            lifespan=self._lifespan,
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI application (``app`` is the gateway itself).

        The generation routes go straight to the proxy: per request that saves
        Starlette's route matching, its ``Request`` and the two middleware layers that
        wrap every ``send`` (once per streamed read, on the relay's path). The proxy
        answers its own errors, including a bug's 500. Everything else (other routes,
        other methods, 404s, the lifespan) goes through Starlette.
        """
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = _COMPLETION_PATHS.get(scope["path"])
            rt = self.rt
            if kind is not None and rt is not None:
                response = await handle(rt, kind, scope, receive)
                await response(scope, receive, send)
                return
        await self._routes(scope, receive, send)

    # -- lifecycle -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        config = self.config
        ledger = open_ledger(config.ledger, journal=config.ledger_journal,
                             journal_bytes=config.ledger_journal_max_bytes,
                             on_full=config.on_ledger_full, wait=True)
        metrics.LEDGER_JOURNAL_MAX_BYTES.set(config.ledger_journal_max_bytes)
        # The admin API's tenants and keys join the file's before any state is made.
        # (A second start-up of this object keeps the file's configuration it had.)
        file_config = self.registry.file_config if self.registry is not None else config
        registry = self.registry = Registry(config.ledger, file_config)
        self.config = await asyncio.to_thread(registry.load)
        try:
            levels = ledger.load_budgets()
            tenants = Tenants(self.config, self.clock, _restore_levels(levels))
            # Connections to the engines named by address now; DNS-named ones and those a
            # reload adds get theirs as they join (``Monitor.apply``).
            connections = self.connections = Connections()
            for engine in self.config.engines:
                if engine.discovery is None:
                    connections.open(engine)
            clients, upstreams = connections.clients, connections.upstreams
            # Shared budgets (state: redis://...); None keeps them in this process.
            store = (open_store(self.config.state, workers=self.workers)
                     if self.config.state.shared else None)
            if store is not None:
                await store.start()
                _register_state_collector(store)
            # With a shared store, max_concurrency, max_queued and engine max_inflight are
            # global leases and the VTC counters shared; without, all stays in process.
            self.rt = Runtime(self.config, tenants, make_dispatcher(self.config, self.clock, store),
                              clients, ledger, clock=self.clock, upstreams=upstreams,
                              store=store, keys=registry.keys)
            # Paced tenants' rates split over the engines their streams run on: the book
            # in process, or in the shared store where several replicas serve them.
            if self.rt.dispatcher.splits_rates:
                self.rt.rate_split = RateSplitter(
                    http_send(clients), book=None if store is None else SharedSplitBook(store))
                await self.rt.rate_split.book.start()
            elif len(self.config.engines) > 1 and any(
                    t.output_tokens_per_second is not None for t in self.config.tenants):
                logger.warning("engines without api_key: a paced tenant stays on one engine "
                               "per model, paced there at its whole rate (moving its rate "
                               "between engines needs each engine's key)")
            rt = self.rt
            monitor = self._monitor = Monitor(
                rt.dispatcher.fleet, connections, self.clock, lambda: rt.config,
                lambda url: rt.prompt_bounds.forget(url), self._reloading, self._discovery)
            # DNS-named engines and every engine's model names, before any request.
            await monitor.join_named()
            registry.start(self._commit_registry)
            tasks = [asyncio.create_task(self._snapshot_loop()),
                     asyncio.create_task(self._sweep_loop()),
                     asyncio.create_task(registry.run())]
            if store is None:
                metrics.BUDGET_REMAINING.source = tenants.budget_samples
                metrics.APPLICATION_BUDGET_REMAINING.source = tenants.application_budget_samples
                metrics.BUDGET_USED_RATIO.source = tenants.budget_used_samples
                metrics.APPLICATION_BUDGET_USED_RATIO.source = tenants.application_budget_used_samples
            else:
                # The process's own buckets are unused: publish the shared levels, read in
                # the background (a scrape never waits on the store).
                shared_levels = SharedBudgetLevels(tenants.series, store)
                metrics.BUDGET_REMAINING.source = shared_levels.samples
                metrics.APPLICATION_BUDGET_REMAINING.source = shared_levels.application_samples
                metrics.BUDGET_USED_RATIO.source = shared_levels.used_samples
                metrics.APPLICATION_BUDGET_USED_RATIO.source = shared_levels.application_used_samples
                tasks.append(asyncio.create_task(shared_levels.run()))
            monitor.start()
            await self.batches.start()  # after the pools: a resumed batch's lines may run
            # After the engines' clients: each is asked what its orphans generated.
            snapshots = snapshot_times(levels)
            correct_settled(self.rt, ledger.journaled_settlements(), snapshots)
            self._spawn(recover_in_flight(self.rt, ledger.orphans(), snapshots))
            self._spawn(self._reconcile_loop())
            warn_if_open(self.config)
            logger.info("tokenpace gateway: %d tenant(s), %d engine(s), ledger %s",
                        len(self.config.tenants), len(self.rt.dispatcher.engines),
                        redact(self.config.ledger))
            # What start-up made (modules, configuration, clients) lives as long as the
            # process: out of the collector's sight, a full collection no longer walks it
            # (one took 29 ms here, a pause every request in flight waits out).
            gc.collect()
            gc.freeze()
            try:
                yield
            finally:
                await self.batches.close()
                for task in [*tasks, *self._background]:
                    task.cancel()
                monitor.stop()
                self._discovery = monitor.discovery  # for a later start-up
                # Settlements in the background (a shared store's scripts, the engines'
                # counts of cut streams) finish before their rows and levels are written.
                if self.rt.settling:
                    await asyncio.wait(list(self.rt.settling), timeout=SETTLE_WAIT_S)
                await self.rt.dispatcher.close()
                if self.rt.rate_split is not None:
                    await self.rt.rate_split.close()
                await connections.close()
                if store is not None:
                    await store.close()
                self._snapshot()
                tenants.series.clear()
                await registry.close()
        finally:
            ledger.close()

    def _snapshot(self) -> None:
        """The budget levels that changed since the last snapshot, to the ledger (its
        writer thread writes them): an untouched tenant's saved row stays right, since a
        restore refills it for the time since it was saved."""
        rt = self.rt
        if rt is None:
            return
        now = time.time()
        rt.ledger.save_budgets([
            BudgetState(tenant, key, level, now)
            for tenant, levels in rt.tenants.changed_levels().items()
            for key, level in levels.items()
        ])

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)
            self._snapshot()

    async def _reconcile_loop(self) -> None:
        """The ledger against the engines' books every ``reconcile_interval``
        (``reconcile.Reconciler``: drift counted per tenant in metrics). The interval, the
        grace and ``request_timeout`` are read again before each check (a reload may
        change them; an interval of 0 turns the check off). Cost per check: see
        ``reconcile._check``; the ledger's flush and reads run in a thread."""
        rt = self.rt
        assert rt is not None

        def is_tenant(tenant: str) -> bool:
            return rt.tenants.get(tenant) is not None

        def rows_of(request_ids: list[str]) -> dict[str, UsageRecord]:
            rt.ledger.flush()  # this process's rows journaled so far: in the database
            return rt.ledger.rows_of(request_ids)

        reconciler = Reconciler(grace_s=self.config.reconcile_grace_s, hold_s=0.0,
                                tenant_of=lambda user: tenant_of_user(user, is_tenant),
                                since=time.time() - self.config.reconcile_interval_s)
        while True:
            interval = self.config.reconcile_interval_s
            await asyncio.sleep(interval or RECONCILE_OFF_POLL_S)
            if not interval:
                continue
            config = self.config
            reconciler.grace_s = config.reconcile_grace_s
            reconciler.hold_s = config.request_timeout_s + config.reconcile_grace_s
            clients = {e.url: rt.clients[e.url] for e in rt.dispatcher.engines
                       if e.url in rt.clients}
            try:
                await reconciler.check(clients, rows_of)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("ledger check against the engines failed")

    async def _sweep_loop(self) -> None:
        """Idle tenants' series leave /metrics (``metrics_idle_after``)."""
        assert self.rt is not None
        while True:
            await asyncio.sleep(self.rt.tenants.series.sweep_interval_s)
            self.rt.tenants.series.sweep()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background until it ends or the gateway stops."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _load_reload(self) -> tuple[ReloadPlan, GatewayConfig, frozenset[str]]:
        """Read, check and pair the new configuration with the live tenants: the slow part
        of a reload (O(tenants): parsing, validation, lookup tables, new tenants' states),
        in a worker thread while the event loop serves.

        Tenants, lanes, costs, timeouts, admin keys and engines change (engines join and
        leave: ``Monitor.apply``); the ledger and the state store are fixed for the life
        of the process, so a file that changes them is refused as a whole. The admin API's
        tenants stay, merged after the file's (``Registry.merged``: the file wins an id);
        with the plan, the file's configuration and the ids of the API tenants served.
        """
        if self.config.source is None:
            raise ConfigError("the gateway was not started from a file; nothing to reload")
        new = keep_engine_keys(load_config(self.config.source), self.config).build_indexes()
        if (new.ledger, new.ledger_journal) != (self.config.ledger, self.config.ledger_journal):
            raise ConfigError("ledger: changing the ledger or its journal needs a restart")
        if new.state != self.config.state:
            raise ConfigError("state: changing the state store needs a restart")
        assert self.rt is not None
        if self.rt.dispatcher.splits_rates:
            for i, engine in enumerate(new.engines):
                if not engine.api_key:
                    raise ConfigError(
                        f"engines[{i}].api_key: required here, every engine has a key (paced "
                        "tenants' rates are split over engines by a control call that needs "
                        "it); an engine without one needs a restart")
        assert self.registry is not None
        with paused_gc():  # thousands of new tenants' states: see paused_gc
            merged, served = self.registry.merged(new, reload=True)
            return self.rt.tenants.plan(merged), new, served

    def _commit_reload(self, plan: ReloadPlan, engines: list[EngineConfig],
                       file_config: GatewayConfig, served: frozenset[str]) -> GatewayConfig:
        """Swap the new configuration in, on the event loop, between two requests' steps:
        O(tenants whose configuration changed + tenants the fair queues have seen + engines).
        Requests in flight keep their tenant's state object, and with it what they were
        admitted under, and their engine even when it left the list."""
        assert self.rt is not None
        new = plan.config
        register_secrets(new)  # an engine the reload adds may bring a key
        self.rt.tenants.commit(plan)
        assert self._monitor is not None
        self._monitor.apply(engines)
        self.rt.dispatcher.configure(new)
        self.rt.config = new
        self.config = new
        assert self.registry is not None
        self.registry.file_config = file_config
        self.registry.keys.tenants = served
        # The new configuration lives until the next reload, like start-up's: out of the
        # collector's sight as well (see _lifespan). Unfrozen, its objects made the next
        # full collection walk them all: one pause of 60+ ms, after a 10,000-tenant reload,
        # that a request in flight waited out. Young garbage is collected first (cheap), so
        # only live objects and what older garbage a cycle holds are frozen.
        gc.collect(1)
        gc.freeze()
        logger.info("tokenpace gateway: reloaded %s: %d tenant(s), %d engine(s)", new.source,
                    len(new.tenants), len(self.rt.dispatcher.engines))
        return new

    def reload(self) -> GatewayConfig:
        """Re-read the configuration file, all on the calling thread (tools, tests);
        in-flight requests are not touched. DNS-named engines keep the addresses last
        resolved (a new name is resolved by the next discovery round)."""
        plan, file_config, served = self._load_reload()
        assert self._monitor is not None
        return self._commit_reload(plan, self._monitor.known(plan.config.engines), file_config,
                                   served)

    async def reload_async(self) -> GatewayConfig:
        """``reload`` with its slow part in a worker thread (``POST /admin/reload``); one
        reload at a time, so two never pair against the same live states. DNS-named
        engines are resolved before the new configuration is applied."""
        async with self._reloading:
            plan, file_config, served = await asyncio.to_thread(self._load_reload)
            if self.rt is None:
                raise ConfigError("the gateway stopped during the reload")
            assert self._monitor is not None
            engines = await self._monitor.resolve(plan.config.engines)
            if self.rt is None:
                raise ConfigError("the gateway stopped during the reload")
            return self._commit_reload(plan, engines, file_config, served)

    async def _commit_registry(self) -> None:
        """The admin API's tenants changed: the served configuration merged again and
        swapped in as a reload does (``Tenants.plan`` in a worker thread, ``commit`` here;
        the queues learn the tenants' lanes and weights), without reading the file or
        touching the engines. One at a time with reloads."""
        async with self._reloading:
            rt, registry = self.rt, self.registry
            if rt is None or registry is None:
                return
            new, served = await asyncio.to_thread(registry.merged, registry.file_config)
            plan = await asyncio.to_thread(rt.tenants.plan, new)
            rt.tenants.commit(plan)
            rt.dispatcher.configure_tenants(new)
            rt.config = new
            self.config = new
            registry.keys.tenants = served

    # -- routes ----------------------------------------------------------------------

    async def _not_started(self, request: Request) -> Response:
        """A completion or pooling request before start-up finished (``app`` serves them
        once it has)."""
        return error_response(503, "the gateway is starting", code="engine_unavailable",
                              headers={"retry-after": "1"})

    async def _models(self, request: Request) -> Response:
        """The models the tenant may use, in OpenAI's list format (decided here: no engine
        call). An alias is listed beside its model with ``root`` naming the served model."""
        rt = self.rt
        assert rt is not None
        try:
            tenant = authenticate(rt, authorization_of(request.headers))
        except GatewayError as exc:
            return exc.response()
        data = []
        for name in tenant_models(rt, tenant):
            adapter = adapter_of(rt, name)
            served = rt.config.served_name(name) if adapter is None else adapter.base
            data.append({"id": name, "object": "model", "created": self._started,
                         "owned_by": "tokenpace", "root": served,
                         "parent": served if served != name else None})
        return JSONResponse({"object": "list", "data": data})

    async def _health(self, request: Request) -> Response:
        """The status (200 ``ok``, else 503) for anyone; the engines and the state store
        only for a metrics or admin key (they name hosts)."""
        rt = self.rt
        assert rt is not None
        ok = any(e.accepts for e in rt.dispatcher.engines)
        status = "ok" if ok else "no engine in dispatch (down or drained)"
        if not shows_details(self.config, request):
            return JSONResponse({"status": status}, status_code=200 if ok else 503)
        engines = [{"url": e.url, "healthy": e.healthy, "draining": e.drained,
                    **({"shutting_down": True} if e.stopping_since is not None else {}),
                    "inflight": e.inflight, "queued": e.waiting(),
                    "capacity": e.capacity, "reserved_slots": e.reserve,
                    "models": sorted(e.models or ()), **self._policy_fields(e.config),
                    **({"discovered_from": e.config.discovered_from}
                       if e.config.discovered_from else {})}
                   for e in rt.dispatcher.engines]
        body: dict[str, object] = {"status": status, "engines": engines}
        body["state"] = rt.store.describe() if rt.store is not None else {"backend": "memory",
                                                                            "healthy": True}
        return JSONResponse(body, status_code=200 if ok else 503)

    def _policy_fields(self, engine: EngineConfig) -> dict[str, object]:
        reported = (UNKNOWN if self._monitor is None
                    else self._monitor.policies.get(engine.url, UNKNOWN))
        fields: dict[str, object] = {"scheduling_policy": {
            "configured": engine.scheduling_policy, "engine": reported}}
        problem = policy_problem(engine.url, engine.scheduling_policy, reported)
        if problem:
            fields["warning"] = problem
        return fields

    async def _metrics(self, request: Request) -> Response:
        """The page (``_scrape``): behind ``metrics_api_keys`` when set, rendered at most
        once per ``metrics_cache`` whatever the number of scrapers."""
        refusal = metrics_refusal(self.config, request)
        if refusal is not None:
            return refusal
        page = await self._page.page(self.config.metrics_cache_s)
        return StreamingResponse(stream(page), media_type=CONTENT_TYPE_LATEST)

    async def _render_page(self) -> list[bytes]:
        """A new page: the fairness gauges set here (O(active tenants)), the text built and
        formatted in slices on the loop (``metrics.render_chunks``), so a render never holds
        the event loop for long; with no cyclic garbage collection meanwhile (``paused_gc``:
        its many short-lived objects would set off full collections of a heap that holds
        every series)."""
        if self.rt is not None:
            active = [s.id for s in self.rt.tenants.series.active()]
            for i in range(0, len(active), PUBLISH_SLICE):  # a turn for requests between two
                self.rt.dispatcher.publish(active[i:i + PUBLISH_SLICE])
                await asyncio.sleep(0)
        with paused_gc():
            return [chunk async for chunk in metrics.render_chunks()]

    def _admin_refusal(self, request: Request) -> Response | None:
        key = bearer_key(request.headers.get("authorization"))
        if not key or not self.config.is_admin_key(key):
            return error_response(401 if not key else 403, "an admin API key is required",
                                  code="invalid_api_key")
        return None

    async def _admin_drain(self, request: Request) -> Response:
        """``{"engine": url, "drain": true|false}``: drain an engine of this replica (no
        new dispatches; its requests in flight finish) or put it back. Until the next
        reload, which applies the file's ``engines[].drain``."""
        refusal = self._admin_refusal(request)
        if refusal is not None:
            return refusal
        assert self.rt is not None
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        url = body.get("engine") if isinstance(body, dict) else None
        drain = body.get("drain", True) if isinstance(body, dict) else None
        if not isinstance(url, str) or not isinstance(drain, bool):
            return error_response(400, 'expected {"engine": "<url>", "drain": true|false}',
                                  code="invalid_request", param="engine")
        engine = next((e for e in self.rt.dispatcher.engines if e.url == url.rstrip("/")), None)
        if engine is None:
            return error_response(
                404, f"no engine {clip(url)!r}; engines: "
                f"{', '.join(e.url for e in self.rt.dispatcher.engines)}", code="not_found",
                param="engine")
        self.rt.dispatcher.fleet.set_draining(engine, drain)
        logger.warning("engine %s %s by POST /admin/engines/drain", engine.url,
                       "drained" if drain else "back in dispatch")
        return JSONResponse({"engine": engine.url, "draining": engine.draining,
                             "inflight": engine.inflight})

    async def _admin_reload(self, request: Request) -> Response:
        refusal = self._admin_refusal(request)
        if refusal is not None:
            return refusal
        try:
            new = await self.reload_async()
        except ConfigError as exc:
            return error_response(400, f"reload refused, the old configuration stays: {exc}",
                                  code="invalid_config")
        left_out = self.registry.problems if self.registry is not None else []
        return JSONResponse({"reloaded": str(new.source), "tenants": [t.id for t in new.tenants],
                             **({"left_out": left_out} if left_out else {})})

    async def _me(self, request: Request) -> Response:
        assert self.rt is not None
        return await me(self.rt, request)

    async def _usage(self, request: Request) -> Response:
        refusal = self._admin_refusal(request)
        if refusal is not None:
            return refusal
        assert self.rt is not None
        return await usage_completions(self.rt, request)

    async def _tokenize(self, request: Request) -> Response:
        assert self.rt is not None
        return await handle_tokenize(self.rt, request)

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        served = ", ".join(f"{' '.join(sorted(set(r.methods or ()) - {'HEAD'}))} {r.path}"
                           for r in self._routes.routes if isinstance(r, Route)
                           and not r.path.startswith("/admin"))
        return error_response(404, f"no route {clip(request.url.path)}; this gateway serves "
                              f"{served} (and the /admin routes: docs/gateway/admin-api.md)",
                              code="not_found")

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return error_response(405, f"{clip(request.method, 20)} is not allowed on "
                              f"{clip(request.url.path)}",
                              code="method_not_allowed")


def _restore_levels(states: list[BudgetState]) -> dict[str, dict[str, tuple[float, float]]]:
    """Saved levels with their age in seconds: the buckets refill for the downtime."""
    now = time.time()
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for s in states:
        out.setdefault(s.tenant, {})[s.budget] = (s.level, max(0.0, now - s.at))
    return out


def create_app(config_path: str | Path) -> Gateway:
    return Gateway(load_config(config_path))


_state_collector: list[object] = []


def _register_state_collector(store: StateStore) -> None:
    """``tokenpace_gateway_state_*`` on /metrics, read at scrape time (one per process)."""
    from ..state import StateCollector

    if _state_collector:
        _state_collector[0].store = store  # type: ignore[attr-defined]
        return
    collector = StateCollector(store)
    metrics.register(collector)
    _state_collector.append(collector)
