"""Which conversation a request continues: a key from the part of its prompt that every
turn of the conversation repeats.

A multi-turn client sends the whole conversation every turn, so an engine that served an
earlier turn holds most of the prompt in its prefix cache. The gateway sends a
conversation's turns to one engine by hashing this key to an engine (``dispatch``); the key
must therefore be the same for every turn of a conversation and differ between
conversations:

- chat completions and Anthropic messages: the messages up to and including the first
  user message (with Anthropic's ``system``): the system prompt and the opening question;
- Responses: ``instructions`` and the input items up to the first user item (a string
  input: its first ``OPENING_CHARS`` characters);
- completions: the first ``OPENING_CHARS`` characters of the prompt (the first
  ``OPENING_TOKENS`` token ids of a token prompt; a batch's first prompt): a plain prompt
  has no turn structure, and only a prefix no longer than the first turn is the same in
  every turn. Short, so that it is (a longer one changed between the first turns of a
  conversation whose opening was shorter, and sent them to different engines); the price:
  completions conversations that share their first 256 characters (a long common
  preamble) share a key, and an engine.

Conversations that share their opening (the same system prompt and first question) get the
same key and the same engine, which is also where their common prefix is cached. The key
includes the tenant (``salt``): the engines separate tenants' caches (``cache_salt``), so
two tenants' identical conversations share nothing on an engine.

Cost per request: serializing the opening (sorted keys, so a client that re-encodes its
messages keeps its key) and one BLAKE2b: 4.7, 7.6 and 17 us for openings of 0.1, 1 and
4 KB (timeit, this machine); the engine choice then hashes the key once per engine of the
pool (0.5 us each).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ._request import ParsedRequest

OPENING_CHARS = 256
OPENING_TOKENS = 64


def conversation_key(req: ParsedRequest, salt: str) -> bytes | None:
    """A 16-byte key of the conversation ``req`` continues; None when the body has no
    prompt to key on (the engine choice then falls back to load)."""
    body = req.body
    opening: Any
    if req.kind == "chat":
        opening = _through_first_user(body.get("messages"))
    elif req.kind == "messages":
        opening = [body.get("system"), _through_first_user(body.get("messages"))]
    elif req.kind == "responses":
        items = body.get("input")
        opening = [body.get("instructions"), items[:OPENING_CHARS] if isinstance(items, str)
                   else _through_first_user(items)]
    else:
        opening = _prompt_opening(body.get("prompt"))
    if opening is None or opening == [None, None]:
        return None
    try:
        text = json.dumps(opening, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    data = f"{len(salt)}:{salt}\n{text}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16, person=b"tokenpace-conv").digest()


def _through_first_user(items: Any) -> list[Any] | None:
    if not isinstance(items, list) or not items:
        return None
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("role") == "user":
            return items[:i + 1]
    return items[:1]


def _prompt_opening(prompt: Any) -> Any:
    if isinstance(prompt, str):
        return prompt[:OPENING_CHARS]
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return prompt[:OPENING_TOKENS]
        return _prompt_opening(first)
    return None
