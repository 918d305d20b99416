"""What each ended request was prompted with and generated: asked by a gateway.

A gateway meters each request from the usage the engine reports, but a request can end
without that usage reaching the gateway: the client left, the gateway's time for it ran
out, a non-streamed answer never arrived, the gateway itself restarted. vLLM aborts such a
request when its connection goes, and only the engine knows what it had generated. The
scheduler keeps, for its last ended requests (finished, by a stop or ``max_tokens``, or
aborted), the prompt and output token counts, and ``POST /tokenpace/v1/aborted`` answers
them (the path names its first use: aborted requests; finished ones are answered too):

    {"request_ids": ["chatcmpl-tpg-1f...", "resp_tpg-1f..._0", "resp_tpg-1f..._1"]}
    ->  {"output_tokens": {"chatcmpl-tpg-1f...": 37, "resp_tpg-1f..._0": 12},
         "prompt_tokens": {"chatcmpl-tpg-1f...": 21, "resp_tpg-1f..._0": 9},
         "running": ["resp_tpg-1f..._1"]}

``running`` lists the ids asked for that the scheduler still holds (not ended yet: ask
again). An id in none of the three is unknown here: not arrived yet, never sent, or ended
so long ago that it was forgotten (``KEEP``).

A caller may add ``"exchange": "<x-request-id>"``, the request's id as it sent it in that
header; the answer then says ``"exchange_ended": true`` when this API server's HTTP
exchange of that request had ended (answered, or the connection closed) before the
scheduler was asked. The scheduler takes requests and these questions from the API
server in order, so an exchange that ended with none of its ids known to the scheduler
never reached it: the engine generated nothing for it (the client left while the API
server was still reading or rendering it). With several API servers
(``--api-server-count``) the one asked may not be the one that served it: false.

Ids are the API server's: vLLM appends ``-`` and 8 random characters to the id of each
request it sends to the engine (and a request with ``n`` > 1 becomes ``n`` requests named
``{i}_`` and that id); both forms are answered, with and without the random part.

The same book lists its entries in the order they ended, with each request's pacing
user and end time, for a gateway reconciling its ledger (``GET /tokenpace/v1/ended``,
``_ended``).

The route is served by ``RequestGuard`` behind the engine's key when it has one
(``EngineAuth``): counts are all it tells, of requests whose ids the caller must know. The
call reaches the scheduler as rate control does (``_control``): a utility call that runs
in the engine process between two steps, on every data-parallel rank, answers merged.
Cost of one call in the engine loop: two dict lookups per id asked.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from ._asgi import Receive, Scope, Send, error_payload, send_json
from ._control import install_utility

ABORTED_PATH = "/tokenpace/v1/aborted"
UTILITY_METHOD = "tokenpace_aborted_outputs"
KEEP = 65_536
"""Ended requests remembered, oldest forgotten first: minutes of requests at hundreds
per second (every request that ends is kept, not only aborted ones), far longer than a
gateway takes to ask, restarts included. Each costs two dict entries (the id with and
without vLLM's random part), one shared pair of counts and its place in the ring of ended
requests in order (``_ended``): about 420 bytes, some 27 MB when full (the ring's part:
about 110 bytes a request, 7 MB)."""
MAX_IDS_PER_CALL = 1024
MAX_BODY_BYTES = 1 << 20
EXCHANGE_HEADER = b"x-request-id"


class EndedExchanges:
    """The ``x-request-id`` of the last ``keep`` POST exchanges this API server ended, and
    of those under way (``RequestGuard`` calls ``begin`` and ``end`` around each one that
    carries the header, however it ends). An id is ended while no exchange of it is under
    way (a caller that sent one id twice, the second still being read, is not told the
    first one ended). Cost per exchange: two dict updates, an ordered-dict insert and a
    pop once full; memory about 100 bytes per ended one."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._open: dict[str, int] = {}

    def begin(self, exchange: str) -> None:
        self._open[exchange] = self._open.get(exchange, 0) + 1

    def end(self, exchange: str) -> None:
        left = self._open.pop(exchange, 1) - 1
        if left > 0:
            self._open[exchange] = left
        self._ended[exchange] = None
        self._ended.move_to_end(exchange)
        if len(self._ended) > self.keep:
            self._ended.popitem(last=False)

    def __contains__(self, exchange: object) -> bool:
        return exchange in self._ended and exchange not in self._open


ENDED_EXCHANGES = EndedExchanges()
"""This API server process's ended exchanges (one per process: the guard and the route
run in it)."""


def exchange_of(scope: Scope) -> str | None:
    """The request's ``x-request-id`` header, if it has one (a gateway sends its id)."""
    for name, value in scope.get("headers", ()):
        if name == EXCHANGE_HEADER:
            return value.decode("latin-1")
    return None


def _api_id(request_id: str) -> str | None:
    """The API server's id of an engine request: its id without vLLM's ``-`` and random
    part (None when it has no ``-``: ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``)."""
    base, dash, _ = request_id.rpartition("-")
    return base if dash and base else None


Ended = tuple[str, str, int, int, float]
"""One ended request as the book lists it: (the engine's request id, its pacing user or
``""``, prompt tokens, output tokens, when it ended in unix seconds)."""


class EndedRequests:
    """The prompt and output token counts of the last ``keep`` requests that ended, by
    request id; which requests are still held, by the API server's id; and the same
    ``keep`` requests in the order they ended, numbered, with their pacing user and end
    time, for a gateway that reconciles its ledger (``ENDED_PATH``, ``since``).

    The scheduler calls ``started`` once per new request and ``ended`` once per request
    that ends (``_scheduler``). Memory: ``keep`` ended requests (``KEEP``) in the dicts and
    as many in the ring of the order they ended in, plus one dict entry per request in the
    scheduler.

    Numbering: each book has an id of its own (``book``, random: a restarted engine or
    another data-parallel rank has another), and numbers its entries 0, 1, 2, ... in the
    order they ended; the ring keeps the last ``keep``.
    """

    def __init__(self, keep: int = KEEP, clock: Callable[[], float] = time.time) -> None:
        self._counts: OrderedDict[str, tuple[int, int]] = OrderedDict()  # (prompt, output)
        self._keep = 2 * keep
        self._live: dict[str, int] = {}  # API server's id -> requests held under it
        self.book = secrets.token_hex(8)
        self._clock = clock
        self._size = keep
        self._ring: list[Ended] = []  # entry n at n % keep once full
        self._next = 0  # the number the next ended request gets

    def started(self, request_id: str) -> None:
        """A new request entered the scheduler. Cost: one ``rpartition`` and one dict
        update."""
        key = _api_id(request_id)
        if key is not None:
            live = self._live
            live[key] = live.get(key, 0) + 1

    def ended(self, request: Any, user: str = "") -> None:
        """Keep the request's ``num_prompt_tokens`` and ``num_output_tokens`` under its id
        and under the API server's id, and append it, with ``user`` (its pacing user) and
        the time, to the ring. Cost per ended request: one ``rpartition``, two dict
        inserts, one dict update, (once the book is full) two evictions, one clock read,
        one tuple and one list store."""
        counts = self._counts
        request_id = request.request_id
        pair = (request.num_prompt_tokens, request.num_output_tokens)
        counts[request_id] = pair
        entry = (request_id, user, pair[0], pair[1], self._clock())
        ring, n = self._ring, self._next
        if n < self._size:
            ring.append(entry)
        else:
            ring[n % self._size] = entry
        self._next = n + 1
        key = _api_id(request_id)
        if key is not None:
            counts[key] = pair
            live = self._live
            held = live.get(key, 0)
            if held > 1:
                live[key] = held - 1
            else:
                live.pop(key, None)
        while len(counts) > self._keep:
            counts.popitem(last=False)

    def lookup(self, request_ids: Iterable[str]) -> dict[str, tuple[int, int]]:
        """(prompt tokens, output tokens) of each ended request among ``request_ids``."""
        counts = self._counts
        return {r: counts[r] for r in request_ids if r in counts}

    def running(self, request_ids: Iterable[str]) -> list[str]:
        """The ids among ``request_ids`` (API server's ids) of requests still held."""
        live = self._live
        return [r for r in request_ids if r in live]

    @property
    def oldest(self) -> int:
        """The number of the oldest entry kept (the next one's when the book is empty)."""
        return max(0, self._next - self._size)

    def since(self, after: int | None, limit: int) -> tuple[int, list[Ended]]:
        """At most ``limit`` entries numbered after ``after`` (None: from the oldest kept),
        oldest first, and the number of the entry they follow (their first's minus one;
        with none, where the next read starts). Entries forgotten since (beyond ``keep``)
        are skipped: the entries then follow a number above ``after``. An ``after`` beyond
        the last number given is not this book's: answered from the oldest.
        Cost: O(entries returned)."""
        oldest, end = self.oldest, self._next
        start = oldest if after is None or after >= end else max(after + 1, oldest)
        stop = min(end, start + max(0, limit))
        ring, size = self._ring, self._size
        return start - 1, [ring[n % size] for n in range(start, stop)]


def parse_ids(body: Any) -> list[str]:
    ids = body.get("request_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise ValueError('expected {"request_ids": ["...", ...]} with at least one id')
    if len(ids) > MAX_IDS_PER_CALL:
        raise ValueError(f"at most {MAX_IDS_PER_CALL} ids per call")
    return ids


# -- the engine process -------------------------------------------------------------------


def tokenpace_aborted_outputs(core: Any, request_ids: Any) -> dict[str, Any]:
    """Runs in the engine process (as ``EngineCoreProc.tokenpace_aborted_outputs``): the
    route's answer for this rank, or ``{"error": ..., "status": ...}``."""
    scheduler = core.scheduler
    book = getattr(scheduler, "ended_requests", None)
    if book is None:
        return {"error": "this engine does not run tokenpace's scheduler", "status": 404}
    try:
        ids = parse_ids({"request_ids": request_ids})
    except ValueError as exc:
        return {"error": str(exc), "status": 400}
    found = book.lookup(ids)
    missing = [r for r in ids if r not in found]
    live = set(book.running(missing))
    held = getattr(scheduler, "requests", {})  # by the engine's own id (no random part)
    return {"output_tokens": {r: output for r, (_, output) in found.items()},
            "prompt_tokens": {r: prompt for r, (prompt, _) in found.items()},
            "running": [r for r in missing if r in live or r in held]}


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
        parsed = json.loads(b"".join(body))
        ids = parse_ids(parsed)
        exchange = parsed.get("exchange")
        if exchange is not None and not isinstance(exchange, str):
            raise ValueError('"exchange" is the request\'s x-request-id, a string')
    except (ValueError, RecursionError) as exc:
        await refuse(400, str(exc) if not isinstance(exc, json.JSONDecodeError)
                     else "the body is not JSON", "BadRequestError")
        return
    state = getattr(scope.get("app"), "state", None)
    client = getattr(getattr(state, "engine_client", None), "engine_core", None)
    if client is None:
        await refuse(503, "the engine is not running", "ServiceUnavailable")
        return
    # Read before the scheduler is asked (see the module: the order is what makes it exact).
    ended = exchange is not None and exchange in ENDED_EXCHANGES
    # One answer per data-parallel rank (the request ran on one of them), merged.
    every = getattr(client, "call_utility_all_async", None)
    results = (await every(UTILITY_METHOD, ids) if every is not None
               else [await client.call_utility_async(UTILITY_METHOD, ids)])
    output: dict[str, int] = {}
    prompt: dict[str, int] = {}
    running: set[str] = set()
    for result in results:
        if "error" in result:
            await refuse(int(result.get("status", 500)), result["error"], "NotFoundError")
            return
        output.update(result["output_tokens"])
        prompt.update(result.get("prompt_tokens", {}))
        running.update(result.get("running", ()))
    # A request ended on one rank is not running on another: ended wins.
    answer: dict[str, Any] = {"output_tokens": output, "prompt_tokens": prompt,
                              "running": [r for r in ids if r in running and r not in output]}
    if exchange is not None:
        answer["exchange_ended"] = ended
    await send_json(send, 200, answer)
