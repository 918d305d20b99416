"""The LoRA adapters each engine holds, where a request for one goes, and loading it there.

vLLM serves adapters over its base model (``--enable-lora``): at most ``--max-loras`` of
them in one step, loaded at run time through ``/v1/load_lora_adapter`` (with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) and listed in ``/v1/models`` with their ``parent``.
The gateway keeps at most ``max_adapters`` loaded per engine (set it to the engine's
``--max-loras``, so every adapter an engine holds can run in the same step and none of
its requests waits inside the engine for another adapter's).

Placement (``place``), among the engines of the base's pool that take the request now:

- an engine that holds the adapter, the least loaded of them, while it has at most
  ``adapter_affinity`` more of the gateway's requests in flight than the least loaded
  engine of the pool: the adapter's requests stay where its weights are;
- where every engine that holds it is that much busier: the least loaded engine with a
  free place, if it is less loaded, else still the holder (evicting another adapter for
  an adapter that is only busier would cost that adapter a load, and churn);
- where no engine that takes the request now holds it, but one that is full does, and
  every engine with room would have to evict an adapter: none, the request waits for the
  holder's next free slot (``Dispatcher`` tries it again at every dispatch round of the
  pool, other tenants' requests going meanwhile);
- otherwise, where no engine that takes the request now holds it: the engine where loading it costs
  least, the least loaded, counting an engine that must first evict another adapter as
  ``adapter_affinity`` busier. So a hot adapter spreads over more engines as its load
  grows (to free places, and wherever its engines are full), and a rare one is always
  served (it is loaded, evicting the
  least recently used adapter that has no request in flight; where every one has, none:
  the engine holds one more until one is idle at a later load).

An adapter an engine lists without an ``adapters`` entry is a model of its own to the
gateway: a pool of the engines that list it (``Monitor``), nothing loaded elsewhere.

Several replicas learn what each engine holds from its ``/v1/models`` (every health check,
``AdapterSet.listed``) and, sharing a state store, from each other's words
(``AdapterSet.shared``, sent and read by ``dispatch``); a load of an adapter already
there counts as done (vLLM answers that it is loaded).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
import httpx

from .. import metrics
from ._adapter_set import AdapterSet
from ._slots import EngineSlots

logger = logging.getLogger("tokenpace.gateway")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
LOAD_TIMEOUT_S = 60.0


class AdapterLoadFailed(Exception):
    """The engine did not load the adapter (its answer, or why no answer came)."""


def place(engines: Sequence[EngineSlots], adapter: str, affinity: int,
          pool: Sequence[EngineSlots] = ()) -> EngineSlots | None:
    """The engine a request for ``adapter`` goes to, among ``engines`` (those of the base's
    pool that take it now; see the module); None: none now (``engines`` is empty, or the
    request waits for an engine of ``pool`` that holds the adapter to have room). O(engines
    of the pool)."""
    if not engines:
        return None
    least = min(engines, key=lambda e: e.inflight)
    holders = [e for e in engines if adapter in e.adapters]
    if holders:
        best = min(holders, key=lambda e: e.inflight)
        if best.inflight <= least.inflight + affinity:
            return best
        # Spread to an engine with a free place; evicting another adapter for one that is
        # only busier costs that adapter's next request a load (and churn under Zipf).
        roomy = [e for e in engines if not e.adapters_full]
        spare = min(roomy, key=lambda e: e.inflight, default=None)
        return spare if spare is not None and spare.inflight < best.inflight else best
    if all(e.adapters_full for e in engines) \
            and any(adapter in e.adapters and e.accepts for e in pool):
        # Every engine with room would evict an adapter for it, while one without room now
        # holds it: wait for that one's next free slot (a request ends there) rather than
        # evict an adapter that its own next request would load back.
        return None
    return min(engines, key=lambda e: e.inflight
               + (affinity if e.adapters_full else 0))


async def ensure_loaded(engine: EngineSlots, client: httpx.AsyncClient, name: str,
                        path: str) -> bool:
    """Make ``engine`` hold adapter ``name`` before a request for it is sent there; True
    when this call loaded it (False: it was held, or another call's load was waited for).
    Concurrent calls for one engine and adapter share one load, a task of its own: a
    caller that is cancelled (its client left) does not cancel it for the others. Raises
    ``AdapterLoadFailed``. At most ``LOAD_TIMEOUT_S`` for the load, the same for each
    unload before it (``_load_here``)."""
    adapters = engine.adapters
    task = adapters.loading.get(name)
    mine = task is None
    if task is None:
        if name in adapters.held:
            return False
        task = asyncio.get_running_loop().create_task(_load_here(engine, client, name, path))
        adapters.loading[name] = task
        task.add_done_callback(_loaded(adapters, name))
    await asyncio.shield(task)
    return mine


def _loaded(adapters: AdapterSet, name: str) -> Callable[[asyncio.Task[None]], None]:
    def done(task: asyncio.Task[None]) -> None:
        if adapters.loading.get(name) is task:
            del adapters.loading[name]
        if not task.cancelled():
            task.exception()  # retrieved: no warning when every caller left
    return done


async def _load_here(engine: EngineSlots, client: httpx.AsyncClient, name: str,
                     path: str) -> None:
    """Unload adapters while the engine holds its ``max_adapters`` and one is idle
    (``AdapterSet.victim``; a failed unload is logged and the load goes on: vLLM then
    holds one more), then load ``name``."""
    adapters = engine.adapters
    # Held or being loaded here, this one left out: at most ``max_adapters`` after it.
    while len(adapters.held.keys() | adapters.loading.keys()) - 1 >= engine.max_adapters:
        victim = adapters.victim(keep=name)
        if victim is None:
            break
        adapters.unloaded(victim)
        await _unload(engine, client, victim)
    await _load(engine, client, name, path)
    adapters.loaded(name)


async def _load(engine: EngineSlots, client: httpx.AsyncClient, name: str, path: str) -> None:
    try:
        resp = await client.post(LOAD_PATH, json={"lora_name": name, "lora_path": path},
                                 timeout=LOAD_TIMEOUT_S)
    except httpx.HTTPError as exc:
        metrics.ADAPTER_LOADS.labels(engine.url, "failed").inc()
        raise AdapterLoadFailed(f"engine {engine.url} did not answer the load of adapter "
                                f"{name!r} ({type(exc).__name__})") from None
    # vLLM answers 400 "has already been loaded" where another replica (or its own
    # --lora-modules) loaded it: the engine holds it, which is what was asked.
    if resp.status_code == 200 or (resp.status_code == 400 and "already" in resp.text):
        metrics.ADAPTER_LOADS.labels(engine.url, "ok").inc()
        return
    metrics.ADAPTER_LOADS.labels(engine.url, "failed").inc()
    raise AdapterLoadFailed(f"engine {engine.url} refused to load adapter {name!r} "
                            f"(HTTP {resp.status_code}: {resp.text[:300]})")


async def _unload(engine: EngineSlots, client: httpx.AsyncClient, name: str) -> None:
    try:
        resp = await client.post(UNLOAD_PATH, json={"lora_name": name},
                                 timeout=LOAD_TIMEOUT_S)
    except httpx.HTTPError as exc:
        logger.warning("engine %s: unloading adapter %r failed (%s)", engine.url, name,
                       type(exc).__name__)
        return
    if resp.status_code == 200:
        metrics.ADAPTER_UNLOADS.labels(engine.url).inc()
    elif resp.status_code not in (400, 404):  # not there (another replica unloaded it)
        logger.warning("engine %s: unloading adapter %r answered HTTP %d", engine.url, name,
                       resp.status_code)
