"""An engine's load, read from its ``/metrics``: the saturation gauges the dispatch gate
holds requests by (``EngineSlots.saturated``).

Each engine has one reader (``read_load``) while it is in the fleet: every
``LOAD_INTERVAL_S``, and sooner while the gate holds requests for it.
"""

from __future__ import annotations

import asyncio
import math
import re

from ..engines import Upstream, UpstreamError
from ._fleet import Fleet
from ._slots import EngineSlots

LOAD_INTERVAL_S = 0.5
LOAD_SOON_S = 0.025

_GAUGES = re.compile(
    rb"^vllm:(num_requests_waiting|num_requests_running|kv_cache_usage_perc)"
    rb"(?:\{[^\n]*\})? (\S+)(?: -?\d+)?$", re.MULTILINE)
"""The three gauges' samples in Prometheus' text format (any labels; an optional timestamp)."""
_MAX_LORA = re.compile(rb'^vllm:lora_requests_info\{[^\n]*max_lora="(\d+)"', re.MULTILINE)
"""vLLM's ``--max-loras`` in the labels of its LoRA gauge (there once a LoRA engine ran a
request)."""
_GAUGES_PATH = ("/metrics?name%5B%5D=vllm:num_requests_waiting"
                "&name%5B%5D=vllm:num_requests_running&name%5B%5D=vllm:kv_cache_usage_perc"
                "&name%5B%5D=vllm:lora_requests_info")
"""Prometheus's ``name[]`` filter naming the three gauges: a tokenpace engine then leaves
its own ``tokenpace_engine_*`` series out (and does not ask its engine core for them);
vLLM's own page ignores the filter."""


def reread_delay(read_at: float, now: float, soon: float = LOAD_SOON_S) -> float:
    """How long to wait before reading the gauges again, the gate having closed at ``now``
    on the reading taken at ``read_at``.

    A reading taken moments ago may count requests the gateway just dispatched that the
    engine's next step admits: it is read again once ``soon`` has passed. An older one is
    read again at once. That is the common case: the gate closed on a reading from up to
    ``LOAD_INTERVAL_S`` ago, taken while other load queued in the engine, and holds every
    request of a new burst until a fresh one.
    """
    return max(0.0, read_at + soon - now)


async def engine_load(upstream: Upstream, engine: EngineSlots | None = None,
                      ) -> tuple[float | None, float | None, float | None]:
    """vLLM's waiting-request count, KV-cache use and running-request count from its
    /metrics (None: not there; several engines behind one server: counts summed, the
    fullest KV cache). With ``engine``, the ``max_lora`` its LoRA gauge names is kept as
    its ``adapters.reported_max`` (``EngineSlots.max_adapters``).

    Cost: one GET of the three gauges (vLLM's own page, ~50 KB, where it ignores the
    filter) and one regular-expression scan of the answer; at most 2 s.
    """
    try:
        status, _, content = await upstream.fetch("GET", _GAUGES_PATH, 2.0)
    except (UpstreamError, TimeoutError):
        return None, None, None
    if status != 200:
        return None, None, None
    waiting = kv = running = None
    for name, value in _GAUGES.findall(content):
        try:
            number = float(value)
        except ValueError:
            continue
        if name == b"num_requests_waiting":
            waiting = (waiting or 0.0) + number
        elif name == b"num_requests_running":
            running = (running or 0.0) + number
        else:
            kv = max(kv or 0.0, number)
    if engine is not None and b"lora_requests_info" in content:
        found = _MAX_LORA.search(content)
        if found:
            engine.adapters.reported_max = int(found.group(1))
    return waiting, kv, running


async def read_load(fleet: Fleet, engine: EngineSlots, upstream: Upstream) -> None:
    """The engine's saturation gauges every 0.5 s, and sooner while the gate holds
    requests: when it closes, from a reading at least 25 ms old (``reread_delay``),
    then every 25 ms, doubling while the engine stays full. Runs until cancelled."""
    loop = asyncio.get_running_loop()
    soon = LOAD_SOON_S
    read_at = -math.inf
    while True:
        if engine.healthy:
            fleet.set_load(engine, *await engine_load(upstream, engine))
            read_at = loop.time()
        if engine.held.is_set():
            engine.held.clear()
            if engine.waiting() and engine.saturated():
                await asyncio.sleep(soon)
                soon = min(2 * soon, LOAD_INTERVAL_S)
                continue
        soon = LOAD_SOON_S
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can drop a cancel
            # that lands as the wait ends, and this loop would outlive its gateway.
            async with asyncio.timeout(LOAD_INTERVAL_S):
                await engine.held.wait()
        except TimeoutError:
            pass
        else:
            await asyncio.sleep(reread_delay(read_at, loop.time()))
