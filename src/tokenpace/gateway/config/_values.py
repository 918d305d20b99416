"""The values a configuration entry becomes: engines, models, lanes, tenants and their
applications, the Batch API's bounds. Frozen dataclasses: a reload builds new ones and
swaps them, nothing changes one in place.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from dataclasses import dataclass, field

from ...fairness import BudgetSpec, CostModel, RequestLimit


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
    # The engine's last slots kept for tenants that hold fewer than this many requests on
    # it (``EngineSlots.admits``): a tenant with long requests cannot take every slot.
    # None: an eighth of its slots (none below 8); 0: none kept.
    reserved_slots: int | None = None
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
    # The LoRA adapters the gateway keeps loaded on it at once (``adapters``): set to the
    # engine's --max-loras, so every adapter it holds can run in one step. None: the
    # ``max_lora`` its /metrics reports, else 1 (vLLM's default).
    max_adapters: int | None = None

    def auth_headers(self) -> dict[str, str]:
        """Headers for every call to this engine."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class ModelConfig:
    """Settings of one model name the engines serve: other names clients may send for it,
    and its cost coefficients (a token's cost depends on the model and its hardware)."""

    name: str
    aliases: tuple[str, ...] = ()
    cost: CostModel | None = None  # None: the top-level cost
    batch_cost: float | None = None  # its batch lines' coefficient; None: ``batch.cost``


@dataclass(frozen=True)
class AdapterConfig:
    """A LoRA adapter over a base model: a model of its own for clients (allow-lists, cost,
    the ledger), served by the engines of its base's pool, which load it through vLLM's
    ``/v1/load_lora_adapter`` where the gateway places its requests."""

    name: str
    base: str  # the served name of the model it adapts
    path: str  # as the engines see it (what vLLM's /v1/load_lora_adapter loads)
    tenants: tuple[str, ...] | None = None  # None: any tenant that may use the name
    cost: CostModel | None = None  # None: its base's

    def serves(self, tenant_id: str) -> bool:
        return self.tenants is None or tenant_id in self.tenants


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


DEFAULT_MAX_BODY_BYTES_PER_SECOND = 1024 * 1024
"""The request-body bytes per second a configuration file's tenant may send when its entry
names no ``max_body_bytes_per_second`` (``tenants._body_rate``): what one tenant can make
the gateway and the engines parse per second, whatever tokens it asks for."""


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
    # Request-body bytes per second; a configuration file's tenant gets
    # DEFAULT_MAX_BODY_BYTES_PER_SECOND when it names none; None: no bound.
    max_body_bytes_per_second: int | None = None
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
    cost, and the bounds on what a tenant may store and run (docs/gateway/batch.md)."""

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


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
