"""How many tokens an aborted request had generated: asked by a gateway after a client left.

Chat and completion streams tell the gateway their token count in every chunk; the
Responses and Messages APIs only at their end. When a client leaves such a stream, the
gateway closes its engine connection, vLLM aborts the request, and only the engine knows
how many tokens it generated. The scheduler keeps that count for its last aborted
requests, and ``POST /tokenpace/v1/aborted`` answers it:

    {"request_ids": ["resp_tpg-1f..._0"]}  ->  {"output_tokens": {"resp_tpg-1f..._0": 37}}

An id the engine has not aborted (yet, or ever, or so long ago that it was forgotten) is
left out of the answer; the gateway asks again for a moment, then falls back to its own
lower bound. Ids are the API server's (vLLM appends ``-`` and 8 random characters to the id
of each request it sends to the engine; both forms are answered).

The route is served by ``RequestGuard`` behind the engine's key when it has one
(``EngineAuth``): a count is all it tells, of a request whose id the caller must know. The
call reaches the scheduler as rate control does (``_control``): a utility call that runs
in the engine process between two steps, on every data-parallel rank, answers merged.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from ._asgi import Receive, Scope, Send, error_payload, send_json
from ._control import install_utility

ABORTED_PATH = "/tokenpace/v1/aborted"
UTILITY_METHOD = "tokenpace_aborted_outputs"
KEEP = 65_536
"""Aborted requests remembered (two dict entries each, ~200 bytes): minutes of aborts at
hundreds per second, far longer than a gateway takes to ask."""
MAX_IDS_PER_CALL = 1024
MAX_BODY_BYTES = 1 << 20


class AbortedOutputs:
    """Output token counts of the last ``keep`` aborted requests, by request id."""

    def __init__(self, keep: int = KEEP) -> None:
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._keep = 2 * keep

    def record(self, requests: Iterable[Any]) -> None:
        """Remember each request's ``num_output_tokens`` under its id, and under the id
        without vLLM's random suffix (what the API server and the gateway know).
        Cost per aborted request: two dict inserts."""
        counts = self._counts
        for request in requests:
            request_id, tokens = request.request_id, request.num_output_tokens
            counts[request_id] = tokens
            base, dash, _ = request_id.rpartition("-")
            if dash and base:
                counts[base] = tokens
        while len(counts) > self._keep:
            counts.popitem(last=False)

    def lookup(self, request_ids: Iterable[str]) -> dict[str, int]:
        counts = self._counts
        return {r: counts[r] for r in request_ids if r in counts}


def parse_ids(body: Any) -> list[str]:
    ids = body.get("request_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise ValueError('expected {"request_ids": ["...", ...]} with at least one id')
    if len(ids) > MAX_IDS_PER_CALL:
        raise ValueError(f"at most {MAX_IDS_PER_CALL} ids per call")
    return ids


# -- the engine process -------------------------------------------------------------------


def tokenpace_aborted_outputs(core: Any, request_ids: Any) -> dict[str, Any]:
    """Runs in the engine process (as ``EngineCoreProc.tokenpace_aborted_outputs``)."""
    book = getattr(core.scheduler, "aborted_outputs", None)
    if book is None:
        return {"error": "this engine does not run tokenpace's scheduler", "status": 404}
    try:
        return {"output_tokens": book.lookup(parse_ids({"request_ids": request_ids}))}
    except ValueError as exc:
        return {"error": str(exc), "status": 400}


def install_aborted_outputs(engine_core_proc_cls: type) -> bool:
    """Add ``tokenpace_aborted_outputs`` to vLLM's engine-core class (once); True if added."""
    return install_utility(engine_core_proc_cls, UTILITY_METHOD, tokenpace_aborted_outputs)


# -- the API server ------------------------------------------------------------------------


async def handle_aborted(scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /tokenpace/v1/aborted`` (any other method: 405)."""

    async def refuse(status: int, message: str, kind: str) -> None:
        await send_json(send, status, error_payload(status, message, kind, "request_ids"))

    if scope.get("method") != "POST":
        await refuse(405, "use POST", "MethodNotAllowed")
        return
    body, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        body.append(message.get("body", b""))
        size += len(body[-1])
        if size > MAX_BODY_BYTES:
            await refuse(400, f"the body exceeds {MAX_BODY_BYTES} bytes", "BadRequestError")
            return
        if not message.get("more_body", False):
            break
    try:
        ids = parse_ids(json.loads(b"".join(body)))
    except (ValueError, RecursionError) as exc:
        await refuse(400, str(exc) if not isinstance(exc, json.JSONDecodeError)
                     else "the body is not JSON", "BadRequestError")
        return
    state = getattr(scope.get("app"), "state", None)
    client = getattr(getattr(state, "engine_client", None), "engine_core", None)
    if client is None:
        await refuse(503, "the engine is not running", "ServiceUnavailable")
        return
    # One answer per data-parallel rank (the request ran on one of them), merged.
    every = getattr(client, "call_utility_all_async", None)
    results = (await every(UTILITY_METHOD, ids) if every is not None
               else [await client.call_utility_async(UTILITY_METHOD, ids)])
    merged: dict[str, int] = {}
    for result in results:
        if "error" in result:
            await refuse(int(result.get("status", 500)), result["error"], "NotFoundError")
            return
        merged.update(result["output_tokens"])
    await send_json(send, 200, {"output_tokens": merged})
