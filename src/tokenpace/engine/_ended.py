"""Every request the engine ended, in order: what a gateway reconciles its ledger with.

The book of ended requests (``_aborted``) also lists its last ``KEEP`` entries in the
order they ended, each with its pacing user and end time. ``GET /tokenpace/v1/ended``
answers them a page at a time:

    GET /tokenpace/v1/ended?after=3f9c0e1a2b4d6f80:41&limit=2
    ->  {"requests": [{"book": "3f9c0e1a2b4d6f80", "seq": 42,
                       "request_id": "chatcmpl-tpg-1f...", "user": "team-a",
                       "prompt_tokens": 21, "output_tokens": 37, "ended_at": 1765000000.5},
                      ...],
         "next": "3f9c0e1a2b4d6f80:43",
         "oldest": {"3f9c0e1a2b4d6f80": 0}}

Oldest first, at most ``limit`` (default ``DEFAULT_LIMIT``, at most ``MAX_LIMIT``).
``request_id`` is the API server's id (vLLM's ``-`` and random part taken off, as
``/tokenpace/v1/aborted`` answers), ``user`` the request's pacing user as the scheduler
resolved it (``vllm_xargs.output_rate_user``; with pacing off the one the request names;
``""`` without one), ``ended_at`` the engine's wall clock when the request ended.

The cursor. Each book (one per data-parallel rank, and a new one when the engine restarts)
has a random id and numbers its entries from 0; a cursor names, per book, the last entry
read: ``<book>:<seq>`` joined by ``,``. ``after`` takes the ``next`` of the last answer
(omitted: from the oldest entry of every book). A book the cursor does not name is read
from its oldest entry (a restarted engine's book, a rank seen for the first time); a book
the cursor names that is not in ``oldest`` is gone (its engine restarted: what it ended
after the cursor is lost). ``oldest`` gives each book's oldest entry kept: above the
cursor's entry + 1, entries were forgotten before they were read (more than ``KEEP``
ended in between).

With data parallelism every rank is asked, each answers up to ``limit`` entries of its
own book, and the answers are merged by end time and cut to ``limit``; ``next`` moves
each book's cursor to its last entry returned. Served by ``RequestGuard``, behind
``EngineAuth`` when it is installed; the answer names every user and request, so an
engine with an API key (``--api-key``, ``VLLM_API_KEY``) requires it here even without
``EngineAuth``.

Cost of one call: in the engine loop (a utility call between two steps), one tuple per
entry returned; in the API server, the merge and the JSON (``MAX_LIMIT``); nothing per
step, and per request only the book's own (``_aborted``: a clock read and a list store
more than before the ring).
"""

from __future__ import annotations

import heapq
import re
from typing import Any
from urllib.parse import parse_qs

from ._aborted import _api_id
from ._asgi import Receive, Scope, Send, send_error, send_json
from ._auth import carries_key, keys_of
from ._control import install_utility

ENDED_PATH = "/tokenpace/v1/ended"
UTILITY_METHOD = "tokenpace_ended_requests"
DEFAULT_LIMIT = 1_000
MAX_LIMIT = 10_000
"""Entries per answer at most: about 2 MB of JSON. Each entry costs the engine loop one
tuple, and the API server's event loop (whose other requests wait meanwhile) about 3 us
to merge and write: a few milliseconds for a page of ``DEFAULT_LIMIT``, the size a
gateway reads, some 30 ms for one of ``MAX_LIMIT``."""
MAX_BOOKS = 256
"""Books a cursor may name (one per data-parallel rank)."""

_BOOK = re.compile(r"[0-9a-f]{1,32}")

Cursor = dict[str, int]
"""Book id -> the number of the last entry read in it."""


def parse_cursor(text: str) -> Cursor:
    """``<book>:<seq>,...`` -> ``{book: seq}``; ``""``: no cursor. ``ValueError`` when
    malformed."""
    cursor: Cursor = {}
    if not text:
        return cursor
    parts = text.split(",")
    if len(parts) > MAX_BOOKS:
        raise ValueError(f"after: at most {MAX_BOOKS} books")
    for part in parts:
        book, colon, seq = part.partition(":")
        if not colon or not _BOOK.fullmatch(book) or not seq.lstrip("-").isdigit() \
                or len(seq) > 20 or int(seq) < -1:
            raise ValueError(f"after: expected <book>:<seq>,... as the last answer's next, "
                             f"got {part[:80]!r}")
        cursor[book] = int(seq)
    return cursor


def format_cursor(cursor: Cursor) -> str:
    return ",".join(f"{book}:{seq}" for book, seq in sorted(cursor.items()))


def parse_query(query_string: bytes) -> tuple[Cursor, int]:
    """(cursor, limit) of the route's query string; ``ValueError`` when malformed."""
    try:
        query = parse_qs(query_string.decode("ascii"), keep_blank_values=True,
                         strict_parsing=False, max_num_fields=4)
    except (UnicodeDecodeError, ValueError):
        raise ValueError("the query string is malformed") from None
    unknown = set(query) - {"after", "limit"}
    if unknown:
        raise ValueError(f"unknown parameter {sorted(unknown)[0]!r}: expected after, limit")
    if any(len(values) > 1 for values in query.values()):
        raise ValueError("each parameter at most once")
    cursor = parse_cursor(query.get("after", [""])[0])
    text = query.get("limit", [str(DEFAULT_LIMIT)])[0]
    if not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
        raise ValueError(f"limit: expected an integer from 1 to {MAX_LIMIT}, got {text[:20]!r}")
    return cursor, int(text)


# -- the engine process -------------------------------------------------------------------


def tokenpace_ended_requests(core: Any, query: Any) -> dict[str, Any]:
    """Runs in the engine process (as ``EngineCoreProc.tokenpace_ended_requests``), with
    ``query`` ``{"after": cursor, "limit": n}`` (one argument: vLLM checks a utility's
    arguments against its method's signature, ``*args`` counting as one): this rank's
    entries after the cursor's entry of its book, at most ``limit``, as
    ``{"book", "after" (the number of the entry they follow), "oldest", "requests":
    [[seq, request id, user, prompt, output, ended_at], ...]}``, or ``{"error": ...,
    "status": ...}``."""
    book = getattr(core.scheduler, "ended_requests", None)
    if book is None:
        return {"error": "this engine does not run tokenpace's scheduler", "status": 404}
    cursor = query.get("after") if isinstance(query, dict) else None
    limit = query.get("limit") if isinstance(query, dict) else None
    if not isinstance(cursor, dict) or not isinstance(limit, int) \
            or not 1 <= limit <= MAX_LIMIT:
        return {"error": "expected a cursor and a limit", "status": 400}
    after = cursor.get(book.book)
    start, entries = book.since(after if isinstance(after, int) else None, limit)
    return {"book": book.book, "oldest": book.oldest, "after": start,
            "requests": [[seq, _api_id(rid) or rid, user, prompt, output, ended_at]
                         for seq, (rid, user, prompt, output, ended_at)
                         in enumerate(entries, start + 1)]}


def install_ended_requests(engine_core_proc_cls: type) -> bool:
    """Add ``tokenpace_ended_requests`` to vLLM's engine-core class (once); True if added."""
    return install_utility(engine_core_proc_cls, UTILITY_METHOD, tokenpace_ended_requests)


def merge(results: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """The route's answer from the ranks' answers: entries merged by end time (each book's
    in its own order), the first ``limit`` kept, each book's cursor at its last one kept.
    O(entries) plus a heap of one item per rank."""
    per_book = [[{"book": r["book"], "seq": seq, "request_id": rid, "user": user,
                  "prompt_tokens": prompt, "output_tokens": output, "ended_at": ended_at}
                 for seq, rid, user, prompt, output, ended_at in r["requests"]]
                for r in results]
    merged = list(heapq.merge(*per_book, key=lambda e: e["ended_at"]))[:limit]
    cursor: Cursor = {r["book"]: r["after"] for r in results}
    for entry in merged:
        cursor[entry["book"]] = entry["seq"]
    return {"requests": merged, "next": format_cursor(cursor),
            "oldest": {r["book"]: r["oldest"] for r in results}}


# -- the API server ------------------------------------------------------------------------


async def handle_ended(scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /tokenpace/v1/ended`` (any other method: 405)."""

    if scope.get("method") != "GET":
        await send_error(send, 405, "use GET", "MethodNotAllowed")
        return
    keys = keys_of(scope)
    if keys and not carries_key(scope, keys):
        await send_error(send, 401, "send the engine's API key as 'Authorization: Bearer "
                         "<key>'", "AuthenticationError")
        return
    try:
        cursor, limit = parse_query(scope.get("query_string", b""))
    except ValueError as exc:
        await send_error(send, 400, str(exc), "BadRequestError")
        return
    state = getattr(scope.get("app"), "state", None)
    client = getattr(getattr(state, "engine_client", None), "engine_core", None)
    if client is None:
        await send_error(send, 503, "the engine is not running", "ServiceUnavailable")
        return
    every = getattr(client, "call_utility_all_async", None)
    query = {"after": cursor, "limit": limit}
    results = (await every(UTILITY_METHOD, query) if every is not None
               else [await client.call_utility_async(UTILITY_METHOD, query)])
    for result in results:
        if "error" in result:
            await send_error(send, int(result.get("status", 500)), result["error"],
                             "NotFoundError")
            return
    await send_json(send, 200, merge(results, limit))
