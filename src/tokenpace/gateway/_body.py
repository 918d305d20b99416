"""Reading and rewriting OpenAI request bodies: what admission needs, what the engine gets.

Only the fields the gateway must understand are checked here (token limits, ``n``,
streaming options, the prompt's shape); everything else is left for the engine to
validate, so the gateway never refuses a request vLLM would accept for a reason of its own
making.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from ..engine import RATE_EXTRA_ARG, RATE_VERSION_EXTRA_ARG, USER_EXTRA_ARG
from ._errors import GatewayError

Kind = Literal["chat", "completion"]

# Fields of a chat request that change how the engine renders the prompt: the token count
# request must carry them too, or the count would differ from the engine's.
_CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                         "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")


@dataclass
class ParsedRequest:
    kind: Kind
    body: dict[str, Any]
    model: str
    stream: bool
    client_wants_usage: bool
    client_wants_continuous_usage: bool
    n: int
    max_tokens: int | None
    max_tokens_field: str


# A lone surrogate can only enter a parsed body through a ``\uD800``-``\uDFFF`` escape or
# through the UTF-8-style bytes of one (``json.loads`` decodes bytes with "surrogatepass").
# Valid pairs (emoji) match too; they only cost the walk that tells them apart. Bodies in
# UTF-16 or UTF-32 (which ``json.loads`` also takes) have a NUL byte in their first four
# bytes and are always walked.
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


_suspect = [False]
"""Set by the decoder's hooks while one body is parsed (parsing never yields to the loop)."""


def _constant(name: str) -> float:
    _suspect[0] = True
    return float(name)


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        _suspect[0] = True
    return value


_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_number)
"""Made once: ``json.loads`` with hooks builds a decoder and its scanner on every call."""


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 naming what the engine could not take.

    Python's JSON parser (and vLLM's, which is the same) accepts ``NaN``, ``Infinity``,
    numbers that overflow to infinity and lone UTF-16 surrogates. None of these is JSON
    text an OpenAI client can mean. vLLM 0.32 refuses a surrogate (its tokenizer raises)
    and a non-finite sampling parameter, but renders ``NaN`` in ``chat_template_kwargs``
    into the prompt; the gateway's own upstream encoder cannot send either. They are
    refused here with the field's path, before any work. Cost: the parse, one
    regular-expression scan of the raw bytes, plus a walk of the parsed body only when the
    scan or the parser saw a suspect value.
    """
    _suspect[0] = False
    try:
        body = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except (ValueError, RecursionError) as exc:
        raise GatewayError(400, f"the request body is not valid JSON: {exc}", reason="bad_request",
                           code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object", reason="bad_request",
                           code="invalid_json")
    if _suspect[0] or b"\x00" in raw[:4] or _MAY_HOLD_SURROGATE.search(raw):
        _refuse_unencodable(body)
    return body


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _refuse_unencodable(body: dict[str, Any]) -> None:
    """Raise a 400 naming the first lone surrogate or non-finite number in ``body``.

    Iterative, so a body nested as deep as the parser allows cannot exhaust the stack.
    """
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _has_lone_surrogate(value):
                raise GatewayError(
                    400, f"'{path}' holds a lone UTF-16 surrogate, which is not Unicode text; "
                    "send valid UTF-8 (a surrogate pair written as two escapes is fine)",
                    reason="bad_request", code="invalid_unicode", param=path)
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise GatewayError(
                    400, f"'{path}' is {value!r}: JSON has no NaN or Infinity, and the engine "
                    "cannot take a non-finite number", reason="bad_request",
                    code="invalid_number", param=path)
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                child = f"{path}.{key}" if path else str(key)
                if _has_lone_surrogate(key):
                    raise GatewayError(
                        400, f"a key in '{path or 'the body'}' holds a lone UTF-16 surrogate, "
                        "which is not Unicode text", reason="bad_request",
                        code="invalid_unicode", param=path or None)
                stack.append((child, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))


def parse_request(kind: Kind, body: dict[str, Any]) -> ParsedRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "'model' is required (a string)", reason="bad_request",
                           code="invalid_value", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise GatewayError(400, "'stream' must be true or false", reason="bad_request",
                           code="invalid_value", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise GatewayError(400, "'stream_options' must be an object", reason="bad_request",
                           code="invalid_value", param="stream_options")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise GatewayError(400, "'n' must be an integer >= 1", reason="bad_request",
                           code="invalid_value", param="n")
    field = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        field = "max_completion_tokens"
    max_tokens = body.get(field)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise GatewayError(400, f"'{field}' must be an integer >= 1", reason="bad_request",
                           code="invalid_value", param=field)
    if kind == "chat":
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise GatewayError(400, "'messages' must be a non-empty list", reason="bad_request",
                               code="invalid_value", param="messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or _is_token_ids(prompt)):
            raise GatewayError(
                400, "'prompt' must be one string or one list of token ids; the gateway "
                "does not take batched prompts (send one request per prompt)",
                reason="bad_request", code="invalid_value", param="prompt")
    return ParsedRequest(
        kind=kind, body=body, model=model, stream=stream,
        client_wants_usage=bool(options.get("include_usage")),
        client_wants_continuous_usage=bool(options.get("continuous_usage_stats")),
        n=n, max_tokens=max_tokens, max_tokens_field=field,
    )


def prompt_token_ids(req: ParsedRequest) -> list[int] | None:
    """The prompt's token ids when the client sent ids (no tokenizer call needed)."""
    if req.kind != "completion":
        return None
    prompt = req.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    return prompt if _is_token_ids(prompt) else None


def tokenize_body(req: ParsedRequest) -> dict[str, Any]:
    """The engine ``/tokenize`` request that counts this prompt as the engine will."""
    body = req.body
    if req.kind == "chat":
        out = {"model": req.model, "messages": body["messages"]}
        for name in _CHAT_TEMPLATE_FIELDS:
            if body.get(name) is not None:
                out[name] = body[name]
        return out
    prompt = body["prompt"]
    if isinstance(prompt, list):
        prompt = prompt[0]
    out = {"model": req.model, "prompt": prompt}
    if body.get("add_special_tokens") is not None:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


def engine_body(req: ParsedRequest, *, user: str, rate: float | None, priority: int,
                max_tokens: int, cache_salt: str | None = None,
                model: str | None = None, rate_version: int | None = None) -> bytes:
    """The body sent upstream: the client's, with identity, priority and limits overwritten.

    Whatever a client put in ``vllm_xargs.output_rate_user``, ``priority`` or the rate
    field is replaced, so no client can borrow another tenant's quota or lane. With a
    tenant's ``cache_salt`` the prompt's cached blocks are the tenant's alone: a client's
    own salt (a string) is mixed into it, so it can split its tenant's cache further but
    never reach another tenant's. ``model``: the served name, when the client sent an alias.
    ``rate_version``: the version of a rate split over engines (``_rate_split``).
    """
    body = dict(req.body)
    if model is not None:
        body["model"] = model
    if cache_salt is not None:
        own = body.get("cache_salt")
        if isinstance(own, str) and own:
            cache_salt = hashlib.sha256(f"{cache_salt}\0{own}".encode("utf-8")).hexdigest()
        body["cache_salt"] = cache_salt
    xargs = body.get("vllm_xargs")
    xargs = dict(xargs) if isinstance(xargs, dict) else {}
    xargs[USER_EXTRA_ARG] = user
    if rate is not None:
        xargs[RATE_EXTRA_ARG] = rate
    else:
        xargs.pop(RATE_EXTRA_ARG, None)
    if rate is not None and rate_version is not None:
        xargs[RATE_VERSION_EXTRA_ARG] = rate_version
    else:
        xargs.pop(RATE_VERSION_EXTRA_ARG, None)
    body["vllm_xargs"] = xargs
    body["priority"] = priority
    body[req.max_tokens_field] = max_tokens
    if req.stream:
        # Usage in every chunk: the gateway then knows how many tokens were generated at
        # any moment, also when the client or the engine goes away mid-stream.
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return json.dumps(body).encode()


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)
