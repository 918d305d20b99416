"""A request body parsed where it holds the fewest other requests.

A small body is parsed on the event loop: a thread hand-off would cost more than the parse.
A large one (over ``LARGE_BODY_BYTES``) is parsed in a worker thread, one at a time per
tenant: the JSON parser itself is one C call that holds the interpreter (other requests
wait for it), but the walk for lone surrogates and the request's checks run as Python and
yield to the event loop every few milliseconds, and a tenant's large bodies queue behind
each other, not beside everyone's. Cost per large body: a thread hand-off (tens of
microseconds) and one lock per tenant while it parses.
"""

from __future__ import annotations

import asyncio

from ..wire import Kind, ParsedRequest, parse_json_body, parse_request

LARGE_BODY_BYTES = 256 * 1024
"""Bodies larger than this are parsed in a worker thread (an ordinary chat request is a
few kB; a long-context prompt or an image hundreds of kB and more)."""

_parsing: dict[str, asyncio.Lock] = {}
"""The lock of each tenant with a large body being parsed or waiting (removed when free)."""


async def parse_body(tenant: str, kind: Kind, raw: bytes, *, max_model_chars: int,
                     max_prompts: int) -> ParsedRequest:
    """``raw`` parsed and checked (``wire.parse_json_body``, ``wire.parse_request`` with
    the limits given): on the event loop when small, else in a worker thread, one body at
    a time per ``tenant``. Raises what they raise (``GatewayError``)."""
    if len(raw) <= LARGE_BODY_BYTES:
        return parse_request(kind, parse_json_body(raw), max_model_chars, max_prompts)
    lock = _parsing.get(tenant)
    if lock is None:
        lock = _parsing[tenant] = asyncio.Lock()
    try:
        async with lock:
            return await asyncio.to_thread(
                lambda: parse_request(kind, parse_json_body(raw), max_model_chars, max_prompts))
    finally:
        if not lock.locked() and _parsing.get(tenant) is lock:
            del _parsing[tenant]
