"""Server-sent events from the engine, rewritten for the client.

The gateway asks every engine stream for usage in every chunk
(``stream_options.continuous_usage_stats``), which tells it exactly how many tokens were
generated at any moment. The client receives what it asked for: no usage at all, only the
final usage chunk (``include_usage``), or usage in every chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class StreamProgress:
    """What the gateway learned from the chunks so far."""

    prompt_tokens: int | None = None
    completion_tokens: int = 0
    first_token: bool = False
    finish_reason: str | None = None
    error: Any = None
    done: bool = False


class ChunkRewriter:
    def __init__(self, wants_usage: bool, wants_continuous_usage: bool) -> None:
        self.wants_usage = wants_usage
        self.wants_continuous = wants_usage and wants_continuous_usage
        self.progress = StreamProgress()

    def event(self, data: str) -> bytes | None:
        """One ``data:`` payload from the engine -> the bytes to send on, or None to drop."""
        if data == "[DONE]":
            self.progress.done = True
            return b"data: [DONE]\n\n"
        try:
            chunk = json.loads(data)
        except ValueError:
            return f"data: {data}\n\n".encode()
        if not isinstance(chunk, dict):
            return f"data: {data}\n\n".encode()
        progress = self.progress
        if "error" in chunk:
            progress.error = chunk["error"]
            return f"data: {data}\n\n".encode()
        usage = chunk.get("usage")
        choices = chunk.get("choices") or []
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                progress.completion_tokens = max(progress.completion_tokens, usage["completion_tokens"])
            if isinstance(usage.get("prompt_tokens"), int):
                progress.prompt_tokens = usage["prompt_tokens"]
        if progress.completion_tokens > 0 or any(_has_output(c) for c in choices):
            progress.first_token = True
        for choice in choices:
            if isinstance(choice, dict) and choice.get("finish_reason"):
                progress.finish_reason = choice["finish_reason"]
        if usage is None or self.wants_continuous:
            return f"data: {data}\n\n".encode()
        if not choices:  # the final usage-only chunk
            return f"data: {data}\n\n".encode() if self.wants_usage else None
        del chunk["usage"]
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _has_output(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content") or delta.get("tool_calls")
                                            or delta.get("reasoning_content"))
