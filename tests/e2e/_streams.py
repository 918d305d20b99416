"""Streaming completions through the official ``openai`` client, timed at the client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from openai import AsyncOpenAI

from tokenpace.bench._load import StreamRecord


Stream = StreamRecord  # one streamed completion as the client saw it


def client(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)


async def stream(api: AsyncOpenAI, user: str, max_tokens: int, prompt: str = "Hello") -> Stream:
    """Stream one completion with ``ignore_eos`` and record when each chunk arrived."""
    record = Stream(user=user, start=time.monotonic())
    chunks = await api.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "vllm_xargs": {"output_rate_user": user}},
    )
    async for chunk in chunks:
        if chunk.choices:  # text may be empty: the detokenizer holds back partial UTF-8
            record.token_times.append(time.monotonic())
        if chunk.usage is not None:
            record.completion_tokens = chunk.usage.completion_tokens
    return record


async def streams(base_url: str, plan: Sequence[tuple[str, int, int]]) -> list[Stream]:
    """Run ``(user, count, max_tokens)`` streams concurrently; results in plan order."""
    api = client(base_url)
    try:
        jobs = [stream(api, user, tokens) for user, count, tokens in plan for _ in range(count)]
        return list(await asyncio.gather(*jobs))
    finally:
        await api.close()


def user_rate(results: Sequence[Stream], limit: float) -> float:
    """A user's measured rate over all its streams, net of the GCRA burst allowance.

    GCRA lets ``1 + 0.1 x limit`` tokens through at once, then ``limit`` per second, so
    ``N`` tokens span at least ``(N - 1 - 0.1 x limit) / limit`` seconds.
    """
    total = sum(r.completion_tokens or 0 for r in results)
    span = max(r.last for r in results) - min(r.first for r in results)
    return (total - 1 - 0.1 * limit) / span
