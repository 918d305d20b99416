"""The engines' life in the gateway: who is in the fleet, which models each serves, its
health, load, drain and shutdown, and the connections to it.

- ``EngineSlots``: one engine as dispatch decisions read it (standing, capacity, load,
  the LoRA adapters it holds: ``AdapterSet``; ``place_adapter`` and ``ensure_loaded``).
- ``Fleet``: the engine list and every engine's standing; each change is applied at once
  and told to the dispatcher through ``Dispatch``.
- ``Monitor``: the background work that feeds ``Fleet``: health probes on a
  ``ProbeSchedule``, a load reader per engine (``read_load``), DNS discovery
  (``Discovery``), model names from ``/v1/models``, the scheduling policy each engine
  reports; engines joining and leaving get their ``Connections`` opened and retired.

Imports run one way: ``dispatch`` imports this package (``EngineSlots``, ``Fleet``) and
implements ``Dispatch``; nothing here imports ``dispatch``. Each ``dispatch.Dispatcher``
owns one ``Fleet`` (its ``fleet``); the server makes one ``Monitor`` for it at start-up.
Requests read ``EngineSlots`` on their path; every write here happens on the event loop,
off a request's path, except ``Fleet.connect_failed`` and ``Fleet.set_stopping`` (the
request that saw the engine refuse or shut down) and ``EngineSlots.connect_ok``.
"""

from ._adapter_set import AdapterNote, AdapterSet, AdapterState
from ._adapters import AdapterLoadFailed, ensure_loaded, place as place_adapter
from ._connections import ENGINE_KEEPALIVE_S, Connections
from ._discovery import Discovery, Resolve, engine_at, resolve_addresses
from ._fields import learn_request_fields, request_fields
from ._fleet import EJECT_LAST_AFTER, Dispatch, Fleet
from ._health import (
    DOWN_AFTER_FAILURES,
    HEALTH_INTERVAL_S,
    HEALTH_TIMEOUT_S,
    PROBE_FIRST_S,
    ProbeSchedule,
    engine_retry_headers,
)
from ._load import LOAD_INTERVAL_S, LOAD_SOON_S, engine_load, read_load, reread_delay
from ._monitor import START_MODELS_TIMEOUT_S, Monitor
from ._policy import UNKNOWN, policy_problem, reported_capacity, reported_policy
from ._slots import EnginePool, EngineSlots

__all__ = [
    "AdapterLoadFailed",
    "AdapterNote",
    "AdapterSet",
    "AdapterState",
    "Connections",
    "ensure_loaded",
    "place_adapter",
    "Discovery",
    "Dispatch",
    "DOWN_AFTER_FAILURES",
    "EJECT_LAST_AFTER",
    "ENGINE_KEEPALIVE_S",
    "engine_at",
    "engine_load",
    "engine_retry_headers",
    "EnginePool",
    "EngineSlots",
    "Fleet",
    "HEALTH_INTERVAL_S",
    "HEALTH_TIMEOUT_S",
    "learn_request_fields",
    "LOAD_INTERVAL_S",
    "LOAD_SOON_S",
    "Monitor",
    "policy_problem",
    "PROBE_FIRST_S",
    "ProbeSchedule",
    "read_load",
    "reported_capacity",
    "reported_policy",
    "request_fields",
    "reread_delay",
    "Resolve",
    "resolve_addresses",
    "START_MODELS_TIMEOUT_S",
    "UNKNOWN",
]
