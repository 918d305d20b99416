"""An upstream that answers the gateway's calls as fast as a socket can, for
``tokenpace bench gateway``'s requests-per-second figure.

A real engine (or the tiny model on a CPU) is the limit long before the gateway is; this
server is not: it parses just enough HTTP/1.1 (keep-alive, Content-Length bodies) and
answers every completion from canned bytes, streamed or not, with the continuous usage
vLLM would send, whatever ``model`` it names. Its ``/v1/models`` lists ``tiny``, the name
the benchmarks send (the gateway routes by the names an engine lists). Run it in its own
process, so its CPU is not counted as the gateway's:
``python -m tokenpace.bench._fast_upstream PORT``.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._process import Server

_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)
_MAX_TOKENS = re.compile(rb'"max_(?:completion_)?tokens":\s*(\d+)')


def _chunk(i: int) -> bytes:
    body = json.dumps({"id": "cmpl-fast", "object": "text_completion", "created": 0,
                       "model": "fast", "choices": [{"index": 0, "text": "x",
                                                     "finish_reason": None}],
                       "usage": {"prompt_tokens": 5, "total_tokens": 5 + i,
                                 "completion_tokens": i}}, separators=(",", ":")).encode()
    return b"data: " + body + b"\n\n"


def _stream(tokens: int) -> bytes:
    events = [_chunk(i + 1) for i in range(tokens)]
    final = json.dumps({"id": "cmpl-fast", "object": "text_completion", "created": 0,
                        "model": "fast", "choices": [],
                        "usage": {"prompt_tokens": 5, "total_tokens": 5 + tokens,
                                  "completion_tokens": tokens}}, separators=(",", ":")).encode()
    events += [b"data: " + final + b"\n\n", b"data: [DONE]\n\n"]
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + body)


def _json(status: bytes, payload: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(payload)).encode() + b"\r\n\r\n" + payload)


_MODELS = _json(b"200 OK", b'{"object":"list","data":[{"id":"tiny","object":"model"}]}')


def _answer(head: bytes, body: bytes, cache: dict[tuple[bool, int], bytes]) -> bytes:
    line = head.split(b"\r\n", 1)[0]
    if line.startswith(b"GET /health"):
        return b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
    if line.startswith(b"GET /v1/models"):
        return _MODELS
    if line.startswith(b"POST /tokenize"):
        return _json(b"200 OK", b'{"count":5,"max_model_len":4096}')
    if line.startswith(b"POST /v1/"):
        match = _MAX_TOKENS.search(body)
        tokens = int(match.group(1)) if match else 16
        stream = b'"stream": true' in body or b'"stream":true' in body
        key = (stream, tokens)
        if key not in cache:
            if stream:
                cache[key] = _stream(tokens)
            else:
                cache[key] = _json(b"200 OK", json.dumps({
                    "id": "cmpl-fast", "object": "text_completion", "model": "fast",
                    "choices": [{"index": 0, "text": "x" * tokens, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": tokens,
                              "total_tokens": 5 + tokens}}).encode())
        return cache[key]
    return b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


class _Protocol(asyncio.Protocol):
    cache: dict[tuple[bool, int], bytes] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end]
            match = _LENGTH.search(head)
            length = int(match.group(1)) if match else 0
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            self.transport.write(_answer(head, body, self.cache))  # type: ignore[attr-defined]


async def _serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Protocol, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def server(port: int, log: Path) -> Server:
    """This upstream on ``port`` in its own process, its output in ``log`` (started, not
    waited for: ``wait_ready`` or ``start_all`` waits until it answers)."""
    from .._process import Server

    return Server([sys.executable, "-m", "tokenpace.bench._fast_upstream", str(port)], port, log)


def main(argv: list[str]) -> int:
    try:
        import uvloop
        uvloop.run(_serve(int(argv[0])))
    except ImportError:
        asyncio.run(_serve(int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
