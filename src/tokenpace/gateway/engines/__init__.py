"""Talking to the engines: the HTTP client, what each request tells its engine, and what the
gateway learns or controls per engine.

``Upstream``: one engine's connection pool for completions. ``EngineInstructions``: what the
gateway tells an engine about a request (identity at each level, rates, priority, cache
salt, served model, output limit), built by ``for_request`` and written by
``engine_body``. ``RateSplitter``: a paced tenant's rate split over the engines its streams
run on (its book local or in Redis, ``SharedSplitBook``). ``PromptBounds``: each engine's
chat-template overheads, learned to bound a prompt's tokens without ``/tokenize``. The
engine's scheduling policy as its ``/health`` reports it. ``Discovery``: engines named by DNS
(``engines[].discovery: dns``), one per address. ``RouterHeaders``: the headers a router in
front of engines (llm-d's inference gateway) reads, rendered per request from an engine's
``headers`` templates.
"""

from ._discovery import Discovery, Resolve, engine_at, resolve_addresses
from ._instructions import EngineInstructions, engine_body, for_request, paces_end_users
from ._policy import UNKNOWN, policy_problem, reported_policy
from ._prompt_bound import Learned, Overhead, PromptBounds, bound as prompt_bound
from ._router_headers import RouterHeaders, compile_router_headers, wire_safe
from ._rate_split import NewerVersion, RateSplitter, SplitFailed, http_send, split
from ._shared_split import SharedSplitBook
from ._upstream import (
    ConnectFailed,
    Response as UpstreamResponse,
    StaleConnection,
    Upstream,
    UpstreamError,
)

__all__ = [
    "compile_router_headers",
    "ConnectFailed",
    "Discovery",
    "engine_at",
    "engine_body",
    "EngineInstructions",
    "for_request",
    "http_send",
    "Learned",
    "NewerVersion",
    "Overhead",
    "paces_end_users",
    "policy_problem",
    "prompt_bound",
    "PromptBounds",
    "RateSplitter",
    "reported_policy",
    "RouterHeaders",
    "Resolve",
    "resolve_addresses",
    "SharedSplitBook",
    "split",
    "SplitFailed",
    "StaleConnection",
    "UNKNOWN",
    "Upstream",
    "UpstreamError",
    "UpstreamResponse",
    "wire_safe",
]
