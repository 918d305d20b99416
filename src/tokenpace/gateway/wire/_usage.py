"""What the Responses and Messages APIs report of their usage, read from the engine's answer.

Chat and completion streams carry usage in every chunk (the gateway asks for it, see
``_stream``). The Responses API (``/v1/responses``) and Anthropic's Messages API
(``/v1/messages``) have no such option: their streams are relayed byte for byte, and this
module reads what they do say:

- Messages: ``message_start`` holds the prompt's ``input_tokens`` (exact, at once);
  ``message_delta`` at the end holds the ``output_tokens``; ``message_stop`` ends it.
- Responses: ``response.completed`` (also for an ``incomplete`` response) holds both counts
  at the end; ``response.failed`` and ``error`` end it with an error.
- Cached prompt tokens (priced by ``cost.cached_prompt``): Responses give them in
  ``usage.input_tokens_details.cached_tokens``; Messages in ``cache_read_input_tokens``,
  and there vLLM's ``input_tokens`` is the prompt *less* its cached and cache-creation
  tokens (Anthropic's convention), so the prompt is the sum of the three. vLLM's Messages
  stream carries the cache fields in ``message_delta`` only (with
  ``--enable-prompt-tokens-details``), never in ``message_start``.
- Until the final count arrives, every ``*.delta`` event counts one output token. That is
  a lower bound: vLLM's API server sends one event per engine step, but merges steps it
  could not send in time, and holds back a token that ends inside a UTF-8 character. A
  stream that ends before its final count (the client left, the time ran out) is charged
  what tokenpace's engine says the aborted request generated, or this bound where the
  engine cannot tell (``_relay.engine_output_count``; docs/gateway/endpoints.md).

Cost per event: one ``bytes.startswith`` or ``rfind`` for the event's type; only the two
or three events that carry usage are parsed as JSON (the cached count is read from those
already parsed: a few dict lookups per response, nothing per token).
"""

from __future__ import annotations

import json
from typing import Any

from ._stream import StreamProgress, cached_count

_TYPE_FIRST = b'{"type":"'
_TYPE_KEY = b'"type":"'

_MESSAGES_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                    "tool_use": "tool_calls", "pause_turn": "stop", "refusal": "content_filter"}
"""Anthropic stop reasons as the OpenAI finish reasons the ledger keeps for every route."""


def answer_usage(kind: str, data: Any) -> tuple[int | None, int, str | None]:
    """A non-streamed answer's (prompt tokens, output tokens, finish reason)."""
    if not isinstance(data, dict):
        raise TypeError("the answer is not a JSON object")
    usage = data.get("usage") or {}
    if kind == "responses":
        return (usage.get("input_tokens"), int(usage.get("output_tokens") or 0),
                _responses_finish(data))
    if kind == "messages":
        return (_messages_prompt(usage), int(usage.get("output_tokens") or 0),
                _messages_finish(data.get("stop_reason")))
    reasons = [c.get("finish_reason") for c in data.get("choices") or [] if isinstance(c, dict)]
    return (usage.get("prompt_tokens"), int(usage.get("completion_tokens") or 0),
            next((r for r in reasons if r), None))


def answer_cached(kind: str, data: Any) -> int | None:
    """A non-streamed answer's cached prompt tokens; None when the engine did not say
    (chat and completions without ``--enable-prompt-tokens-details``). A few dict
    lookups per answer."""
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return None
    return _cached(kind, usage)


def _cached(kind: str, usage: dict[str, Any]) -> int | None:
    """The cached prompt tokens of one usage object in ``kind``'s format."""
    if kind == "messages":
        return cached_count(usage, "cache_read_input_tokens")
    if kind == "responses":
        return cached_count(usage.get("input_tokens_details"), "cached_tokens")
    return cached_count(usage.get("prompt_tokens_details"), "cached_tokens")


def _messages_prompt(usage: dict[str, Any]) -> int | None:
    """The whole prompt of a Messages usage: ``input_tokens`` plus the cache fields that
    vLLM (as Anthropic) takes out of it. None without ``input_tokens``."""
    prompt = cached_count(usage, "input_tokens")
    if prompt is None:
        return None
    for key in ("cache_read_input_tokens", "cache_creation_input_tokens"):
        prompt += cached_count(usage, key) or 0
    return prompt


def _responses_finish(response: dict[str, Any]) -> str | None:
    status = response.get("status")
    if status == "completed":
        return "stop"
    if status == "incomplete":
        details = response.get("incomplete_details") or {}
        reason = details.get("reason") if isinstance(details, dict) else None
        return "length" if reason == "max_output_tokens" else (reason or "incomplete")
    return status if isinstance(status, str) else None


def _messages_finish(reason: Any) -> str | None:
    if not isinstance(reason, str):
        return None
    return _MESSAGES_FINISH.get(reason, reason)


class EventScanner:
    """Reads the usage of a Responses or Messages event stream, one ``data`` payload at a
    time, into a ``StreamProgress`` (the relay passes the bytes on itself)."""

    __slots__ = ("progress",)

    def __init__(self) -> None:
        self.progress = StreamProgress()

    def event(self, data: bytes) -> None:
        progress = self.progress
        kind = _event_type(data)
        if kind is None:
            return
        if kind.endswith(b".delta") or kind == b"content_block_delta":
            # Per token (about): a lower bound until the final count (module docstring).
            if not progress.final:
                progress.completion_tokens += 1
            progress.first_token = True
        elif kind == b"message_start":
            message = _loads(data).get("message") or {}
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                self._prompt("messages", usage)
        elif kind == b"message_delta":
            event = _loads(data)
            self._usage(event.get("usage"), "messages")
            delta = event.get("delta")
            if isinstance(delta, dict) and delta.get("stop_reason"):
                progress.finish_reason = _messages_finish(delta["stop_reason"])
        elif kind == b"message_stop":
            progress.done = True
        elif kind in (b"response.completed", b"response.incomplete"):
            response = _loads(data).get("response") or {}
            if isinstance(response, dict):
                self._usage(response.get("usage"), "responses")
                progress.finish_reason = _responses_finish(response)
            progress.done = True
        elif kind == b"response.failed":
            response = _loads(data).get("response") or {}
            error = response.get("error") if isinstance(response, dict) else None
            progress.error = error or "the response failed"
            if isinstance(response, dict):
                self._usage(response.get("usage"), "responses")
            progress.done = True
        elif kind == b"error":
            event = _loads(data)
            progress.error = event.get("error") or event.get("message") or "error"

    def _usage(self, usage: Any, kind: str) -> None:
        """A final usage: the output's total, the prompt and its cached part."""
        if not isinstance(usage, dict):
            return
        if isinstance(usage.get("output_tokens"), int):
            self.progress.total(usage["output_tokens"])
        self._prompt(kind, usage)

    def _prompt(self, kind: str, usage: dict[str, Any]) -> None:
        progress = self.progress
        prompt = (_messages_prompt(usage) if kind == "messages"
                  else cached_count(usage, "input_tokens"))
        if prompt is not None:
            progress.prompt_tokens = prompt
        cached = _cached(kind, usage)
        if cached is not None:
            progress.cached_tokens = cached


def _event_type(data: bytes) -> bytes | None:
    """The event's ``type``: the first key of Messages events, the last of Responses events
    (as vLLM writes them); any other layout is parsed."""
    if data.startswith(_TYPE_FIRST):
        end = data.find(b'"', len(_TYPE_FIRST))
        return data[len(_TYPE_FIRST):end] if end > 0 else None
    at = data.rfind(_TYPE_KEY)
    if at >= 0:
        start = at + len(_TYPE_KEY)
        end = data.find(b'"', start)
        if end > 0 and data[end + 1:].strip() == b"}":
            return data[start:end]
    kind = _loads(data).get("type")
    return kind.encode() if isinstance(kind, str) else None


def _loads(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
