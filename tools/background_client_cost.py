"""CPU per call of the gateway's background client to an engine (``background_client``,
which sends a request again after a keep-alive close) against a plain ``httpx`` client of
the same limits: this process's CPU only, sequential ``POST /tokenize`` calls to a canned
server in another process, the two arms alternated each round.

    .venv/bin/python tools/background_client_cost.py --rounds 15 --calls 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time

import httpx

from tokenpace.bench import free_port, pair_order, ratio_summary
from tokenpace.gateway.engines import background_client

ANSWER = b'{"count": 7, "max_model_len": 2048, "tokens": [1, 2, 3, 4, 5, 6, 7]}'
HEADERS = {"authorization": "Bearer k"}


def _serve(port: int) -> None:
    """Answer every request of every connection with ``ANSWER`` (keep-alive)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _client(kind: str, url: str) -> httpx.AsyncClient:
    if kind == "resend":
        return background_client(url, HEADERS, 16, 4.0)
    return httpx.AsyncClient(
        base_url=url, headers=HEADERS,
        timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
        limits=httpx.Limits(max_connections=16, max_keepalive_connections=16,
                            keepalive_expiry=4.0))


async def _round(kind: str, url: str, calls: int) -> float:
    """Microseconds of this process's CPU per call (after one warm-up call)."""
    async with _client(kind, url) as client:
        await client.post("/tokenize", json={"prompt": "hello"})
        start = time.process_time()
        for _ in range(calls):
            (await client.post("/tokenize", json={"model": "tiny", "prompt": "hello"})).json()
        return (time.process_time() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000, help="calls per arm and round")
    args = parser.parse_args()
    port = free_port()
    server = multiprocessing.Process(target=_serve, args=(port,), daemon=True)
    server.start()
    time.sleep(1.0)
    url = f"http://127.0.0.1:{port}"
    cpu: dict[str, list[float]] = {"plain": [], "resend": []}
    try:
        for i in range(args.rounds):
            for kind in pair_order(list(cpu), i):
                cpu[kind].append(asyncio.run(_round(kind, url, args.calls)))
    finally:
        server.terminate()
    print(json.dumps({"cpu_us_per_call": {k: round(statistics.median(v), 1)
                                          for k, v in cpu.items()},
                      "resend_over_plain": ratio_summary(cpu["resend"], cpu["plain"])}))


if __name__ == "__main__":
    main()
