"""``gateway.yaml``, validated strictly.

Every unknown key and every bad value is an error whose message names the key path
(``tenants[1].budgets[0].per``): a typo in a quota must stop the gateway, not silently
leave a tenant unlimited. Parsing is separate from the running state so that a reload can
check a new file completely before anything changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import hmac
import json
import math
import os
import string
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from ...fairness import BudgetSpec, CostModel, RequestLimit, parse_duration
from ...pacing import LimitsError, validate_user_id
from ..state import StateConfig, StateConfigError, parse_state

DEFAULT_LEDGER = "sqlite:///tokenpace-usage.db"
SCHEDULING_POLICIES = ("fcfs", "priority")
ROUTINGS = ("pool", "pinned")


class ConfigError(ValueError):
    """The gateway configuration is invalid; the message names the key."""


@dataclass(frozen=True)
class EngineConfig:
    url: str
    max_inflight: int = 64
    # vLLM refuses a non-zero request priority unless started with --scheduling-policy priority.
    scheduling_policy: str = "fcfs"
    # Saturation read from the engine's own /metrics: hold requests in the gateway (where
    # fairness decides) while the engine already queues this many or its KV cache is this full.
    max_engine_waiting: int | None = 4
    max_kv_cache_usage: float | None = 0.95
    # The engine's API key (``tokenpace serve --trusted-gateway`` requires one on every
    # route). Not compared: ``tokenpace up`` fills in keys it generates, and a reload of
    # the file (which lacks them) must still see the same engines; see keep_engine_keys.
    api_key: str | None = field(default=None, repr=False, compare=False)
    # The engine's --max-num-seqs: how many requests it runs at once. Unset: learned from
    # its /metrics (the running count while requests keep waiting in it).
    max_num_seqs: int | None = None
    # The model names it serves (its --served-model-name). None: learned from its
    # /v1/models at start-up and on health checks.
    models: tuple[str, ...] | None = None
    # What ``tokenpace up`` serves on this engine when it starts it (a path, relative to
    # the configuration's folder, or a hub name); None: up's MODEL argument. Unused by the
    # gateway itself.
    model_path: str | None = None
    # No new dispatches to it; its requests in flight finish (maintenance, a rolling
    # restart). Not compared: a reload applies it to the running engine.
    drain: bool = field(default=False, compare=False)
    # "dns": the url's host names a set of engines (a Kubernetes headless Service): each
    # address it resolves to is an engine of these settings, re-resolved every
    # ``discovery_interval`` (``engines.discover``). None: the url is one engine.
    discovery: str | None = None
    # Set on an engine found by discovery: the configured url it was found under.
    discovered_from: str | None = None
    # Headers for a router in front of engines (llm-d's inference gateway reads a fairness
    # id and an objective from headers): (lower-case name, template) pairs, rendered per
    # completion from the tenant, application, lane, model and end user
    # (``engines.RouterHeaders``). Compared: a reload that changes them is a change, and
    # new requests carry the new ones (requests in flight sent theirs already).
    headers: tuple[tuple[str, str], ...] = ()

    def auth_headers(self) -> dict[str, str]:
        """Headers for every call to this engine."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class ModelConfig:
    """Settings of one model name the engines serve: other names clients may send for it,
    and its cost coefficients (seed 002's a and b depend on the model and its hardware)."""

    name: str
    aliases: tuple[str, ...] = ()
    cost: CostModel | None = None  # None: the top-level cost
    batch_cost: float | None = None  # its batch lines' coefficient; None: ``batch.cost``


@dataclass(frozen=True)
class LaneConfig:
    name: str
    priority: int = 0
    min_share: float = 0.1


APPLICATION_SEPARATOR = "\x1f"
"""Between a tenant id and an application id where both name one thing (the shared
store's keys, the ledger's budget rows, the fair queue): neither id may contain it (config
refuses control characters in both), so no pair can spell another pair or a tenant."""


@dataclass(frozen=True)
class ApplicationConfig:
    """One application inside a tenant: its own keys, share of the tenant's dispatches,
    and limits that apply inside the tenant's (both must admit a request)."""

    id: str
    key_hashes: tuple[bytes, ...]
    weight: float = 1.0
    # Paced in the engine inside the tenant's output_tokens_per_second (trusted engines).
    output_tokens_per_second: float | None = None
    # Its own end users' rate: they are then its own, not the tenant's (see _inner).
    end_user_output_tokens_per_second: float | None = None
    max_concurrency: int | None = None
    observed_concurrency: int | None = None
    budgets: tuple[BudgetSpec, ...] = ()
    observed_budgets: tuple[BudgetSpec, ...] = ()
    max_requests: tuple[RequestLimit, ...] = ()
    observed_requests: tuple[RequestLimit, ...] = ()

    def owner(self, tenant_id: str) -> str:
        """The name its limits are kept under beside its tenant's (shared store, ledger)."""
        return f"{tenant_id}{APPLICATION_SEPARATOR}{self.id}"


DEFAULT_MAX_QUEUED = 64
"""A tenant's requests waiting for an engine slot when its entry names no ``max_queued``:
each holds its parsed body (up to ``max_body_bytes``) while it waits, so the bound is also
the tenant's queued memory; beyond it a request is refused at once (429 ``queue_full``)."""


@dataclass(frozen=True)
class TenantConfig:
    id: str
    key_hashes: tuple[bytes, ...]
    lane: str
    weight: float = 1.0
    output_tokens_per_second: float | None = None
    # Each end user's rate inside output_tokens_per_second (the request's OpenAI ``user``).
    end_user_output_tokens_per_second: float | None = None
    max_concurrency: int | None = None
    # A configuration file's tenant gets DEFAULT_MAX_QUEUED when it names none; None (a
    # value built in code): no bound.
    max_queued: int | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    queue_timeout_s: float = 60.0
    budgets: tuple[BudgetSpec, ...] = ()
    # Request-rate limits (``max_requests``), checked beside concurrency and budgets.
    max_requests: tuple[RequestLimit, ...] = ()
    # Limits with ``mode: observe``: they refuse nothing; what they would have refused is
    # counted (``admission._observe``, ``tenants._would_reject``).
    observed_budgets: tuple[BudgetSpec, ...] = ()
    observed_requests: tuple[RequestLimit, ...] = ()
    observed_concurrency: int | None = None
    share_prefix_cache: bool = False
    # The models (served names, aliases resolved) the tenant may use; None: every model.
    models: frozenset[str] | None = None
    # Applications inside the tenant (``applications``): keys of their own, limits nested
    # in the tenant's, a weighted share of the tenant's dispatches.
    applications: tuple[ApplicationConfig, ...] = ()
    # Its batch lines' cost coefficient (times the model's); None: ``batch.cost``.
    batch_cost: float | None = None

    def application(self, application_id: str) -> ApplicationConfig | None:
        """The application with this id (O(applications): a handful per tenant)."""
        return next((a for a in self.applications if a.id == application_id), None)

    def may_use(self, model: str) -> bool:
        """Whether the tenant may send requests for ``model`` (a served name)."""
        return self.models is None or model in self.models

    @property
    def all_key_hashes(self) -> tuple[bytes, ...]:
        """The digests of the tenant's own keys and of its applications' keys."""
        return self.key_hashes + tuple(d for a in self.applications for d in a.key_hashes)

    @functools.cached_property
    def cache_salt(self) -> str | None:
        """vLLM's ``cache_salt`` for this tenant's requests; None when it shares the cache.

        Without a salt, tenants share vLLM's prefix cache and one can time another's
        prompts (a cached prefix answers faster). The salt is an HMAC of the tenant id
        keyed with the digests of the tenant's own API keys: the same on every gateway
        replica with this configuration, and unknowable to anyone who does not hold one
        of those keys. Changing the tenant's keys changes it (its cache is then cold).
        Computed once per configuration (one HMAC), then read per request.
        """
        if self.share_prefix_cache:
            return None
        secret = b"".join(sorted(self.all_key_hashes))
        return hmac.new(secret, b"tokenpace-prefix-cache:" + self.id.encode(),
                        hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class BatchConfig:
    """The Batch API (``/v1/files``, ``/v1/batches``): where its lines run, what they
    cost, and the bounds on what a tenant may store and run (docs/gateway.md "Batch API")."""

    # The lane batch lines run in (ledger, metrics, the engine's priority); None: the
    # lowest configured lane, resolved by ``GatewayConfig.batch_lane``.
    lane: str | None = None
    cost: float = 1.0  # times the model's coefficients, for batch lines (a discount < 1)
    max_file_bytes: int = 100 * 1024 * 1024
    max_lines: int = 50_000
    max_files: int = 1000  # stored files per tenant (inputs and outputs)
    max_batches: int = 10  # unfinished batches per tenant
    # Bytes a tenant keeps in files, its batches' outputs included (uploads and new batches
    # are refused beyond it; outputs of batches already running are always written).
    max_stored_bytes: int = 1024 * 1024 * 1024
    # Uploads read at once per gateway process (all tenants, then per tenant), and the
    # bytes they may hold together while they are read (``server._upload``).
    max_uploads: int = 4
    max_tenant_uploads: int = 1
    upload_memory: int = 256 * 1024 * 1024
    expire_after_s: float = 24 * 3600.0  # the "24h" completion window, as run
    headroom: int = 1  # slots per engine left free for live requests
    concurrency: int = 64  # lines in flight per gateway process, all batches together
    store: str | None = None  # the store's URL; None: beside the ledger
    # Bytes of one output or error file a batch may write (streamed from its results into
    # the store); a batch whose results would pass it ends failed (output_too_large).
    max_output_bytes: int = 256 * 1024 * 1024
    # How long a clean shutdown lets the lines in flight finish (their results stored)
    # before it stops the rest as if their client had left.
    shutdown_wait_s: float = 10.0


@dataclass(frozen=True)
class GatewayConfig:
    engines: tuple[EngineConfig, ...]
    tenants: tuple[TenantConfig, ...]
    lanes: tuple[LaneConfig, ...] = (LaneConfig("default", 0),)
    cost: CostModel = field(default_factory=CostModel)
    ledger: str = DEFAULT_LEDGER
    # The directory rows and requests in flight are journaled in before the database has
    # them (ledger/_journal.py); None: ``<sqlite file>.journal``, or for Postgres
    # ``tokenpace-journal`` beside the configuration file.
    ledger_journal: str | None = None
    ledger_journal_max_bytes: int = 1024 * 1024 * 1024
    on_ledger_full: str = "refuse"  # or "drop": see ledger.ON_FULL
    admin_key_hashes: tuple[bytes, ...] = ()
    request_timeout_s: float = 600.0
    max_body_bytes: int = 8 * 1024 * 1024
    # The longest ``model`` a request may name (a longer one: 400, echoed clipped).
    max_model_name_chars: int = 256
    # The most prompts a completion request may batch (more: 400).
    max_prompts_per_request: int = 2048
    # Slow clients (docs/gateway.md, "Slow clients and connections"): a request's headers
    # within header_timeout of its first byte (of the connection, for its first request);
    # its body within body_timeout plus one second per body_min_rate bytes received; at
    # most max_connections client connections; a streamed answer buffered for a slow
    # reader up to stream_buffer_bytes per request and tenant_stream_buffer_bytes per
    # tenant, so the engine's slot is free once the engine finished.
    header_timeout_s: float = 20.0
    body_timeout_s: float = 30.0
    body_min_rate: int = 64 * 1024
    max_connections: int = 1000
    stream_buffer_bytes: int = 1024 * 1024
    tenant_stream_buffer_bytes: int = 16 * 1024 * 1024
    lane_share_window_s: float = 30.0
    repin_after_s: float | None = None
    # "fcfs" keeps lanes but serves tenants in arrival order: the baseline for comparisons.
    dispatch_order: str = "vtc"
    # "bound": a prompt whose byte bound decides admission is not sent to /tokenize first;
    # "exact": every prompt a decision depends on is counted by the engine before dispatch.
    prompt_count: str = "bound"
    # Where budgets live: in process (one replica) or shared in Redis (several).
    state: StateConfig = field(default_factory=StateConfig)
    models: tuple[ModelConfig, ...] = ()
    # "pool": one fair queue per model over every engine serving it, load-aware engine
    # choice; "pinned": every tenant on one engine per model (rendezvous hashing).
    routing: str = "pool"
    # A tenant's preferred engine keeps its requests while it has at most this many more
    # in flight than the least loaded engine of the pool (prefix-cache locality).
    pool_affinity: int = 2
    # "conversation": an unpaced tenant's request goes to the engine that served its
    # conversation's last turn (else the one its opening hashes to), within
    # ``conversation_affinity`` of the least loaded, so its turns find their cached prefix
    # there (``dispatch.Dispatcher.choose``); "tenant": the tenant's engine within
    # ``pool_affinity``.
    locality: str = "conversation"
    # A conversation's engine keeps its turns while it has at most this many more in flight
    # than the least loaded engine of the pool: looser than ``pool_affinity`` because a
    # spilled turn recomputes the whole conversation where a tenant's request recomputes
    # only a shared prefix, and a spilled conversation is cached twice.
    conversation_affinity: int = 8
    # A tenant's series leave /metrics once it has been idle this long (``tenants._series``).
    metrics_idle_after_s: float = 900.0
    # Side routes, metrics and dispatch tables (docs/gateway.md, "Limits that protect other
    # tenants"): a /tokenize, /detokenize or count_tokens body of at most
    # max_tokenize_bytes; /metrics behind one of metrics_api_keys (or an admin key) when
    # any is set, its page rendered at most once per metrics_cache; the conversation
    # homes remembered, in all and per tenant.
    max_tokenize_bytes: int = 1024 * 1024
    metrics_key_hashes: tuple[bytes, ...] = ()
    metrics_cache_s: float = 2.0
    max_conversation_homes: int = 100_000
    max_conversation_homes_per_tenant: int = 10_000
    # How often engines with ``discovery: dns`` are resolved again.
    discovery_interval_s: float = 10.0
    # How often the ledger is checked against the engines' books of ended requests
    # (``reconcile``); 0: never. A request is compared once it ended this grace ago.
    reconcile_interval_s: float = 60.0
    reconcile_grace_s: float = 30.0
    batch: BatchConfig = field(default_factory=BatchConfig)
    source: Path | None = None

    @property
    def batch_lane(self) -> str:
        """The lane batch lines run in: ``batch.lane``, else the lowest configured."""
        if self.batch.lane is not None:
            return self.batch.lane
        return max(self.lanes, key=lambda lane: lane.priority).name

    def batch_cost_of(self, model: str, tenant: TenantConfig) -> CostModel:
        """The cost coefficients of a batch line: the model's, times the tenant's
        ``batch_cost``, else the model's ``batch_cost``, else ``batch.cost``."""
        settings = self._model_settings.get(model)
        factor = (tenant.batch_cost if tenant.batch_cost is not None
                  else settings.batch_cost if settings is not None
                  and settings.batch_cost is not None else self.batch.cost)
        cost = self.cost_of(model)
        if factor == 1.0:
            return cost
        return CostModel(cost.prompt * factor, cost.completion * factor,
                         cost.cached_price * factor)

    def served_name(self, model: str) -> str:
        """The served name of ``model`` as a client sent it (an alias resolved)."""
        return self._aliases.get(model, model)

    def cost_of(self, model: str) -> CostModel:
        """The cost coefficients of ``model`` (a served name): its own, else the top-level."""
        settings = self._model_settings.get(model)
        return settings.cost if settings is not None and settings.cost is not None else self.cost

    def aliases_of(self, model: str) -> tuple[str, ...]:
        settings = self._model_settings.get(model)
        return settings.aliases if settings is not None else ()

    @functools.cached_property
    def _aliases(self) -> dict[str, str]:
        return {alias: m.name for m in self.models for alias in m.aliases}

    @functools.cached_property
    def _model_settings(self) -> dict[str, ModelConfig]:
        return {m.name: m for m in self.models}

    def lane(self, name: str) -> LaneConfig:
        return next(lane for lane in self.lanes if lane.name == name)

    def tenant_for_key(self, key: str) -> TenantConfig | None:
        """The tenant owning API key ``key`` (its own, or one of its applications')."""
        identity = self.identity_for_key(key)
        return None if identity is None else identity[0]

    def identity_for_key(self, key: str) -> tuple[TenantConfig, ApplicationConfig | None] | None:
        """The tenant, and the application when it is an application's key, of API key
        ``key``.

        The lookup is by SHA-256 digest, so its timing depends on the digest, never on how
        much of a secret key a guess got right.
        """
        return self._identity_by_digest.get(hash_key(key))

    @property
    def _identity_by_digest(self) -> dict[bytes, tuple[TenantConfig, ApplicationConfig | None]]:
        table = self.__dict__.get("_by_digest")
        if table is None:
            table = {}
            for t in self.tenants:
                own = (t, None)
                for digest in t.key_hashes:
                    table[digest] = own
                for app in t.applications:
                    for digest in app.key_hashes:
                        table[digest] = (t, app)
            object.__setattr__(self, "_by_digest", table)
        return table

    def tenant(self, tenant_id: str) -> TenantConfig | None:
        """The tenant with id ``tenant_id`` (one dict lookup; None: not configured)."""
        table = self.__dict__.get("_by_id")
        if table is None:
            table = {t.id: t for t in self.tenants}
            object.__setattr__(self, "_by_id", table)
        return table.get(tenant_id)

    def build_indexes(self) -> GatewayConfig:
        """Build the lookup tables (key digest and id -> tenant) now: O(tenants), done
        where the configuration is loaded (a worker thread on reload) so that the first
        request after a reload does not build them on the event loop."""
        self.tenant("")
        self.tenant_for_key("")
        return self

    def is_metrics_key(self, key: str) -> bool:
        """Whether ``key`` may read /metrics and /health's details: one of
        ``metrics_api_keys`` or of ``admin_api_keys``."""
        digest = hash_key(key)
        return any(hmac.compare_digest(known, digest)
                   for known in (*self.metrics_key_hashes, *self.admin_key_hashes))

    def is_admin_key(self, key: str) -> bool:
        digest = hash_key(key)
        return any(hmac.compare_digest(known, digest) for known in self.admin_key_hashes)


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection in the block (the whole process; restored after the
    last of several blocks that overlap, in any threads or tasks, ends).

    Reading a large configuration allocates a few hundred thousand objects that all stay
    alive until it is built: every full collection on the way walks them all and finds
    nothing (at 10,000 tenants, seven collections took 1.3 s of a 2.1 s YAML read here,
    one of them 470 ms in a row with the GIL held, which stalled the event loop during a
    reload in a worker thread). A scrape of thousands of tenants' series allocates millions
    of short-lived objects, enough to set off a full collection of a heap holding every
    series (170 ms at 10,000 active tenants). Nothing these blocks make is cyclic garbage;
    plain reference counting still frees everything as usual.
    """
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


_gc_lock = threading.Lock()
_gc_pauses = 0  # paused_gc blocks running now
_gc_was_enabled = True


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a YAML file; relative ledger paths are relative to the file."""
    with paused_gc():
        return _load_config(Path(path))


def _load_config(p: Path) -> GatewayConfig:
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {str(p)!r}: {exc.strerror}") from None
    try:
        data = _parse_text(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    return parse_config(data, base_dir=p.resolve().parent, source=p)


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser where PyYAML has it (about 4x faster than the pure-Python one)."""


def _parse_text(text: str) -> Any:
    """The document in ``text``: JSON when it is a JSON object, otherwise YAML.

    JSON is YAML too, and the same document; but Python's JSON parser reads a 10,000-tenant
    configuration in ~20 ms where PyYAML, even with libyaml, takes ~1.5 s here (it builds a
    node per scalar in Python). Generated tenant lists should be written as JSON.
    """
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except ValueError:
            pass  # not JSON after all (YAML's flow style): YAML says what is wrong
    loader = _YAML_LOADER(text)
    try:
        node = loader.get_single_node()
        data = None if node is None else _construct(loader, node)
    finally:
        loader.dispose()
    _drop_gradually(node)
    return data


_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct(loader: Any, node: Any) -> Any:
    """``loader.construct_document(node)``'s value, built faster: plain strings, lists and
    mappings here (PyYAML's constructor makes a generator per collection, a third of a
    10,000-tenant file's read), every other scalar (numbers, booleans, null, dates) and any
    mapping with a merge key (``<<``) by PyYAML's own safe constructor."""
    if isinstance(node, yaml.ScalarNode):
        return node.value if node.tag == _STR_TAG else loader.construct_object(node, deep=True)
    if isinstance(node, yaml.SequenceNode) and node.tag == "tag:yaml.org,2002:seq":
        return [_construct(loader, item) for item in node.value]
    if isinstance(node, yaml.MappingNode) and node.tag == "tag:yaml.org,2002:map" and not any(
            key.tag == _MERGE_TAG for key, _ in node.value):
        out = {}
        for key_node, value_node in node.value:
            key = _construct(loader, key_node)
            try:
                out[key] = _construct(loader, value_node)
            except TypeError:  # an unhashable key: PyYAML's own message
                return loader.construct_object(node, deep=True)
        return out
    return loader.construct_object(node, deep=True)


def _drop_gradually(node: Any) -> None:
    """Free a YAML node tree one node at a time.

    Dropped at once, the tree of a 10,000-tenant file (170,000 nodes with their marks) is
    freed in one chain of deallocations that holds the GIL for ~40 ms: a reload reads the
    file in a worker thread, and the event loop would wait that out. Taken apart here, the
    interpreter can hand the GIL over between nodes.
    """
    stack = [node] if node is not None else []
    while stack:
        current = stack.pop()
        value = current.value
        if isinstance(value, list):
            current.value = None
            for item in value:
                if isinstance(item, tuple):
                    stack.extend(item)
                else:
                    stack.append(item)


def parse_config(data: Any, base_dir: Path | None = None, source: Path | None = None) -> GatewayConfig:
    root = _mapping(data, "the configuration")
    _known(root, "", ("engines", "tenants", "lanes", "cost", "ledger", "admin_api_keys",
                      "request_timeout", "max_body_bytes", "lane_share_window", "repin_after",
                      "max_model_name_chars", "max_prompts_per_request",
                      "header_timeout", "body_timeout", "body_min_rate", "max_connections",
                      "stream_buffer_bytes", "tenant_stream_buffer_bytes",
                      "dispatch_order", "prompt_count", "state", "on_state_failure", "models",
                      "routing", "pool_affinity", "conversation_affinity",
                      "metrics_idle_after", "max_tokenize_bytes", "metrics_api_keys",
                      "metrics_cache", "max_conversation_homes",
                      "max_conversation_homes_per_tenant",
                      "discovery_interval", "locality", "batch", "ledger_journal",
                      "ledger_journal_max_bytes", "on_ledger_full", "reconcile_interval",
                      "reconcile_grace"))
    engines = tuple(_engine(e, f"engines[{i}]") for i, e in enumerate(_list(root, "engines", required=True)))
    if not engines:
        raise ConfigError("engines: at least one engine is needed")
    urls = [e.url for e in engines]
    if len(set(urls)) != len(urls):
        raise ConfigError("engines: the same url is listed twice")
    lanes = tuple(_lane(x, f"lanes[{i}]") for i, x in enumerate(_list(root, "lanes"))) or (LaneConfig("default", 0),)
    names = [lane.name for lane in lanes]
    if len(set(names)) != len(names):
        raise ConfigError("lanes: lane names must be unique")
    cost = _cost(root.get("cost"))
    models = _models(_list(root, "models"), engines)
    aliases = {alias: m.name for m in models for alias in m.aliases}
    tenants = tuple(
        _tenant(t, f"tenants[{i}]", lanes, aliases, _known_models(models, engines))
        for i, t in enumerate(_list(root, "tenants", required=True))
    )
    if not tenants:
        raise ConfigError("tenants: at least one tenant is needed")
    seen_ids: set[str] = set()
    seen_keys: dict[bytes, str] = {}
    for i, tenant in enumerate(tenants):
        if tenant.id in seen_ids:
            raise ConfigError(f"tenants[{i}].id: tenant {tenant.id!r} is defined twice")
        seen_ids.add(tenant.id)
        owned = [(f"tenants[{i}].api_keys", repr(tenant.id), d) for d in tenant.key_hashes]
        owned += [(f"tenants[{i}].applications[{j}].api_keys",
                   f"{tenant.id!r} application {app.id!r}", d)
                  for j, app in enumerate(tenant.applications) for d in app.key_hashes]
        for where, owner, digest in owned:
            if digest in seen_keys:
                raise ConfigError(f"{where}: a key of {owner} also belongs to "
                                  f"{seen_keys[digest]}")
            seen_keys[digest] = owner
    admin = tuple(_keys(root.get("admin_api_keys", []), "admin_api_keys"))
    ledger = root.get("ledger", DEFAULT_LEDGER)
    if not isinstance(ledger, str) or not ledger:
        raise ConfigError("ledger: must be a URL such as 'sqlite:///usage.db' or 'postgresql://...'")
    if base_dir is not None:
        from ..ledger import resolve_ledger_url

        ledger = resolve_ledger_url(ledger, base_dir)
    journal = _ledger_journal(root.get("ledger_journal"), ledger, base_dir)
    on_full = root.get("on_ledger_full", "refuse")
    from ..ledger import ON_FULL

    if on_full not in ON_FULL:
        raise ConfigError("on_ledger_full: expected 'refuse' (new requests get 503 while the "
                          "ledger's journal is full) or 'drop' (serve them and count the rows "
                          f"that cannot be kept), got {on_full!r}")
    return GatewayConfig(
        engines=engines,
        tenants=tenants,
        lanes=lanes,
        cost=cost,
        ledger=ledger,
        ledger_journal=journal,
        ledger_journal_max_bytes=_int(root, "ledger_journal_max_bytes", "", 1024 * 1024 * 1024,
                                      minimum=64 * 1024) or 0,
        on_ledger_full=on_full,
        admin_key_hashes=admin,
        request_timeout_s=_duration(root, "request_timeout", "", 600.0),
        max_body_bytes=_int(root, "max_body_bytes", "", 8 * 1024 * 1024, minimum=1024) or 0,
        max_model_name_chars=_int(root, "max_model_name_chars", "", 256, minimum=1) or 0,
        max_prompts_per_request=_int(root, "max_prompts_per_request", "", 2048, minimum=1) or 0,
        header_timeout_s=_duration(root, "header_timeout", "", 20.0),
        body_timeout_s=_duration(root, "body_timeout", "", 30.0),
        body_min_rate=_int(root, "body_min_rate", "", 64 * 1024, minimum=0) or 0,
        max_connections=_int(root, "max_connections", "", 1000, minimum=1) or 0,
        stream_buffer_bytes=_int(root, "stream_buffer_bytes", "", 1024 * 1024, minimum=0) or 0,
        tenant_stream_buffer_bytes=_int(root, "tenant_stream_buffer_bytes", "",
                                        16 * 1024 * 1024, minimum=0) or 0,
        lane_share_window_s=_duration(root, "lane_share_window", "", 30.0),
        repin_after_s=_duration(root, "repin_after", "", 0.0) or None,
        dispatch_order=_dispatch_order(root.get("dispatch_order", "vtc")),
        prompt_count=_prompt_count(root.get("prompt_count", "bound")),
        state=_state(root.get("state"), root.get("on_state_failure")),
        models=models,
        routing=_routing(root.get("routing", "pool")),
        pool_affinity=_int(root, "pool_affinity", "", 2, minimum=0) or 0,
        conversation_affinity=_int(root, "conversation_affinity", "", 8, minimum=0) or 0,
        locality=_locality(root.get("locality", "conversation")),
        metrics_idle_after_s=_duration(root, "metrics_idle_after", "", 900.0),
        max_tokenize_bytes=_int(root, "max_tokenize_bytes", "", 1024 * 1024,
                                minimum=1024) or 0,
        metrics_key_hashes=tuple(_keys(root.get("metrics_api_keys", []), "metrics_api_keys")),
        metrics_cache_s=_duration_or_off(root, "metrics_cache", 2.0),
        max_conversation_homes=_int(root, "max_conversation_homes", "", 100_000,
                                    minimum=1) or 0,
        max_conversation_homes_per_tenant=_int(root, "max_conversation_homes_per_tenant", "",
                                               10_000, minimum=1) or 0,
        discovery_interval_s=_duration(root, "discovery_interval", "", 10.0),
        reconcile_interval_s=_duration_or_off(root, "reconcile_interval", 60.0),
        reconcile_grace_s=_duration_or_off(root, "reconcile_grace", 30.0),
        batch=_batch(root.get("batch"), lanes, base_dir),
        source=source,
    )


def _batch(value: Any, lanes: tuple[LaneConfig, ...], base_dir: Path | None) -> BatchConfig:
    if value is None:
        return BatchConfig()
    m = _mapping(value, "batch")
    where = "batch"
    _known(m, where, ("lane", "cost", "max_file_bytes", "max_lines", "max_files",
                      "max_batches", "expire_after", "headroom", "concurrency", "store",
                      "max_stored_bytes", "max_uploads", "max_tenant_uploads",
                      "upload_memory", "max_output_bytes", "shutdown_wait"))
    lane = m.get("lane")
    if lane is not None and lane not in {x.name for x in lanes}:
        raise ConfigError(f"batch.lane: unknown lane {lane!r}; lanes are "
                          f"{', '.join(x.name for x in lanes)}")
    cost = _batch_cost(m, "batch", "cost")
    store = m.get("store")
    if store is not None:
        if not isinstance(store, str) or not store:
            raise ConfigError("batch.store: expected a URL such as 'sqlite:///batches.db' "
                              "or 'postgresql://...'")
        from ..ledger import LedgerError, parse_ledger_url, resolve_ledger_url

        try:
            parse_ledger_url(store)
        except LedgerError as exc:
            raise ConfigError(f"batch.store: {exc}") from None
        if base_dir is not None:
            store = resolve_ledger_url(store, base_dir)
    defaults = BatchConfig()
    max_file_bytes = _int(m, "max_file_bytes", where, defaults.max_file_bytes, minimum=1) or 0
    upload_memory = _int(m, "upload_memory", where, max(defaults.upload_memory,
                                                        max_file_bytes), minimum=1) or 0
    if upload_memory < max_file_bytes:
        raise ConfigError(f"batch.upload_memory: {upload_memory} is less than "
                          f"batch.max_file_bytes ({max_file_bytes}): a file of the largest "
                          "size allowed could never be uploaded")
    max_uploads = _int(m, "max_uploads", where, defaults.max_uploads, minimum=1) or 0
    return BatchConfig(
        lane=lane, cost=defaults.cost if cost is None else cost,
        max_file_bytes=max_file_bytes,
        max_stored_bytes=_int(m, "max_stored_bytes", where, defaults.max_stored_bytes,
                              minimum=1) or 0,
        max_uploads=max_uploads,
        max_tenant_uploads=_int(m, "max_tenant_uploads", where,
                                min(defaults.max_tenant_uploads, max_uploads), minimum=1) or 0,
        upload_memory=upload_memory,
        max_lines=_int(m, "max_lines", where, defaults.max_lines, minimum=1) or 0,
        max_files=_int(m, "max_files", where, defaults.max_files, minimum=1) or 0,
        max_batches=_int(m, "max_batches", where, defaults.max_batches, minimum=1) or 0,
        expire_after_s=_duration(m, "expire_after", where, defaults.expire_after_s),
        headroom=_int(m, "headroom", where, defaults.headroom, minimum=0) or 0,
        concurrency=_int(m, "concurrency", where, defaults.concurrency, minimum=1) or 0,
        store=store,
        max_output_bytes=_int(m, "max_output_bytes", where, defaults.max_output_bytes,
                              minimum=1024) or 0,
        shutdown_wait_s=_duration(m, "shutdown_wait", where, defaults.shutdown_wait_s))


def _locality(value: Any) -> str:
    if value not in ("conversation", "tenant"):
        raise ConfigError(f"locality: expected 'conversation' (each conversation on the engine "
                          f"that holds its prefix, within conversation_affinity of the least "
                          f"loaded) or "
                          f"'tenant' (a tenant's engine while it has room), got {value!r}")
    return str(value)


def _routing(value: Any) -> str:
    if value not in ROUTINGS:
        raise ConfigError(f"routing: expected 'pool' (one fair queue per model over its "
                          f"engines) or 'pinned' (each tenant on one engine), got {value!r}")
    return value


def _name_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
        raise ConfigError(f"{where}: expected a list of model names (non-empty strings)")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where}: the same name is listed twice")
    return tuple(value)


def _models(items: list[Any], engines: tuple[EngineConfig, ...]) -> tuple[ModelConfig, ...]:
    """The ``models`` section: per-model aliases and costs, names and aliases unique."""
    out: list[ModelConfig] = []
    taken: dict[str, str] = {}  # every name and alias -> where it was given
    for i, item in enumerate(items):
        where = f"models[{i}]"
        m = _mapping(item, where)
        _known(m, where, ("name", "aliases", "cost", "batch_cost"))
        name = m.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: required, the name the engines serve "
                              "(their --served-model-name)")
        aliases = _name_list(m.get("aliases", []), f"{where}.aliases")
        for label, value in ((f"{where}.name", name),
                             *((f"{where}.aliases", a) for a in aliases)):
            if value in taken:
                raise ConfigError(f"{label}: {value!r} is already given at {taken[value]}")
            taken[value] = label
        cost = _cost(m["cost"], f"{where}.cost") if m.get("cost") is not None else None
        out.append(ModelConfig(name, aliases, cost, _batch_cost(m, where)))
    served = {name for e in engines for name in e.models or ()}
    for model in out:
        for alias in model.aliases:
            if alias in served:
                raise ConfigError(f"models: alias {alias!r} of {model.name!r} is also a name an "
                                  "engine serves")
    return tuple(out)


def _known_models(models: tuple[ModelConfig, ...],
                  engines: tuple[EngineConfig, ...]) -> frozenset[str] | None:
    """Every served name, when all engines list theirs (None: some are learned at run time)."""
    if any(e.models is None for e in engines):
        return None
    return frozenset(name for e in engines for name in e.models or ())


# -- sections ----------------------------------------------------------------------


def _state(state: Any, on_failure: Any) -> StateConfig:
    try:
        return parse_state(state, on_failure)
    except StateConfigError as exc:
        raise ConfigError(str(exc)) from None


def _dispatch_order(value: Any) -> str:
    if value not in ("vtc", "fcfs"):
        raise ConfigError(f"dispatch_order: expected 'vtc' (weighted fair) or 'fcfs', got {value!r}")
    return value


def _prompt_count(value: Any) -> str:
    if value not in ("bound", "exact"):
        raise ConfigError(f"prompt_count: expected 'bound' (count with /tokenize only when the "
                          f"prompt's byte bound cannot decide) or 'exact', got {value!r}")
    return value


def _engine(value: Any, where: str) -> EngineConfig:
    if isinstance(value, str):
        value = {"url": value}
    m = _mapping(value, where)
    _known(m, where, ("url", "max_inflight", "scheduling_policy", "max_engine_waiting",
                      "max_kv_cache_usage", "max_num_seqs", "api_key", "api_key_env", "models",
                      "model_path", "drain", "discovery", "headers"))
    url = m.get("url")
    if not isinstance(url, str):
        raise ConfigError(f"{where}.url: required, e.g. 'http://127.0.0.1:8001'")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{where}.url: expected http(s)://host:port, got {url!r}")
    discovery = m.get("discovery")
    if discovery is not None and discovery != "dns":
        raise ConfigError(f"{where}.discovery: expected 'dns' (each address the url's host "
                          f"resolves to is an engine) or null, got {discovery!r}")
    if discovery and (parts.scheme != "http" or parts.path.strip("/")):
        raise ConfigError(f"{where}.discovery: needs a plain http://host:port url (engines "
                          "found by address are called by address, which a TLS certificate "
                          f"naming the host would not match), got {url!r}")
    policy = m.get("scheduling_policy", "fcfs")
    if policy not in SCHEDULING_POLICIES:
        raise ConfigError(
            f"{where}.scheduling_policy: expected one of {', '.join(SCHEDULING_POLICIES)} "
            f"(the engine's --scheduling-policy), got {policy!r}"
        )
    kv = m.get("max_kv_cache_usage", 0.95)
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, (int, float))
                           or not 0 < kv <= 1):
        raise ConfigError(f"{where}.max_kv_cache_usage: expected a fraction in (0, 1] or null, got {kv!r}")
    return EngineConfig(
        url=url.rstrip("/"),
        max_inflight=_int(m, "max_inflight", where, 64, minimum=1) or 64,
        scheduling_policy=policy,
        max_engine_waiting=_int(m, "max_engine_waiting", where, 4, minimum=0)
        if m.get("max_engine_waiting", 4) is not None else None,
        max_kv_cache_usage=None if kv is None else float(kv),
        api_key=_engine_key(m, where),
        max_num_seqs=_int(m, "max_num_seqs", where, None, minimum=1),
        models=_name_list(m["models"], f"{where}.models") if m.get("models") is not None
        else None,
        model_path=_model_path(m, where),
        drain=_bool(m, "drain", where, False),
        discovery=discovery,
        headers=_router_headers(m.get("headers"), f"{where}.headers"),
    )


ROUTER_HEADER_PLACEHOLDERS = ("tenant", "application", "lane", "model", "end_user")
"""What an ``engines[].headers`` template may name, in braces (``{{``/``}}``: a brace)."""
MAX_ROUTER_HEADERS = 32
_TCHAR = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
                   "ABCDEFGHIJKLMNOPQRSTUVWXYZ")  # RFC 9110's token characters
_OWN_HEADERS = {
    "host": "the gateway sets it from the engine's url",
    "content-length": "the gateway sets it from the body it sends",
    "content-type": "the gateway sends JSON",
    "transfer-encoding": "the gateway sends a content-length",
    "connection": "it is hop-by-hop; the gateway keeps its connections alive",
    "keep-alive": "it is hop-by-hop",
    "te": "it is hop-by-hop",
    "trailer": "it is hop-by-hop",
    "upgrade": "it is hop-by-hop",
    "expect": "the gateway sends the body at once and would wait for an interim answer",
    "authorization": "give the engine's key as api_key (or api_key_env)",
    "x-request-id": "the gateway sends its request id there",
}


def _router_headers(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    """``engines[].headers``: header name -> template, checked completely here so that
    rendering a request's values cannot fail (``engines.RouterHeaders`` compiles them)."""
    if value is None:
        return ()
    m = _mapping(value, where)
    if len(m) > MAX_ROUTER_HEADERS:
        raise ConfigError(f"{where}: at most {MAX_ROUTER_HEADERS} headers, got {len(m)}")
    out: dict[str, str] = {}
    for raw, template in m.items():
        if not isinstance(raw, str) or not raw or not set(raw) <= _TCHAR:
            raise ConfigError(f"{where}: {raw!r} is not a header name (letters, digits and "
                              "!#$%&'*+-.^_`|~ only)")
        name = raw.lower()
        key = f"{where}.{name}"
        why = _OWN_HEADERS.get(name) or ("it is hop-by-hop (proxy-*)"
                                        if name.startswith("proxy-") else None)
        if why is not None:
            raise ConfigError(f"{key}: not allowed ({why})")
        if name in out:
            raise ConfigError(f"{key}: given twice (header names are case-insensitive)")
        out[name] = _router_template(template, key)
    return tuple(out.items())


def _router_template(template: Any, where: str) -> str:
    if not isinstance(template, str):
        raise ConfigError(f"{where}: expected a string template such as \"{{tenant}}\", got "
                          f"{template!r} (quote it in YAML)")
    if not template:
        raise ConfigError(f"{where}: empty (a header without a value is never sent)")
    if not all(" " <= c <= "~" for c in template):
        raise ConfigError(f"{where}: printable ASCII only (no control characters, no "
                          f"non-ASCII), got {template!r}")
    if template != template.strip(" "):
        raise ConfigError(f"{where}: leading or trailing spaces are dropped by HTTP; got "
                          f"{template!r}")
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc} in {template!r} (write {{{{ or }}}} for a brace)") \
            from None
    for _, field_name, spec, conversion in parts:
        if field_name is None:
            continue
        if field_name not in ROUTER_HEADER_PLACEHOLDERS or spec or conversion:
            shown = "{" + field_name + (f"!{conversion}" if conversion else "") \
                + (f":{spec}" if spec else "") + "}"
            raise ConfigError(f"{where}: unknown placeholder {shown} in {template!r}; known: "
                              f"{', '.join('{' + p + '}' for p in ROUTER_HEADER_PLACEHOLDERS)}")
    return template


def _model_path(m: Mapping[str, Any], where: str) -> str | None:
    value = m.get("model_path")
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{where}.model_path: expected the model tokenpace up serves there "
                          "(a path or a hub name)")
    return value


def _engine_key(m: Mapping[str, Any], where: str) -> str | None:
    """``api_key`` as given, or read from the environment variable named by ``api_key_env``."""
    if "api_key" in m and "api_key_env" in m:
        raise ConfigError(f"{where}: give api_key or api_key_env, not both")
    if "api_key_env" in m:
        name = m["api_key_env"]
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.api_key_env: expected the name of an environment variable")
        key = os.environ.get(name)
        if not key:
            raise ConfigError(f"{where}.api_key_env: the environment variable {name} is not set "
                              "or empty")
        if key != key.strip() or not key.isprintable():
            raise ConfigError(f"{where}.api_key_env: the value of {name} has surrounding spaces "
                              "or control characters")
        return key
    key = m.get("api_key")
    if key is not None and (not isinstance(key, str) or not key or key != key.strip()
                            or not key.isprintable()):
        raise ConfigError(f"{where}.api_key: expected a non-empty string without surrounding "
                          "spaces or control characters (the engine's --api-key / VLLM_API_KEY)")
    return key


def keep_engine_keys(new: GatewayConfig, old: GatewayConfig) -> GatewayConfig:
    """``new`` with the running engines' keys where its file gives none (paired by url).

    Keys that ``tokenpace up`` generated live only in the running configuration; a key
    that the new file changes is refused (the engine would have to restart with it too).
    An engine the file adds brings its own key, or none.
    """
    running = {e.url: e for e in old.engines}
    engines = []
    for i, engine in enumerate(new.engines):
        before = running.get(engine.url)
        if before is not None:
            if engine.api_key is None:
                engine = dataclasses.replace(engine, api_key=before.api_key)
            elif engine.api_key != before.api_key:
                raise ConfigError(f"engines[{i}].api_key: changing an engine's key needs a "
                                  "restart")
        engines.append(engine)
    return dataclasses.replace(new, engines=tuple(engines))


def _lane(value: Any, where: str) -> LaneConfig:
    m = _mapping(value, where)
    _known(m, where, ("name", "priority", "min_share"))
    name = m.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: required, a non-empty string")
    priority = m.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigError(f"{where}.priority: expected an integer (lower runs first), got {priority!r}")
    share = m.get("min_share", 0.1)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise ConfigError(f"{where}.min_share: expected a fraction in [0, 1), got {share!r}")
    return LaneConfig(name, priority, float(share))


def _cost(value: Any, where: str = "cost") -> CostModel:
    if value is None:
        return CostModel()
    m = _mapping(value, where)
    _known(m, where, ("prompt", "cached_prompt", "completion"))
    try:
        # cached_prompt absent: the prompt coefficient (CostModel's default).
        return CostModel(m.get("prompt", 1.0), m.get("completion", 1.0), m.get("cached_prompt"))
    except ValueError as exc:
        raise ConfigError(str(exc).replace("cost.", f"{where}.", 1)) from None


def _tenant(value: Any, where: str, lanes: tuple[LaneConfig, ...],
            aliases: Mapping[str, str] | None = None,
            served: frozenset[str] | None = None) -> TenantConfig:
    m = _mapping(value, where)
    _known(m, where, ("id", "api_keys", "lane", "weight", "output_tokens_per_second",
                      "end_user_output_tokens_per_second",
                      "max_concurrency", "max_queued", "max_input_tokens", "max_output_tokens",
                      "queue_timeout", "budgets", "max_requests", "share_prefix_cache",
                      "models", "applications", "batch_cost"))
    tenant_id = m.get("id")
    try:
        validate_user_id(tenant_id, f"{where}.id")
    except LimitsError as exc:
        raise ConfigError(str(exc)) from None
    _no_control_characters(tenant_id, f"{where}.id")
    keys = tuple(_keys(m.get("api_keys"), f"{where}.api_keys"))
    applications = _applications(m, where)
    if not keys and not any(a.key_hashes for a in applications):
        raise ConfigError(f"{where}.api_keys: at least one key is needed (the tenant's own, "
                          "or its applications')")
    lane = m.get("lane", lanes[0].name)
    if lane not in {x.name for x in lanes}:
        raise ConfigError(
            f"{where}.lane: unknown lane {lane!r}; lanes are {', '.join(x.name for x in lanes)}"
        )
    return TenantConfig(
        id=tenant_id,
        key_hashes=keys,
        lane=lane,
        weight=_number(m, "weight", where) or 1.0,
        output_tokens_per_second=_number(m, "output_tokens_per_second", where),
        end_user_output_tokens_per_second=_number(m, "end_user_output_tokens_per_second", where),
        max_input_tokens=_int(m, "max_input_tokens", where, None, minimum=1),
        max_output_tokens=_int(m, "max_output_tokens", where, None, minimum=1),
        queue_timeout_s=_duration(m, "queue_timeout", where, 60.0),
        share_prefix_cache=_bool(m, "share_prefix_cache", where, False),
        models=_allowed_models(m, where, aliases or {}, served),
        applications=applications,
        batch_cost=_batch_cost(m, where),
        max_queued=_int(m, "max_queued", where, DEFAULT_MAX_QUEUED, minimum=0),
        **_limits(m, where),
    )


def _batch_cost(m: Mapping[str, Any], where: str, key: str = "batch_cost") -> float | None:
    """A factor on the model's cost for batch lines (``batch.cost``, a model's or a
    tenant's ``batch_cost``); None when absent."""
    value = m.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}.{key}: expected a number >= 0 (times the model's "
                          f"cost for batch lines; 0.5 halves it), got {value!r}")
    return float(value)


def _limits(m: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The limits a tenant and an application both have, as their configs' fields:
    concurrency, token budgets and request rates, each enforced or observed."""
    budgets = _budgets(m, where)
    max_requests = _request_limits(m, where)
    max_concurrency, observed_concurrency = _concurrency(m, where)
    return {
        "max_concurrency": max_concurrency,
        "observed_concurrency": observed_concurrency,
        "budgets": tuple(b for b in budgets if not b.observe),
        "observed_budgets": tuple(b for b in budgets if b.observe),
        "max_requests": tuple(r for r in max_requests if not r.observe),
        "observed_requests": tuple(r for r in max_requests if r.observe),
    }


def _applications(m: Mapping[str, Any], where: str) -> tuple[ApplicationConfig, ...]:
    """``applications: [{id, api_keys, weight, output_tokens_per_second,
    end_user_output_tokens_per_second, max_concurrency, budgets, max_requests}]``: ids
    unique inside the tenant."""
    out: list[ApplicationConfig] = []
    for i, item in enumerate(_list(m, "applications", where)):
        aw = f"{where}.applications[{i}]"
        am = _mapping(item, aw)
        _known(am, aw, ("id", "api_keys", "weight", "output_tokens_per_second",
                        "end_user_output_tokens_per_second", "max_concurrency", "budgets",
                        "max_requests"))
        app_id = am.get("id")
        if not isinstance(app_id, str) or not app_id:
            raise ConfigError(f"{aw}.id: required, a non-empty string")
        if len(app_id) > MAX_APPLICATION_ID_LENGTH:
            raise ConfigError(f"{aw}.id: is {len(app_id)} characters long; at most "
                              f"{MAX_APPLICATION_ID_LENGTH} are allowed")
        _no_control_characters(app_id, f"{aw}.id")
        if any(a.id == app_id for a in out):
            raise ConfigError(f"{aw}.id: application {app_id!r} is defined twice in the tenant")
        keys = tuple(_keys(am.get("api_keys"), f"{aw}.api_keys"))
        if not keys:
            raise ConfigError(f"{aw}.api_keys: at least one key is needed (a key names the "
                              "tenant and the application)")
        out.append(ApplicationConfig(
            id=app_id, key_hashes=keys, weight=_number(am, "weight", aw) or 1.0,
            output_tokens_per_second=_number(am, "output_tokens_per_second", aw),
            end_user_output_tokens_per_second=_number(
                am, "end_user_output_tokens_per_second", aw),
            **_limits(am, aw)))
    return tuple(out)


MAX_APPLICATION_ID_LENGTH = 128
"""An application id is a metric label and part of ledger rows and store keys."""


def _no_control_characters(value: str, where: str) -> None:
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ConfigError(f"{where}: must not contain control characters")


def _budgets(m: Mapping[str, Any], where: str) -> list[BudgetSpec]:
    """``budgets: [{tokens, per, mode}]``: token buckets, each listed once."""
    budgets = []
    for i, b in enumerate(_list(m, "budgets", where)):
        bw = f"{where}.budgets[{i}]"
        bm = _mapping(b, bw)
        _known(bm, bw, ("tokens", "per", "mode"))
        tokens = _number(bm, "tokens", bw, required=True)
        try:
            per = parse_duration(bm.get("per"))
        except ValueError as exc:
            raise ConfigError(f"{bw}.per: {exc}") from None
        assert tokens is not None
        budgets.append(BudgetSpec(tokens, per, _observe(bm, bw)))
    if len({b.key for b in budgets}) != len(budgets):
        raise ConfigError(f"{where}.budgets: the same budget is listed twice")
    return budgets


def _request_limits(m: Mapping[str, Any], where: str) -> tuple[RequestLimit, ...]:
    """``max_requests: [{requests: 600, per: 1m}, ...]``: whole requests per period."""
    limits = []
    for i, item in enumerate(_list(m, "max_requests", where)):
        lw = f"{where}.max_requests[{i}]"
        lm = _mapping(item, lw)
        _known(lm, lw, ("requests", "per", "mode"))
        requests = _int(lm, "requests", lw, None, minimum=1)
        if requests is None:
            raise ConfigError(f"{lw}.requests: required (a whole number of requests, >= 1)")
        try:
            per = parse_duration(lm.get("per"))
        except ValueError as exc:
            raise ConfigError(f"{lw}.per: {exc}") from None
        limits.append(RequestLimit(requests, per, _observe(lm, lw)))
    if len({x.key for x in limits}) != len(limits):
        raise ConfigError(f"{where}.max_requests: the same limit is listed twice")
    return tuple(limits)


def _observe(m: Mapping[str, Any], where: str) -> bool:
    """A limit's ``mode``: ``enforce`` (the default) or ``observe`` (True)."""
    mode = m.get("mode", "enforce")
    if mode not in ("enforce", "observe"):
        raise ConfigError(f"{where}.mode: expected 'enforce' (the default) or 'observe', "
                          f"got {mode!r}")
    return mode == "observe"


def _concurrency(m: Mapping[str, Any], where: str) -> tuple[int | None, int | None]:
    """``max_concurrency``: a number, or ``{limit: 8, mode: observe}``; (enforced, observed)."""
    value = m.get("max_concurrency")
    if not isinstance(value, Mapping):
        return _int(m, "max_concurrency", where, None, minimum=1), None
    cw = f"{where}.max_concurrency"
    _known(value, cw, ("limit", "mode"))
    limit = _int(value, "limit", cw, None, minimum=1)
    if limit is None:
        raise ConfigError(f"{cw}.limit: required (requests in flight at once, >= 1)")
    return (None, limit) if _observe(value, cw) else (limit, None)


def _allowed_models(m: Mapping[str, Any], where: str, aliases: Mapping[str, str],
                    served: frozenset[str] | None) -> frozenset[str] | None:
    """A tenant's ``models`` allow-list as served names; a name no engine serves is an
    error when every engine lists its models (a typo would lock the tenant out)."""
    if m.get("models") is None:
        return None
    names = _name_list(m["models"], f"{where}.models")
    if not names:
        raise ConfigError(f"{where}.models: at least one model; leave the key out to allow "
                          "every model")
    resolved = frozenset(aliases.get(name, name) for name in names)
    if served is not None:
        for name in names:
            if aliases.get(name, name) not in served:
                raise ConfigError(f"{where}.models: no engine serves {name!r}; served: "
                                  f"{', '.join(sorted(served))}")
    return resolved


# -- values ------------------------------------------------------------------------


def _path(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _known(m: Mapping[str, Any], where: str, keys: tuple[str, ...]) -> None:
    unknown = [k for k in m if k not in keys]
    if unknown:
        raise ConfigError(
            f"{_path(where, str(unknown[0]))}: unknown key; known keys here are {', '.join(keys)}"
        )


def _list(m: Mapping[str, Any], key: str, where: str = "", required: bool = False) -> list[Any]:
    if key not in m:
        if required:
            raise ConfigError(f"{_path(where, key)}: required")
        return []
    value = m[key]
    if not isinstance(value, list):
        raise ConfigError(f"{_path(where, key)}: expected a list, got {type(value).__name__}")
    return value


def _keys(value: Any, where: str) -> list[bytes]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list of keys")
    out = []
    for i, key in enumerate(value):
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{where}[{i}]: expected a non-empty string")
        if key.startswith("sha256:"):
            hexdigest = key[len("sha256:"):]
            try:
                digest = bytes.fromhex(hexdigest)
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise ConfigError(f"{where}[{i}]: 'sha256:' must be followed by 64 hex digits")
            out.append(digest)
        else:
            out.append(hash_key(key))
    return out


def _number(m: Mapping[str, Any], key: str, where: str, required: bool = False) -> float | None:
    if key not in m or m[key] is None:
        if required:
            raise ConfigError(f"{_path(where, key)}: required")
        return None
    value = m[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{_path(where, key)}: expected a number greater than 0, got {value!r}")
    return float(value)


def _bool(m: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = m.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{_path(where, key)}: expected true or false, got {value!r}")
    return value


def _ledger_journal(value: Any, ledger: str, base_dir: Path | None) -> str:
    """The journal directory: as given (relative to the configuration file), else beside
    a SQLite ledger, else ``tokenpace-journal`` beside the configuration file."""
    from ..ledger import default_journal

    if value is None:
        beside = default_journal(ledger)
        if beside is not None:
            return beside
        value = "tokenpace-journal"
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ConfigError(f"ledger_journal: expected a directory path, got {value!r}")
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return str(path.absolute())


def _int(m: Mapping[str, Any], key: str, where: str, default: int | None, minimum: int) -> int | None:
    if key not in m or m[key] is None:
        return default
    value = m[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{_path(where, key)}: expected an integer >= {minimum}, got {value!r}")
    return value


def _duration_or_off(m: Mapping[str, Any], key: str, default: float) -> float:
    """A top-level duration that may be 0 (a number, or ``"0"``): off, or no wait."""
    value = m.get(key)
    if (value == 0 and not isinstance(value, bool)) or value == "0":
        return 0.0
    return _duration(m, key, "", default)


def _duration(m: Mapping[str, Any], key: str, where: str, default: float) -> float:
    if key not in m or m[key] is None:
        return default
    value = m[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ConfigError(f"{_path(where, key)}: {exc}") from None
