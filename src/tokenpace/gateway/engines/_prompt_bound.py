"""An upper bound of a prompt's token count from its text: most requests need no /tokenize.

Why ``tokens <= bytes`` holds. Every token a tokenizer emits covers at least one byte of
the text it was given: byte-level BPE (GPT-2, Llama 3, Qwen, the tiny model) starts from
single bytes and only merges; SentencePiece with byte fallback (Llama 2, Mistral) emits at
most one token per byte of a character it has no piece for; a tokenizer without byte
fallback emits at most one unknown token per character. Two things add tokens the text's
bytes do not account for, and the bound adds them separately:

- what the tokenizer is given is not the text: the chat template wraps each message
  (special tokens, role headers, a default system prompt), ``add_special_tokens`` adds a
  BOS, SentencePiece prefixes a ``▁``. That overhead is learned once per engine and model
  by counting probe prompts with empty contents at the engine's ``/tokenize`` (at first use,
  then cached), plus a few tokens per message for how a content's first and last bytes can
  re-split the template text around them.
- a normalizer can lengthen the text before it is split. ASCII is unchanged by every
  Unicode normalization form, so an ASCII text (``str.isascii`` is O(1) in CPython) is
  bounded by its length. Other text is bounded by the longest UTF-8 form among the text,
  its NFC and its NFKC forms (NFC can triple a character's bytes, NFKC more: U+FDFA is 3
  bytes and 33 after NFKC).

Where the bound is not claimed, the exact count is taken as before: chat messages with
anything but text (images, tool calls), requests with ``tools``, ``documents`` or their own
chat template, or an engine and model whose probes failed. Every exact count the gateway
later sees (the engine's usage) is checked against the bound the request was admitted on;
a prompt that had more tokens turns the bound off for that engine and model (logged, and
counted in ``tokenpace_gateway_prompt_bound_violations_total``), so a tokenizer this
reasoning does not cover costs at most the requests in flight when it first shows.
``prompt_count: exact`` in gateway.yaml turns the bound off altogether.
"""

from __future__ import annotations

import asyncio
import logging
import math
import unicodedata
from dataclasses import dataclass, field
from typing import Any

import httpx

from .. import metrics
from ..wire import POOLING_KINDS, ParsedRequest

logger = logging.getLogger("tokenpace.gateway")

SLACK_PER_MESSAGE = 4
"""Tokens per chat message for the template text next to the content: joined with the
content's first or last bytes it may split into more tokens than it did around an empty
probe content (a template's separators there are 1 or 2 bytes)."""

MAX_LEARNED = 1024
"""Entries of (engine, model, kind) kept at most; see ``PromptBounds.remember``."""

SLACK_PROMPT = 1
"""SentencePiece's ``▁`` prefix can make a token of its own before a completion prompt."""

# Chat fields that change the rendering beyond the probes (tools, documents, another
# template or its arguments, another way to end the prompt): such a request is counted.
_UNBOUNDED_CHAT_FIELDS = ("tools", "documents", "chat_template", "chat_template_kwargs",
                          "continue_final_message", "add_special_tokens", "mm_processor_kwargs")
_MESSAGE_KEYS = frozenset(("role", "content", "name"))

# Probe conversations: one user message; user-assistant-user; system-user. A template that
# refuses one of the optional ones (Gemma refuses a system role) just does not use it.
_PROBE_ONE = [{"role": "user", "content": ""}]
_PROBE_TURNS = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""},
                {"role": "user", "content": ""}]
_PROBE_SYSTEM = [{"role": "system", "content": ""}, {"role": "user", "content": ""}]


def text_bytes(text: str) -> int:
    """An upper bound of the UTF-8 bytes any normalizer in use makes of ``text``.

    Cost: O(1) for ASCII (CPython keeps the flag); otherwise one UTF-8 encode and a
    quick-check of NFC and NFKC (a normalization only when the text is not in that form).
    """
    if text.isascii():
        return len(text)
    size = len(text.encode("utf-8", "surrogatepass"))
    for form in ("NFC", "NFKC"):
        if not unicodedata.is_normalized(form, text):
            size = max(size, len(unicodedata.normalize(form, text).encode("utf-8", "surrogatepass")))
    return size


@dataclass(frozen=True)
class Overhead:
    """What a template (or the special tokens) adds to a prompt's text, learned by probes."""

    fixed: int  # tokens of the smallest probe (one empty message, or the prompt "a" less 1)
    per_message: int  # tokens each further message adds (chat)
    max_model_len: int | None  # the engine's context size, from its /tokenize answer


@dataclass
class Learned:
    """One engine and model's overhead for one kind of request (None: no bound there)."""

    engine: str
    model: str
    kind: str
    overhead: Overhead | None
    trusted: bool = True  # False once a prompt had more tokens than its bound

    def violated(self, bound: int, exact: int) -> None:
        """An exact count above the bound: stop using the bound for this engine and model."""
        metrics.PROMPT_BOUND_VIOLATIONS.labels(self.engine).inc()  # rare: no cached child
        if self.trusted:
            self.trusted = False
            logger.warning(
                "a %s prompt for model %r on %s had %d tokens, more than its bound of %d: "
                "its tokenizer is not covered by the byte bound; prompts to it are now counted "
                "exactly with /tokenize (set prompt_count: exact to do so from the start)",
                self.kind, self.model, self.engine, exact, bound)


def bound(req: ParsedRequest, overhead: Overhead) -> int | None:
    """Tokens the engine can make of this prompt at most, or None when not claimed.

    Cost: one pass over the messages; ``text_bytes`` per string (O(1) for ASCII). The
    inputs of an embeddings, pooling or classify request are plain prompts (the
    completion probes' overhead, once per input); a rerank or score pair and chat
    ``messages`` of a pooling request are not claimed.
    """
    body = req.body
    if req.kind in POOLING_KINDS:
        value = body.get("input") if req.kind not in ("rerank", "score") else None
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not texts or set(map(type, texts)) != {str}:
            return None
        return sum(overhead.fixed + text_bytes(t) + SLACK_PROMPT for t in texts)
    if req.kind != "chat":
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = prompt[0] if len(prompt) == 1 else None
        if not isinstance(prompt, str):
            return None
        return overhead.fixed + text_bytes(prompt) + SLACK_PROMPT
    for name in _UNBOUNDED_CHAT_FIELDS:
        if body.get(name) is not None:
            return None
    messages = body["messages"]
    total = overhead.fixed + overhead.per_message * (len(messages) - 1)
    for message in messages:
        if not isinstance(message, dict) or not _MESSAGE_KEYS.issuperset(message):
            return None
        role, content, name = message.get("role"), message.get("content"), message.get("name")
        if not isinstance(role, str) or (name is not None and not isinstance(name, str)):
            return None
        # The role and name are part of the rendered text; the probes' own roles are
        # counted again here, a small over-estimate that covers roles the probes lack.
        total += text_bytes(role) + (text_bytes(name) if name else 0) + SLACK_PER_MESSAGE
        if isinstance(content, str):
            total += text_bytes(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str) or len(part) != 2:
                    return None  # an image, audio, a file: not text
                total += text_bytes(part["text"])
        elif content is not None:
            return None
    return total


@dataclass
class PromptBounds:
    """Learned overheads per (engine, model, kind); probes run once, concurrently awaited."""

    _learned: dict[tuple[str, str, str], Learned] = field(default_factory=dict)
    _probing: dict[tuple[str, str, str], asyncio.Future[Learned]] = field(default_factory=dict)

    async def learned(self, client: httpx.AsyncClient, engine: str, model: str, kind: str,
                      slots: asyncio.Semaphore | None = None) -> Learned | None:
        """The overhead of ``model`` on ``engine``: cached, else learned by probes (1 to 3
        /tokenize calls of a few bytes, once; requests arriving meanwhile wait for them),
        holding one of ``slots`` (the tenant's tokenize slots: probes for model names a
        tenant invents count against its own bound on counts in flight). None when the
        engine did not answer them: nothing is cached, the request is counted exactly, and
        the next one probes again."""
        key = (engine, model, kind)
        found = self._learned.get(key)
        if found is not None:
            return found
        pending = self._probing.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Learned | None] = asyncio.get_running_loop().create_future()
        self._probing[key] = future
        found = None
        try:
            if slots is None:
                overhead = await _probe(client, model, kind)
            else:
                async with slots:
                    overhead = await _probe(client, model, kind)
            found = self.remember(engine, model, kind, overhead)
        except ProbeUnreachable:
            pass
        finally:
            # Also when this request is cancelled mid-probe: the waiters count exactly.
            future.set_result(found)
            self._probing.pop(key, None)
        return found

    def remember(self, engine: str, model: str, kind: str, overhead: Overhead | None) -> Learned:
        """Keep ``overhead`` (None: no bound) for ``model`` on ``engine``.

        The model name comes from clients, and an engine refuses names it does not serve
        (kept as None, so they are not probed again): at ``MAX_LEARNED`` entries those are
        dropped, and if that is not enough everything is, so the cache stays bounded.
        """
        if len(self._learned) >= MAX_LEARNED:
            for key in [k for k, v in self._learned.items() if v.overhead is None]:
                del self._learned[key]
            if len(self._learned) >= MAX_LEARNED:
                self._learned.clear()
        found = self._learned[(engine, model, kind)] = Learned(engine, model, kind, overhead)
        return found

    def forget(self, engine: str) -> None:
        """The engine restarted (down, then up): it may serve another model or template."""
        for key in [k for k in self._learned if k[0] == engine]:
            del self._learned[key]


class ProbeUnreachable(Exception):
    """The engine did not answer a probe (or failed, 5xx): nothing learned, nothing cached."""


async def _probe(client: httpx.AsyncClient, model: str, kind: str) -> Overhead | None:
    """Count the probe prompts; None when the engine refuses the smallest one (the model
    has no chat template, say): such requests are counted exactly, as before."""
    if kind != "chat":
        answer = await _tokenize(client, {"model": model, "prompt": "a"})
        if answer is None:
            return None
        count, max_model_len = answer
        return Overhead(max(0, count - 1), 0, max_model_len)
    one = await _tokenize(client, {"model": model, "messages": _PROBE_ONE})
    turns = await _tokenize(client, {"model": model, "messages": _PROBE_TURNS})
    if one is None or turns is None:
        return None
    per_message = max(0, math.ceil((turns[0] - one[0]) / 2))
    system = await _tokenize(client, {"model": model, "messages": _PROBE_SYSTEM})
    if system is not None:
        per_message = max(per_message, system[0] - one[0])
    return Overhead(one[0], per_message, one[1])


async def _tokenize(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, int | None] | None:
    try:
        resp = await client.post("/tokenize", json=body, timeout=30.0)
    except httpx.HTTPError as exc:
        raise ProbeUnreachable(type(exc).__name__) from None
    if resp.status_code >= 500:
        raise ProbeUnreachable(f"status {resp.status_code}")
    if resp.status_code != 200:
        return None  # refused (a template that cannot render the probe): no bound
    try:
        data = resp.json()
        return int(data["count"]), data.get("max_model_len")
    except (ValueError, KeyError, TypeError):
        return None
