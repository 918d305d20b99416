"""The benchmarks' SSE reader frames events on LF bytes only, like the gateway's relay."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from tokenpace.bench._load import sse_data


def test_events_with_unicode_line_separators_and_split_reads_stay_whole() -> None:
    text = '{"choices":[{"text":"a\u0085b\u2028c\u2029d\u20ac"}]}'
    stream = f"data: {text}\n\ndata: {text}\r\n\r\ndata: [DONE]\n\n".encode()
    cut = stream.index("\u20ac".encode()) + 1  # a read that ends inside a multi-byte character

    async def pieces() -> AsyncIterator[bytes]:
        for piece in (stream[:cut], stream[cut:cut + 3], stream[cut + 3:]):
            yield piece

    async def read() -> list[bytes]:
        return [data async for data in sse_data(httpx.Response(200, content=pieces()))]

    assert asyncio.run(read()) == [text.encode(), text.encode(), b"[DONE]"]
