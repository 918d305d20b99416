"""Reading an engine's book of ended requests (``GET /tokenpace/v1/ended``), page by page.

Each call reads from a cursor (``engine.parse_cursor``: per book, the last entry read)
to the end of the book as it is then, a page of ``PAGE`` entries a call, and says what it
could not see: entries the engine forgot before they were read (more than its 65,536
ended in between), a book that is gone (the engine restarted, or a data-parallel rank
with it), an engine that is not tokenpace's (plain vLLM: 404) or does not answer.

Cost: one call per ``PAGE`` entries, at most ``MAX_PAGES`` per read (the rest waits for
the next read); in the engine, one tuple per entry (``engine._ended``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from ...engine import ENDED_PATH, format_cursor, parse_cursor
from ._compare import EngineEntry

PAGE = 1_000
"""Entries asked per call: the engine's default page (a few milliseconds of its API
server's event loop)."""
MAX_PAGES = 100
"""Calls per read at most: an engine that ends requests faster than they are read is read
on at the next one."""
TIMEOUT_S = 30.0

Cursor = dict[str, int]


@dataclass
class BookRead:
    """What one read of one engine's book found."""

    engine: str
    entries: list[EngineEntry] = field(default_factory=list)
    cursor: Cursor = field(default_factory=dict)  # where the next read starts
    problem: str | None = None  # why the book could not be read (entries: none)
    forgotten: int = 0  # entries the engine forgot after the cursor, before this read
    gone: int = 0  # books of the cursor no longer there (the engine restarted)
    complete: bool = True  # read to the end (False: MAX_PAGES reached)
    oldest: dict[str, int] = field(default_factory=dict)  # per book, its oldest entry kept

    @property
    def full(self) -> bool:
        """Whether some book has forgotten entries (older requests are not in it)."""
        return any(seq > 0 for seq in self.oldest.values())


def _entries(engine: str, body: Any) -> tuple[list[EngineEntry], Cursor, dict[str, int]]:
    """A page's entries, next cursor and oldest entries; ``ValueError`` when malformed."""
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    items, oldest = body.get("requests"), body.get("oldest")
    if not isinstance(items, list) or not isinstance(oldest, dict):
        raise ValueError("no requests or oldest")
    cursor = parse_cursor(str(body.get("next", "")))
    entries = []
    for item in items:
        try:
            entries.append(EngineEntry(engine, str(item["request_id"]), str(item["user"]),
                                       int(item["prompt_tokens"]), int(item["output_tokens"]),
                                       float(item["ended_at"])))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"malformed entry {str(item)[:200]}") from None
    return entries, cursor, {str(k): int(v) for k, v in oldest.items()}


async def read_book(client: httpx.AsyncClient, engine: str, cursor: Cursor | None, *,
                    page: int = PAGE, max_pages: int = MAX_PAGES) -> BookRead:
    """Read ``engine``'s book after ``cursor`` (None: from its oldest entry) through
    ``client`` (its base url the engine's, its headers the engine's key). Never raises
    for the engine: a book that cannot be read is a ``problem``."""
    read = BookRead(engine, cursor=dict(cursor or {}))
    for number in range(max_pages):
        params: dict[str, Any] = {"limit": page}
        if read.cursor:
            params["after"] = format_cursor(read.cursor)
        try:
            resp = await client.get(ENDED_PATH, params=params, timeout=TIMEOUT_S)
        except httpx.HTTPError as exc:
            read.problem = f"no answer: {str(exc) or type(exc).__name__}"[:300]
            return read
        if resp.status_code == 404:
            read.problem = "not tokenpace's engine (404: plain vLLM keeps no book)"
            return read
        if resp.status_code != 200:
            read.problem = f"answered {resp.status_code}: {resp.text[:200]}"
            return read
        try:
            entries, after, oldest = _entries(engine, resp.json())
        except ValueError as exc:
            read.problem = f"malformed answer: {exc}"
            return read
        if number == 0 and cursor:
            for book, seq in cursor.items():
                if book not in oldest:
                    read.gone += 1
                elif oldest[book] > seq + 1:
                    read.forgotten += oldest[book] - seq - 1
        read.entries.extend(entries)
        read.cursor, read.oldest = after, oldest
        if len(entries) < page:
            return read
    read.complete = False
    return read
