"""A streaming load generator for vLLM's OpenAI API, timing every token at the client.

It asks for ``return_token_ids`` so each server-sent chunk says exactly how many tokens it
carries (the text of a chunk can be empty while the detokenizer holds back partial UTF-8).
"""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every httpx client of a bench process (``verify=``): httpx
    otherwise builds one per client, loading the CA bundle (tens of ms of CPU each; a
    bench making 64 clients per run paid seconds). The benches call http:// servers."""
    return ssl.create_default_context()


def async_client(**kwargs: Any) -> httpx.AsyncClient:
    """``httpx.AsyncClient(**kwargs)`` with the process's shared TLS context."""
    return httpx.AsyncClient(verify=tls_context(), **kwargs)


@dataclass
class StreamRecord:
    """One streamed completion: when each of its tokens reached the client."""

    user: str
    start: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int | None = None  # from the final usage chunk

    @property
    def first(self) -> float:
        return self.token_times[0]

    @property
    def last(self) -> float:
        return self.token_times[-1]

    @property
    def ttft(self) -> float:
        return self.first - self.start


async def sse_data(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of an httpx response's server-sent event stream."""
    async for data in sse_payloads(resp.aiter_bytes()):
        yield data


async def sse_payloads(pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a server-sent event stream, framed on LF (and CR LF) bytes
    only: JSON may carry U+0085, U+2028 and U+2029 unescaped, and the tiny model writes them
    now and then; ``str.splitlines`` (httpx's ``aiter_lines``) would cut an event there."""
    pending = b""
    async for piece in pieces:
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip(b" \r")
    if pending.startswith(b"data:"):
        yield pending[5:].strip(b" \r")


def record_chunk(record: StreamRecord, data: bytes, now: float) -> None:
    """Add one ``data:`` payload that arrived at ``now`` to ``record``.

    A token is counted where its id is (``return_token_ids``): a chunk without token ids (a
    role-only first chat chunk, a usage-only last chunk, prompt ids alone) is not a token,
    so the first token time is the first *generated* token's, on any path.
    """
    if data == b"[DONE]":
        return
    chunk = json.loads(data)
    for choice in chunk.get("choices") or ():
        record.token_times.extend([now] * len(choice.get("token_ids") or ()))
        record.token_ids.extend(choice.get("token_ids") or ())
    usage = chunk.get("usage")
    if usage:  # the last one, the final usage chunk, is the engine's total
        record.completion_tokens = usage["completion_tokens"]


async def stream_completion(
    client: httpx.AsyncClient, base_url: str, user: str | None, max_tokens: int,
    prompt: str | list[int] = "Hello", record: StreamRecord | None = None,
    headers: dict[str, str] | None = None, extra: dict[str, object] | None = None,
) -> StreamRecord:
    """Stream one ``ignore_eos`` completion for ``user`` (None: no identity).

    Pass ``record`` to watch tokens arrive while the stream runs (it keeps what arrived if
    the task is cancelled); ``prompt`` may be token ids; ``extra`` adds or replaces body
    fields. The record's start is taken just before the request is sent.
    """
    body: dict[str, object] = {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "ignore_eos": True, "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    if user is not None:
        body["vllm_xargs"] = {"output_rate_user": user}
    body.update(extra or {})
    if record is None:
        record = StreamRecord(user=user or "", start=time.monotonic())
    async with client.stream("POST", f"{base_url}/v1/completions", json=body,
                             headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for data in sse_data(resp):
            record_chunk(record, data, time.monotonic())
    return record


async def stream_aiohttp(session: aiohttp.ClientSession, base_url: str, body: dict[str, Any],
                         user: str = "") -> StreamRecord:
    """Stream one completion of ``body`` with aiohttp, timing its tokens like
    ``stream_completion``.

    For load that must not be limited by its own client: aiohttp parses HTTP in C, httpx
    (h11) in Python, at several times the CPU per chunk. On a host whose cores the servers
    share, a slow client's own backlog becomes part of the time to first token it measures.
    """
    url = f"{base_url}/v1/completions"
    record = StreamRecord(user=user, start=time.monotonic())
    try:
        resp = await session.post(url, json=body)
    except aiohttp.ServerDisconnectedError:
        # The server closed a kept-alive connection just as it was reused (its idle
        # timeout and the pool's cross): nothing was answered. Once more, on a new
        # connection, timed from this send.
        record = StreamRecord(user=user, start=time.monotonic())
        resp = await session.post(url, json=body)
    async with resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
        async for data in sse_payloads(resp.content.iter_any()):
            record_chunk(record, data, time.monotonic())
    return record


async def run_streams(
    base_url: str, plan: Sequence[tuple[str | None, int, int]], timeout_s: float = 900.0,
) -> list[StreamRecord]:
    """Run ``(user, streams, max_tokens)`` concurrently; results in plan order."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with async_client(timeout=timeout_s, limits=limits) as client:
        jobs = [
            stream_completion(client, base_url, user, tokens)
            for user, count, tokens in plan
            for _ in range(count)
        ]
        return list(await asyncio.gather(*jobs))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]
