"""What every request handler shares, in one value that a reload replaces piecemeal."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from ..config import GatewayConfig
from ..dispatch import Dispatcher
from ..engines import PromptBounds, RateSplitter, Upstream
from ..ledger import Ledger
from ..registry import KeyTable
from ..state import StateStore
from ..tenants import Tenants


@dataclass
class Runtime:
    """What every request handler shares; replaced piecemeal by a reload."""

    config: GatewayConfig
    tenants: Tenants
    dispatcher: Dispatcher
    clients: dict[str, httpx.AsyncClient]  # background calls: /tokenize, /health, gauges
    ledger: Ledger
    upstreams: dict[str, Upstream] = field(default_factory=dict)  # the hot path: completions
    clock: Callable[[], float] = time.monotonic
    # Budgets shared with other replicas (state: redis://...); None: in this process.
    store: StateStore | None = None
    # Settlements sent to the store in the background (finish is synchronous).
    settling: set[asyncio.Task[None]] = field(default_factory=set)
    # Template overheads learned per engine and model (prompt_count: bound).
    prompt_bounds: PromptBounds = field(default_factory=PromptBounds)
    # Paced tenants' rates split over the engines their streams run on (set at start-up;
    # its book is in the shared store with several replicas).
    rate_split: RateSplitter | None = None
    # Tenant id -> the bytes of streamed answers kept for its slow readers (``relay``'s
    # ``ClientPipe``); a tenant with none has no entry.
    backlogs: dict[str, int] = field(default_factory=dict)
    # Keys made through the admin API (``registry``), asked when a key is not the file's;
    # None: the admin store is not open (yet).
    keys: KeyTable | None = None
