"""Server-sent events from the engine, passed on to the client as bytes.

The gateway asks every engine stream for usage in every chunk
(``stream_options.continuous_usage_stats``), which tells it exactly how many tokens were
generated at any moment. The client receives what it asked for: no usage at all, only the
final usage chunk (``include_usage``), or usage in every chunk.

Two rules keep the relay both correct and cheap:

- Events are framed on CR and LF only (the SSE grammar). A text splitter such as
  ``str.splitlines`` (and httpx's ``aiter_lines``) also breaks on U+0085, U+2028 and U+2029,
  which JSON strings may carry unescaped: the event would reach the client cut in two. The
  splitter works on bytes, so a multi-byte character cut between two network reads is
  joined again before anything looks at it.
- The engine's bytes go out unchanged. The usage is found with a targeted search for its
  key and parsed alone (a ~60-byte object), and removed by cutting those bytes out when
  the client did not ask for it. Nothing is re-serialised, so a chunk reaches the client
  byte for byte as the engine would have sent it without usage.

Cost per chunk: two ``bytes.find`` over the chunk, one scan of the usage object by the JSON
decoder's C scanner (~1 us) and one small int parse; a chunk without usage (not vLLM)
falls back to a full ``json.loads``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_USAGE_KEY = b'"usage":'
_INDEX_KEY = b'"index":'
_FINISH_KEY = b'"finish_reason":"'
_CHOICES_EMPTY = b'"choices":[]'
_CHOICES_EMPTY_SPACED = b'"choices": []'
_DONE = b"[DONE]"
_scan = json.JSONDecoder().scan_once
"""The JSON decoder's scanner (C): one value from a ``str`` at an index. ``json.loads``
around it costs three times as much for a 60-byte object (it detects the encoding of
bytes in Python and checks for trailing data, which ``_object_end`` already bounds)."""


class EventSplitter:
    """Bytes from the network -> the ``data`` payloads of complete SSE lines.

    Inside a JSON string a raw CR or LF cannot appear (JSON escapes them), so splitting the
    byte stream on them never cuts an event's JSON. A CR at the end of a read is held back:
    it may be the first half of a CRLF.
    """

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads of the ``data:`` lines completed by ``data`` (other fields dropped)."""
        buf = self._pending + data if self._pending else data
        if b"\r" in buf:  # rare: vLLM ends lines with LF only
            keep_cr = buf.endswith(b"\r")
            if keep_cr:
                buf = buf[:-1]
            lines = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
            tail = lines.pop()
            self._pending = tail + b"\r" if keep_cr else tail
        else:
            lines = buf.split(b"\n")
            self._pending = lines.pop()
        return _payloads(lines)

    def flush(self) -> list[bytes]:
        """What remains when the stream ends (a last line without its line break)."""
        rest, self._pending = self._pending.rstrip(b"\r"), b""
        return _payloads([rest]) if rest else []


def _payloads(lines: list[bytes]) -> list[bytes]:
    out = []
    for line in lines:
        if line[:5] == b"data:":
            payload = line[5:]
            out.append(payload[1:] if payload[:1] == b" " else payload)
    return out


@dataclass
class StreamProgress:
    """What the gateway learned from the chunks so far."""

    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None
    """Prompt tokens the engine found in its prefix cache, from the final usage (vLLM
    reports them there only, and only with ``--enable-prompt-tokens-details``; Responses
    always); None: not reported, the prompt is charged in full."""
    first_token: bool = False
    finish_reason: str | None = None
    error: Any = None
    done: bool = False
    per_choice: dict[int, int] = field(default_factory=dict)
    """Latest continuous count of each choice: vLLM's per-chunk usage counts the tokens of
    that chunk's choice only (n > 1, or several prompts), so the request's total is the sum."""
    final: bool = False  # the usage-only chunk (the engine's own total) was seen
    per_prompt: dict[int, int] = field(default_factory=dict)
    """Prompt tokens of each prompt of a batch (completions): a chunk's usage counts its
    own prompt only, so the request's prompt tokens are the sum."""

    def count(self, index: int, completion_tokens: int) -> None:
        if self.final:
            return
        if completion_tokens > self.per_choice.get(index, 0):
            self.completion_tokens += completion_tokens - self.per_choice.get(index, 0)
            self.per_choice[index] = completion_tokens

    def total(self, completion_tokens: int) -> None:
        self.final = True
        self.completion_tokens = completion_tokens


class ChunkRewriter:
    def __init__(self, wants_usage: bool, wants_continuous_usage: bool, n: int = 1,
                 prompts: int = 1) -> None:
        self.wants_usage = wants_usage
        self.wants_continuous = wants_usage and wants_continuous_usage
        self.progress = StreamProgress()
        self.n = n  # choices per prompt: a chunk of choice i belongs to prompt i // n
        self.batch = prompts > 1

    def event(self, data: bytes) -> bytes | None:
        """One ``data:`` payload from the engine -> the payload to send on, or None to drop."""
        if data == _DONE:
            self.progress.done = True
            return data
        at = data.rfind(_USAGE_KEY)
        if at < 0 or data[:9] == b'{"error":':
            self._slow(data)
            return data
        start = at + len(_USAGE_KEY)
        while data[start:start + 1] == b" ":
            start += 1
        end = _object_end(data, start)
        if end < 0:
            self._slow(data)
            return data
        try:
            usage = _scan(data[start:end].decode(), 0)[0]
        except (ValueError, StopIteration):
            self._slow(data)
            return data
        progress = self.progress
        if _CHOICES_EMPTY in data or _CHOICES_EMPTY_SPACED in data:  # the final usage chunk
            if isinstance(usage, dict):
                self._read_usage(usage, None)
            return data if self.wants_usage else None
        if isinstance(usage, dict):
            self._read_usage(usage, _choice_index(data))
        if progress.completion_tokens > 0:
            progress.first_token = True
        reason_at = data.find(_FINISH_KEY)
        if reason_at >= 0:
            reason_at += len(_FINISH_KEY)
            progress.finish_reason = data[reason_at:data.find(b'"', reason_at)].decode()
        if self.wants_continuous:
            return data
        # cut ',"usage":{...}' (or 'usage' as the first key with its trailing comma)
        before = at
        while data[before - 1:before] == b" ":
            before -= 1
        if data[before - 1:before] == b",":
            return data[:before - 1] + data[end:]
        after = end
        while data[after:after + 1] == b" ":
            after += 1
        if data[after:after + 1] == b",":
            return data[:at] + data[after + 1:].lstrip(b" ")
        return data[:at] + data[end:]

    def _read_usage(self, usage: dict[str, Any], index: int | None) -> None:
        progress = self.progress
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            if index is None:
                progress.total(completion)
            else:
                progress.count(index, completion)
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int):
            if self.batch and index is not None:
                progress.per_prompt[index // self.n] = prompt
                progress.prompt_tokens = sum(progress.per_prompt.values())
            else:
                progress.prompt_tokens = prompt
        # Cached prompt tokens: one more dict lookup per chunk (~30 ns) on the usage
        # already parsed. vLLM puts ``prompt_tokens_details`` in the final usage chunk
        # only, where it adds ~35 bytes to that one chunk's usage scan.
        details = usage.get("prompt_tokens_details")
        if details is not None:
            cached = cached_count(details, "cached_tokens")
            if cached is not None:
                progress.cached_tokens = cached

    def _slow(self, data: bytes) -> None:
        """A chunk without the usage the gateway asked for (or an error): parse it whole."""
        progress = self.progress
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        if not isinstance(chunk, dict):
            return
        if "error" in chunk:
            progress.error = chunk["error"]
            return
        choices = chunk.get("choices") or []
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            index = None if not choices else _dict_index(choices[0])
            self._read_usage(usage, index)
        if progress.completion_tokens > 0 or any(_has_output(c) for c in choices):
            progress.first_token = True
        for choice in choices:
            if isinstance(choice, dict) and choice.get("finish_reason"):
                progress.finish_reason = choice["finish_reason"]


def cached_count(details: Any, key: str) -> int | None:
    """The int at ``details[key]`` (a usage's details object), or None when absent."""
    if not isinstance(details, dict):
        return None
    value = details.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _object_end(data: bytes, start: int) -> int:
    """End (exclusive) of the JSON value at ``start`` that is an object of numbers (usage),
    or -1 if it is something else. Usage holds no strings, so braces can be counted."""
    if data[start:start + 4] == b"null":
        return start + 4
    if data[start:start + 1] != b"{":
        return -1
    depth, i = 0, start
    while True:
        close = data.find(b"}", i)
        if close < 0:
            return -1
        depth += data.count(b"{", i, close) - 1
        i = close + 1
        if depth <= 0:
            return i


def _choice_index(data: bytes) -> int:
    at = data.find(_INDEX_KEY)
    if at < 0:
        return 0
    at += len(_INDEX_KEY)
    while data[at:at + 1] == b" ":
        at += 1
    end = at
    while data[end:end + 1].isdigit():
        end += 1
    return int(data[at:end]) if end > at else 0


def _dict_index(choice: Any) -> int:
    index = choice.get("index") if isinstance(choice, dict) else None
    return index if isinstance(index, int) else 0


def _has_output(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content") or delta.get("tool_calls")
                                            or delta.get("reasoning_content"))
