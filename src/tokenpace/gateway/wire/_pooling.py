"""Reading the pooling routes' bodies (embeddings, rerank, score, pooling, classify).

A pooling request generates no tokens: it is charged its prompt tokens, as the engine
reports them in its answer's ``usage``. What admission needs from its body: the model,
how many inputs it holds (each is one engine request: ``max_prompts_per_request`` bounds
them), a lower bound of the text's size (cheap refusals), the inputs as token ids where
the client sent ids, else the ``/tokenize`` calls that count them as the engine will.

The shapes accepted are vLLM 0.32's (``vllm/entrypoints/pooling``):

- embeddings, pooling, classify: ``input`` (a string, a list of strings, a list of token
  ids or a list of such lists), or chat ``messages`` (one prompt);
- rerank: ``query`` and ``documents`` (one or a list), one pair per document;
- score: ``queries`` with ``documents`` or ``items``, ``data_1`` with ``data_2``, or
  ``text_1`` with ``text_2``: one pair per item of the longer side (a single query is
  paired with every document, two lists item by item).

Everything else is left for the engine to validate. An input that is not text (a
multimodal part) is counted on its JSON text, an over-count.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ._errors import GatewayError

POOLING_KINDS = frozenset(("embeddings", "rerank", "score", "pooling", "classify"))
"""The routes that generate no tokens (``wire.Kind``)."""

_PAIR_FIELDS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                ("text_1", "text_2"))
_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                "chat_template", "chat_template_kwargs")
BINARY_FORMATS = ("bytes", "bytes_only")
"""``encoding_format`` values vLLM answers in binary, with no JSON usage to charge."""


def pooling_inputs(kind: str, body: dict[str, Any], max_inputs: int) -> tuple[int, str]:
    """(the inputs, the field that holds them) of a pooling body, or a 400 naming the
    field: missing or malformed inputs, more than ``max_inputs`` of them, a binary
    ``encoding_format``. Cost: O(1) per field and one pass in C over an input list."""
    fmt = body.get("encoding_format")
    if fmt in BINARY_FORMATS:
        raise GatewayError(
            400, f"'encoding_format' {fmt!r} is not served by this gateway: a binary answer "
            "carries no usage to charge; use 'float' or 'base64'", reason="bad_request",
            code="unsupported_parameter", param="encoding_format")
    if kind == "rerank":
        if not _is_input(body.get("query")):
            raise _invalid("query", "'query' must be a non-empty string or a content object")
        inputs, field = _count_items(body.get("documents"), "documents"), "documents"
    elif kind == "score":
        pair = next(((a, b) for a, b in _PAIR_FIELDS if a in body and b in body), None)
        if pair is None:
            raise _invalid("queries", "a score request pairs 'queries' with 'documents' (or "
                           "'items'), 'data_1' with 'data_2' or 'text_1' with 'text_2'")
        left = _count_items(body[pair[0]], pair[0])
        right = _count_items(body[pair[1]], pair[1])
        if left != 1 and right != 1 and left != right:
            raise _invalid(pair[1], f"'{pair[0]}' has {left} items and '{pair[1]}' {right}: "
                           "lists are paired item by item (or one with each)")
        inputs, field = max(left, right), pair[1]
    elif "input" not in body and isinstance(body.get("messages"), list):
        if not body["messages"]:
            raise _invalid("messages", "'messages' must be a non-empty list")
        inputs, field = 1, "messages"
    else:
        inputs, field = _prompt_inputs(body.get("input")), "input"
    if inputs > max_inputs:
        raise GatewayError(
            400, f"'{field}' holds {inputs} inputs; at most {max_inputs} are allowed in one "
            "request (max_prompts_per_request): send the rest in other requests",
            reason="bad_request", code="invalid_value", param=field)
    return inputs, field


def _invalid(param: str, message: str) -> GatewayError:
    return GatewayError(400, message, reason="bad_request", code="invalid_value", param=param)


def _is_input(value: Any) -> bool:
    """A pair's side: a non-empty string, or a content object (multimodal)."""
    return (isinstance(value, str) and bool(value)) or (isinstance(value, dict) and bool(value))


def _count_items(value: Any, field: str) -> int:
    """One input or a non-empty list of them."""
    if _is_input(value):
        return 1
    if isinstance(value, list) and value and all(map(_is_input, value)):
        return len(value)
    raise _invalid(field, f"'{field}' must be a non-empty string or content object, or a "
                   "non-empty list of them")


def _prompt_inputs(value: Any) -> int:
    if isinstance(value, str) and value:
        return 1
    if _is_ids(value):
        return 1
    if isinstance(value, list) and value and (
            set(map(type, value)) == {str} or all(map(_is_ids, value))):
        return len(value)
    raise _invalid("input", "'input' must be a non-empty string, a list of token ids, or a "
                   "non-empty list of either")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and set(map(type, value)) == {int}


def pooling_token_ids(body: dict[str, Any]) -> list[list[int]] | None:
    """Each input's token ids when the client sent ids (``input`` only)."""
    value = body.get("input")
    if _is_ids(value):
        return [value]
    if isinstance(value, list) and value and all(map(_is_ids, value)):
        return value
    return None


def _pairs(kind: str, body: dict[str, Any]) -> list[tuple[Any, Any]]:
    """The (query, document) pairs of a rerank or score body already checked."""
    if kind == "rerank":
        docs = body["documents"]
        return [(body["query"], d) for d in (docs if isinstance(docs, list) else [docs])]
    a, b = next((a, b) for a, b in _PAIR_FIELDS if a in body and b in body)
    left = body[a] if isinstance(body[a], list) else [body[a]]
    right = body[b] if isinstance(body[b], list) else [body[b]]
    if len(left) == 1:
        return [(left[0], d) for d in right]
    if len(right) == 1:
        return [(q, right[0]) for q in left]
    return list(zip(left, right))


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return msgspec.json.encode(value).decode("utf-8")


def pooling_prompt_bytes(kind: str, body: dict[str, Any]) -> int:
    """A lower bound of the inputs' text size (characters; token ids are no text): a
    rerank or score query counts once per pair. One pass over the inputs."""
    if kind in ("rerank", "score"):
        return sum(len(q) * isinstance(q, str) + len(d) * isinstance(d, str)
                   for q, d in _pairs(kind, body))
    value = body.get("input")
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list) and value and set(map(type, value)) == {str}:
        return sum(map(len, value))
    if value is None and isinstance(body.get("messages"), list):
        return sum(len(m["content"]) for m in body["messages"]
                   if isinstance(m, dict) and isinstance(m.get("content"), str))
    return 0


def pooling_count_calls(kind: str, model: str,
                        body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The ``/tokenize`` calls that count a pooling body's prompts: one per input string,
    one for chat ``messages``, one per (query, document) pair (the two texts joined by a
    line break: a few tokens short of a cross-encoder's separators per pair, over an
    embedding model's count, which embeds a query once; the answer's usage settles the
    charge). Cost: one engine call per input, sent concurrently by admission."""
    special = body.get("add_special_tokens")
    extra = {} if special is None else {"add_special_tokens": special}
    if kind in ("rerank", "score"):
        return [("/tokenize", {"model": model, "prompt": f"{_text(q)}\n{_text(d)}", **extra})
                for q, d in _pairs(kind, body)]
    value = body.get("input")
    if value is None and isinstance(body.get("messages"), list):
        out = {"model": model, "messages": body["messages"]}
        for name in _CHAT_FIELDS:
            if body.get(name) is not None:
                out[name] = body[name]
        return [("/tokenize", out)]
    texts = [value] if isinstance(value, str) else value
    return [("/tokenize", {"model": model, "prompt": text, **extra}) for text in texts]


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_answer_decoder = msgspec.json.Decoder(_Answer)


def pooling_usage(content: bytes) -> int | None:
    """The prompt tokens a pooling answer's top-level ``usage`` reports (None: none).

    Cost: one pass in C over the answer that builds no object for anything but ``usage``
    (an embeddings answer of thousands of vectors is skipped, not parsed into floats).
    Raises ``ValueError`` for an answer that is not a JSON object."""
    try:
        answer = _answer_decoder.decode(content)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None
    return None if answer.usage is None else answer.usage.prompt_tokens


POOLING_PATHS: dict[str, str] = {"/v1/embeddings": "embeddings", "/v1/rerank": "rerank",
                                 "/rerank": "rerank", "/v2/rerank": "rerank",
                                 "/v1/score": "score", "/score": "score",
                                 "/pooling": "pooling", "/classify": "classify"}
"""The gateway's pooling paths (vLLM's) and the kind each runs as; a kind is sent to its
engine at ``wire.ROUTES``' path, which the ledger's rows name."""
