"""``GatewayConfig``: the whole file's value, and the lookups every request makes in it
(API key -> tenant and application, model alias -> served name, a model's cost), each a
dict lookup on tables built once per configuration.
"""

from __future__ import annotations

import functools
import hmac
from dataclasses import dataclass, field
from pathlib import Path

from ...fairness import CostModel
from ..state import StateConfig
from ._values import (
    AdapterConfig,
    ApplicationConfig,
    BatchConfig,
    EngineConfig,
    LaneConfig,
    ModelConfig,
    TenantConfig,
    hash_key,
)


DEFAULT_LEDGER = "sqlite:///tokenpace-usage.db"


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
    # Slow clients (docs/gateway/limits.md, "Slow clients and connections"): a request's headers
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
    # LoRA adapters (``adapter``): each served by its base's pool, loaded where it is sent.
    adapters: tuple[AdapterConfig, ...] = ()
    # An engine that holds a request's adapter keeps it while it has at most this many more
    # in flight than the least loaded engine of the pool; beyond, the adapter is loaded on
    # another (so a hot adapter spreads): a load costs a read of its weights and evicts
    # another adapter where the engine holds its ``max_adapters``.
    adapter_affinity: int = 4
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
    # Side routes, metrics and dispatch tables (docs/gateway/limits.md, "Limits that protect other
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

    def adapter(self, name: str) -> AdapterConfig | None:
        """The configured adapter named ``name`` (None: not one). A dict lookup."""
        return self._adapters.get(name)

    def cost_of(self, model: str) -> CostModel:
        """The cost coefficients of ``model`` (a served name or an adapter): its own, else
        (an adapter's) its base's, else the top-level."""
        adapter = self._adapters.get(model)
        if adapter is not None:
            if adapter.cost is not None:
                return adapter.cost
            model = adapter.base
        settings = self._model_settings.get(model)
        return settings.cost if settings is not None and settings.cost is not None else self.cost

    def aliases_of(self, model: str) -> tuple[str, ...]:
        settings = self._model_settings.get(model)
        return settings.aliases if settings is not None else ()

    @functools.cached_property
    def _aliases(self) -> dict[str, str]:
        return {alias: m.name for m in self.models for alias in m.aliases}

    @functools.cached_property
    def _adapters(self) -> dict[str, AdapterConfig]:
        return {a.name: a for a in self.adapters}

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

    def identity_for_digest(self, digest: bytes,
                            ) -> tuple[TenantConfig, ApplicationConfig | None] | None:
        """``identity_for_key`` of a key whose SHA-256 digest the caller computed (one
        dict lookup)."""
        return self._identity_by_digest.get(digest)

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
