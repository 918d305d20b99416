"""Talking to the engines: the HTTP client, what each request tells its engine, and what the
gateway learns or controls per engine for its requests.

``Upstream``: one engine's connection pool for completions; ``background_client`` its
``httpx`` client for the other calls. ``EngineInstructions``: what the
gateway tells an engine about a request (identity at each level, rates, priority, cache
salt, served model, output limit), built by ``for_request`` and written by
``engine_body``. ``RateSplitter``: a paced tenant's rate split over the engines its streams
run on (its book local or in Redis, ``SharedSplitBook``). ``PromptBounds``: each engine's
chat-template overheads, learned to bound a prompt's tokens without ``/tokenize``.
``RouterHeaders``: the headers a router in front of engines (llm-d's inference gateway)
reads, rendered per request from an engine's ``headers`` templates. Which engines there are
and their standing is ``fleet``'s.
"""

from ._background import background_client
from ._instructions import EngineInstructions, engine_body, for_request, paces_end_users
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
    "background_client",
    "compile_router_headers",
    "ConnectFailed",
    "engine_body",
    "EngineInstructions",
    "for_request",
    "http_send",
    "Learned",
    "NewerVersion",
    "Overhead",
    "paces_end_users",
    "prompt_bound",
    "PromptBounds",
    "RateSplitter",
    "RouterHeaders",
    "SharedSplitBook",
    "split",
    "SplitFailed",
    "StaleConnection",
    "Upstream",
    "UpstreamError",
    "UpstreamResponse",
    "wire_safe",
]
