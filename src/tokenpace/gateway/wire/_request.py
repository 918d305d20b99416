"""Reading request bodies (OpenAI chat, completions, Responses; Anthropic Messages): what admission needs.

Only the fields the gateway must understand are checked here (token limits, ``n``,
streaming options, the prompt's shape); everything else is left for the engine to
validate, so the gateway never refuses a request vLLM would accept for a reason of its own
making.
"""

from __future__ import annotations

import gc
import json
import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from ...pacing import LimitsError, validate_user_id
from ._clip import clip
from ._errors import GatewayError
from ._pooling import (
    POOLING_KINDS,
    pooling_count_calls,
    pooling_inputs,
    pooling_token_ids,
)

Kind = Literal["chat", "completion", "responses", "messages",
               "embeddings", "rerank", "score", "pooling", "classify"]
"""The proxied routes: the generation routes ``/v1/chat/completions``,
``/v1/completions``, ``/v1/responses`` (OpenAI's Responses API) and ``/v1/messages``
(Anthropic's Messages API); the pooling routes (``POOLING_KINDS``), which generate no
tokens: ``/v1/embeddings``, rerank, score, ``/pooling`` and ``/classify``."""

ROUTES: dict[str, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions",
                          "responses": "/v1/responses", "messages": "/v1/messages",
                          "embeddings": "/v1/embeddings", "rerank": "/rerank",
                          "score": "/score", "pooling": "/pooling", "classify": "/classify"}
"""Each kind's path at the engine (and in the ledger's rows); the gateway serves it there
too, and rerank and score at vLLM's other paths for them (``server``)."""

MAX_TOKENS_FIELD: dict[str, str] = {"chat": "max_tokens", "completion": "max_tokens",
                                    "responses": "max_output_tokens", "messages": "max_tokens"}
"""Each API's own name for the output limit (chat also takes ``max_completion_tokens``);
the pooling routes have none."""

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
    prompts: int = 1
    """Completion prompts in the request (a batch), a pooling request's inputs; 1 for
    every other kind."""
    prompt_field: str = ""
    """The body field that holds the prompt, where it is not the kind's usual one (a
    pooling request's inputs)."""

    @property
    def sequences(self) -> int:
        """Outputs the engine generates, each up to ``max_tokens``: ``n`` per prompt."""
        return self.n * self.prompts

    @property
    def prompt_param(self) -> str:
        """The body field that holds the prompt, for an error's ``param``."""
        return self.prompt_field or _PROMPT_FIELD[self.kind]


_PROMPT_FIELD: dict[str, str] = {"chat": "messages", "completion": "prompt",
                                 "responses": "input", "messages": "messages"}


# A lone surrogate can only enter a parsed body through a ``\uD800``-``\uDFFF`` escape or
# through the UTF-8-style bytes of one (``json.loads`` decodes bytes with "surrogatepass").
# Valid pairs (emoji) match too; they only cost the walk that tells them apart. Bodies in
# UTF-16 or UTF-32 (which ``json.loads`` also takes) have a NUL byte in their first four
# bytes and are always walked.
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


class _Parsing(threading.local):
    """Each thread's decoder, and the flag its hooks set while it parses one body (a
    large body is parsed in a worker thread while the event loop parses small ones).
    The decoder is made once per thread: ``json.loads`` with hooks would build one and
    its scanner on every call."""

    def __init__(self) -> None:
        self.seen = False
        self.decoder = json.JSONDecoder(parse_constant=_constant, parse_float=_number)


def _constant(name: str) -> float:
    _suspect.seen = True
    return float(name)


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        _suspect.seen = True
    return value


_suspect = _Parsing()


STRICT_FALLBACK_BYTES = 256 * 1024
"""A body the strict parser refuses is parsed again by Python's, to name the bad value
(or to take a UTF-16 body or a byte-order mark), only up to this size."""


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 naming what the engine could not take.

    Python's JSON parser (and vLLM's, which is the same) accepts ``NaN``, ``Infinity``,
    numbers that overflow to infinity and lone UTF-16 surrogates. None of these is JSON
    text an OpenAI client can mean. vLLM 0.32 refuses a surrogate (its tokenizer raises)
    and a non-finite sampling parameter, but renders ``NaN`` in ``chat_template_kwargs``
    into the prompt; the gateway's own upstream encoder cannot send either. They are
    refused here, before any work.

    Cost bound, linear in the body's size: one strict UTF-8 JSON parse in C (msgspec),
    which refuses each of those values itself, with cyclic collection paused. It holds
    the interpreter for its whole length, about a fifth of the time Python's parser takes
    for the same body. A body it refuses is parsed again by Python's parser only up to
    ``STRICT_FALLBACK_BYTES`` (``_parse_python``: the 400 then names the bad value's
    path); a larger one is refused with the strict parser's reason. Memory: the parsed
    body itself. Thread-safe.
    """
    collecting = gc.isenabled()
    # A parse makes no cyclic garbage, but its new lists would set off collections that
    # walk them all, several times over (most of the cost of a body of small lists).
    gc.disable()
    try:
        body = _strict_decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        if len(raw) > STRICT_FALLBACK_BYTES:
            raise GatewayError(400, f"the request body is not valid JSON (UTF-8, finite "
                               f"numbers, no lone surrogates): {exc}", reason="bad_request",
                               code="invalid_json") from None
        body = None
    finally:
        if collecting:
            gc.enable()
    if body is None:
        return _parse_python(raw)
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object", reason="bad_request",
                           code="invalid_json")
    return body


_strict_decode = msgspec.json.Decoder().decode


def _parse_python(raw: bytes) -> dict[str, Any]:
    """``parse_json_body`` with Python's parser, for a small body the strict one refused:
    the 400 names the first lone surrogate or non-finite number by its path. Cost: the
    parse, one regular-expression scan of the raw bytes and, only when the scan or the
    parser saw a suspect value (any escaped emoji), one walk of the parsed body that
    visits each value once and allocates nothing per value (``_first_unencodable``)."""
    _suspect.seen = False
    collecting = gc.isenabled()
    gc.disable()
    try:
        body = _suspect.decoder.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except (ValueError, RecursionError) as exc:
        raise GatewayError(400, f"the request body is not valid JSON: {exc}", reason="bad_request",
                           code="invalid_json") from None
    finally:
        if collecting:
            gc.enable()
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object", reason="bad_request",
                           code="invalid_json")
    if _suspect.seen or b"\x00" in raw[:4] or _MAY_HOLD_SURROGATE.search(raw):
        _refuse_unencodable(body)
    return body


_SURROGATE = re.compile("[\ud800-\udfff]")
"""A surrogate code point in a ``str`` (UTF-8 cannot encode one, paired or not)."""


def _has_lone_surrogate(text: str) -> bool:
    # O(1) for ASCII text (CPython keeps the flag); else one scan, nothing allocated.
    return not text.isascii() and _SURROGATE.search(text) is not None


def _refuse_unencodable(body: dict[str, Any]) -> None:
    """Raise a 400 naming the first lone surrogate or non-finite number in ``body``.

    Iterative (one iterator per open container), so a body nested as deep as the parser
    allows cannot exhaust the stack. Cost: linear in the body's values, with nothing
    allocated per value: a type test per value, a flag test per string (a scan only of
    non-ASCII strings), one iterator per container; the offending value's path is only
    built for the error (about as much CPU per MiB of body as the parse itself).
    """
    found = _first_unencodable(body)
    if found is None:
        return
    where, value, in_key = found
    path = _path(where)
    if in_key:
        raise GatewayError(
            400, f"a key in '{path or 'the body'}' holds a lone UTF-16 surrogate, "
            "which is not Unicode text", reason="bad_request",
            code="invalid_unicode", param=path or None)
    if isinstance(value, str):
        raise GatewayError(
            400, f"'{path}' holds a lone UTF-16 surrogate, which is not Unicode text; "
            "send valid UTF-8 (a surrogate pair written as two escapes is fine)",
            reason="bad_request", code="invalid_unicode", param=path)
    raise GatewayError(
        400, f"'{path}' is {value!r}: JSON has no NaN or Infinity, and the engine "
        "cannot take a non-finite number", reason="bad_request",
        code="invalid_number", param=path)


def _first_unencodable(body: dict[str, Any]) -> tuple[list[Any], Any, bool] | None:
    """(the keys and indices down to it, the value, whether it is a key) of the first
    lone surrogate or non-finite number in depth-first order, or None."""
    iters: list[Any] = [iter(body.items())]  # dict items, or enumerate() of a list
    keyed = [True]
    where: list[Any] = [None]  # the key or index each open container is at
    while iters:
        it, is_dict = iters[-1], keyed[-1]
        for entry in it:  # items() and enumerate() reuse their tuple: no allocation
            if is_dict:
                key, value = entry
                if _has_lone_surrogate(key):
                    return where[:-1], key, True
                where[-1] = key
            else:
                where[-1], value = entry
            kind = type(value)
            if kind is str:
                if not value.isascii() and _SURROGATE.search(value) is not None:
                    return where, value, False
            elif kind is float:
                if not math.isfinite(value):
                    return where, value, False
            elif kind is dict:
                if not value:
                    continue
                iters.append(iter(value.items()))
                keyed.append(True)
                where.append(None)
                break
            elif kind is list:
                if not value or _plain(value):
                    continue
                iters.append(enumerate(value))
                keyed.append(False)
                where.append(None)
                break
        else:
            iters.pop()
            keyed.pop()
            where.pop()
    return None


_SCALARS = frozenset((int, bool, type(None)))


def _plain(items: list[Any]) -> bool:
    """Whether a list certainly holds nothing to refuse: only integers, booleans and nulls,
    only ASCII strings, or only finite numbers (a list of token ids, of prompts). Each test
    runs in C over the list, a few nanoseconds an item, allocating a set of the types seen
    (at most seven); a mixed list returns False and is walked item by item."""
    kinds = set(map(type, items))
    if kinds <= _SCALARS:
        return True
    if kinds == {str}:
        return all(map(str.isascii, items))
    if kinds == {float}:
        return all(map(math.isfinite, items))
    return False


def _path(where: list[Any]) -> str:
    """``a.b[2].c`` from the keys and indices down to a value, clipped (``clip``): it is
    echoed in the error. Cost: O(depth), whatever the keys' lengths."""
    parts = []
    for step in where:  # at most the parser's depth limit of steps, each clipped
        if isinstance(step, int):
            parts.append(f"[{step}]")
        else:
            parts.append(("." if parts else "") + clip(str(step), 40))
    return clip("".join(parts))


MAX_MODEL_CHARS = 256
"""The longest ``model`` a request may name by default (``max_model_name_chars``): every
served name, alias or adapter name in practice (a Hugging Face ``owner/name`` has at most
about 140 characters), and what a ledger row keeps of a name (``ledger.MAX_NAME_CHARS``)."""


MAX_PROMPTS = 2048
"""The most prompts a completion request may batch, and inputs (documents, pairs) a pooling
request may hold, by default (``max_prompts_per_request``): each is counted with its own
engine call when its size decides anything."""


def check_model_name(model: str, max_model_chars: int) -> None:
    """A 400 for a ``model`` over ``max_model_chars`` characters, echoed clipped, before it
    is looked up (or kept in a ledger row). Cost: one ``len``."""
    if len(model) > max_model_chars:
        raise GatewayError(
            400, f"'model' has {len(model)} characters; at most {max_model_chars} are allowed "
            f"(max_model_name_chars): {clip(model, 100)!r}", reason="bad_request",
            code="invalid_value", param="model")


def parse_request(kind: Kind, body: dict[str, Any], max_model_chars: int = MAX_MODEL_CHARS,
                  max_prompts: int = MAX_PROMPTS) -> ParsedRequest:
    """The fields admission needs, or a 400 naming the first one it cannot take. Cost:
    O(1) per field but the prompt's, which is checked in one pass in C (a batch of
    completion prompts: one per prompt); ``model`` over ``max_model_chars`` characters is
    refused before it is looked up, echoed clipped; a batch of more than ``max_prompts``
    completion prompts is refused (each may cost an engine call to count it)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "'model' is required (a string)", reason="bad_request",
                           code="invalid_value", param="model")
    check_model_name(model, max_model_chars)
    if kind in POOLING_KINDS:
        # No output: max_tokens 0 (nothing reserved for it, nothing written), never streamed.
        inputs, field = pooling_inputs(kind, body, max_prompts)
        return ParsedRequest(kind=kind, body=body, model=model, stream=False,
                             client_wants_usage=False, client_wants_continuous_usage=False,
                             n=1, max_tokens=0, max_tokens_field="", prompts=inputs,
                             prompt_field=field)
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
    n = body.get("n", 1) if kind in ("chat", "completion") else 1
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise GatewayError(400, "'n' must be an integer >= 1", reason="bad_request",
                           code="invalid_value", param="n")
    field = MAX_TOKENS_FIELD[kind]
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        field = "max_completion_tokens"
    max_tokens = body.get(field)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise GatewayError(400, f"'{field}' must be an integer >= 1", reason="bad_request",
                           code="invalid_value", param=field)
    prompts = 1
    if kind == "chat" or kind == "messages":
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise GatewayError(400, "'messages' must be a non-empty list", reason="bad_request",
                               code="invalid_value", param="messages")
        if kind == "messages" and max_tokens is None:
            # The Messages API requires it (Anthropic and vLLM alike).
            raise GatewayError(400, "'max_tokens' is required", reason="bad_request",
                               code="invalid_value", param="max_tokens")
    elif kind == "responses":
        _check_responses(body)
    else:
        prompts = _completion_prompts(body.get("prompt"))
        if prompts > max_prompts:
            raise GatewayError(
                400, f"'prompt' batches {prompts} prompts; at most {max_prompts} are allowed "
                "(max_prompts_per_request): send the rest in other requests",
                reason="bad_request", code="invalid_value", param="prompt")
    return ParsedRequest(
        kind=kind, body=body, model=model, stream=stream,
        client_wants_usage=bool(options.get("include_usage")),
        client_wants_continuous_usage=bool(options.get("continuous_usage_stats")),
        n=n, max_tokens=max_tokens, max_tokens_field=field, prompts=prompts,
    )


def _completion_prompts(prompt: Any) -> int:
    """How many prompts a completion request holds: one string or list of token ids, or
    a batch of them (a list of strings or of lists of ids); a 400 for anything else."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return 1
    if isinstance(prompt, list) and prompt and (
            set(map(type, prompt)) == {str} or all(map(_is_token_ids, prompt))):
        return len(prompt)
    raise GatewayError(
        400, "'prompt' must be a string, a list of token ids, or a non-empty list of either "
        "(a batch)", reason="bad_request", code="invalid_value", param="prompt")


def _check_responses(body: dict[str, Any]) -> None:
    """A Responses request the gateway can serve: an ``input``, and nothing that needs a
    response kept in an engine's memory.

    vLLM keeps stored responses (``store``, ``previous_response_id``, ``background``) in
    the memory of the one API server that made them, unbounded, with no owner: behind a
    gateway a follow-up could land on another engine, and any tenant that learnt an id
    could read another tenant's conversation. The gateway therefore asks engines not to
    store (``store: false``) and refuses the two fields that need a stored response.
    """
    value = body.get("input")
    if not (isinstance(value, str) and value) and not (isinstance(value, list) and value):
        raise GatewayError(400, "'input' must be a non-empty string or list of input items",
                           reason="bad_request", code="invalid_value", param="input")
    if body.get("previous_response_id") is not None:
        raise GatewayError(
            400, "'previous_response_id' is not served by this gateway: it keeps no responses "
            "(an engine's stored responses would be reachable by any tenant); send the "
            "conversation so far in 'input'", reason="bad_request", code="unsupported_parameter",
            param="previous_response_id")
    if body.get("background"):
        raise GatewayError(
            400, "'background' is not served by this gateway: a response that runs after the "
            "request ends can be neither paced nor charged; stream it instead",
            reason="bad_request", code="unsupported_parameter", param="background")


def prompt_token_ids(req: ParsedRequest) -> list[list[int]] | None:
    """Each prompt's token ids when the client sent ids (no tokenizer call needed)."""
    if req.kind in POOLING_KINDS:
        return pooling_token_ids(req.body)
    if req.kind != "completion":
        return None
    prompt = req.body.get("prompt")
    if _is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and all(map(_is_token_ids, prompt)):
        return prompt
    return None


def count_calls(req: ParsedRequest) -> list[tuple[str, dict[str, Any]]]:
    """The engine calls (path, body) that count this request's prompts as the engine will:
    ``/tokenize`` for chat, each completion prompt and a Responses input (rendered as the
    chat messages vLLM makes of it); the engine's own ``/v1/messages/count_tokens`` for
    the Messages API; for a pooling request, ``wire._pooling``'s. The answer's ``count``
    (or ``input_tokens``) is the prompt's size."""
    body = req.body
    if req.kind in POOLING_KINDS:
        return pooling_count_calls(req.kind, req.model, body)
    if req.kind == "chat":
        out = {"model": req.model, "messages": body["messages"]}
        for name in _CHAT_TEMPLATE_FIELDS:
            if body.get(name) is not None:
                out[name] = body[name]
        return [("/tokenize", out)]
    if req.kind == "messages":
        return [("/v1/messages/count_tokens",
                 {k: v for k, v in body.items() if k in _MESSAGES_COUNT_FIELDS} | {
                     "model": req.model})]
    if req.kind == "responses":
        return [("/tokenize", responses_as_chat(req.model, body))]
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) else prompt
    calls = []
    for text in prompts:
        out = {"model": req.model, "prompt": text}
        if body.get("add_special_tokens") is not None:
            out["add_special_tokens"] = body["add_special_tokens"]
        calls.append(("/tokenize", out))
    return calls


_MESSAGES_COUNT_FIELDS = ("messages", "system", "tools", "tool_choice", "thinking",
                          "chat_template_kwargs")


def responses_as_chat(model: str, body: dict[str, Any]) -> dict[str, Any]:
    """A ``/tokenize`` request with the chat messages and tools vLLM renders a Responses
    request into: ``instructions`` as the system message, a string ``input`` as the user's,
    message items with their text, function calls and their outputs as tool calls and tool
    messages. An item of another type is counted on its JSON text (an over-count)."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        items = []
    for item in items:
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(item, dict) and "role" in item and kind in (None, "message"):
            messages.append({"role": item["role"], "content": _chat_content(item.get("content"))})
        elif kind == "function_call":
            messages.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else dumps(output)})
        else:
            messages.append({"role": "user", "content": dumps(item)})
    out: dict[str, Any] = {"model": model, "messages": messages}
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description",
                                                                 "parameters") if k in t}}
             for t in body.get("tools") or () if isinstance(t, dict) and t.get("type") == "function"]
    if tools:
        out["tools"] = tools
    return out


def _chat_content(content: Any) -> Any:
    """A Responses message's content as chat content: text parts become chat text parts."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif isinstance(part, dict) and part.get("type") == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
        else:
            parts.append({"type": "text", "text": dumps(part)})
    return parts


def end_user_of(req: ParsedRequest) -> str | None:
    """The end user a request names, or None: OpenAI's ``safety_identifier`` (chat,
    Responses), which OpenAI has replacing ``user``, else the ``user`` field (chat,
    completions, Responses); the Messages API's ``metadata.user_id``. 400 when it is not
    a usable identity (a non-empty string of at most 256 characters)."""
    if req.kind == "messages":
        metadata = req.body.get("metadata")
        value, param = (metadata.get("user_id") if isinstance(metadata, dict) else None,
                        "metadata.user_id")
    elif req.body.get("safety_identifier") is not None:
        value, param = req.body["safety_identifier"], "safety_identifier"
    else:
        value, param = req.body.get("user"), "user"
    if value is None:
        return None
    try:
        return validate_user_id(value, param)
    except LimitsError as exc:
        raise GatewayError(400, f"{exc} (it names the end user, paced at the tenant's "
                           "end_user_output_tokens_per_second)", reason="bad_request",
                           code="invalid_end_user", param=param) from None


def dumps(value: Any) -> str:
    """JSON text of a client's value, or a 400 for one nested deeper than the encoder goes.

    Python's parser and encoder both stop at the interpreter's recursion limit, counted
    from wherever they run, so a body nested just short of that limit can parse on one
    stack and fail to encode on a deeper one (a generated body of ~1,000 nested lists did,
    once in many runs). Cost: nothing unless it fails.
    """
    try:
        return json.dumps(value)
    except RecursionError:
        raise GatewayError(400, "the request body is nested too deeply to forward",
                           reason="bad_request", code="invalid_json") from None


def encode_body(value: dict[str, Any]) -> bytes:
    """The UTF-8 JSON bytes of a parsed body for the engine, or a 400 for one nested deeper
    than the encoder goes (as ``dumps``). Cost: one C encode (msgspec), linear in the body:
    about a tenth of ``json.dumps`` for the same value, on the event loop."""
    try:
        return _encode(value)
    except RecursionError:
        raise GatewayError(400, "the request body is nested too deeply to forward",
                           reason="bad_request", code="invalid_json") from None


_encode = msgspec.json.Encoder().encode


def _is_token_ids(value: Any) -> bool:
    """A non-empty list of integers (not booleans). Cost: one pass in C, no per-item
    allocation (a set of the item types seen)."""
    return isinstance(value, list) and bool(value) and set(map(type, value)) == {int}
