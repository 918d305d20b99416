"""The gateway's own CPU in bursts of streams, with no engine: a quick probe for profiling.

    .venv/bin/python tools/gateway_burst_probe.py [--rounds 100] [--tokens 16] [--drip]

Starts ``tokenpace gateway`` (one tenant, no caps, SQLite ledger) in front of an upstream
that answers at once, then sends ``--rounds`` bursts of 32 streamed completions of
``--tokens`` tokens each, 0.1 s apart, and prints:

- the gateway process's CPU per request over all rounds (``/proc``; the 0.1 s pauses
  and the gateway's background polls included), and per burst (median and 10-90% range;
  /proc counts 10 ms ticks, so one burst's figure is coarse);
- per burst, when the last stream's first chunk arrived and the median TTFT: with an
  upstream that takes no time, this is the gateway's (and the client's) serial work.

The upstream is the benches' fast upstream (``tokenpace.bench.fast_upstream_server``: the
whole stream in one write), or with
``--drip`` a server in this script that writes each event on its own, 5 ms apart, as an
engine's steps do, so every event costs the gateway a read and a write: the per-chunk
cost. Attach ``py-spy record -p PID`` to the gateway to see where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

STREAMS = 32
_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)
_MAX_TOKENS = re.compile(rb'"max_(?:completion_)?tokens":\s*(\d+)')


def _event(body: dict[str, object]) -> bytes:
    payload = b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(payload), payload)


async def _drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One connection of the dripping upstream: vLLM-shaped events, one write each."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            match = _LENGTH.search(head)
            body = await reader.readexactly(int(match.group(1)) if match else 0)
            if not head.startswith(b"POST"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                continue
            found = _MAX_TOKENS.search(body)
            tokens = int(found.group(1)) if found else 16
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for i in range(1, tokens + 1):
                await asyncio.sleep(0.005)
                writer.write(_event({
                    "id": "cmpl-drip", "object": "text_completion", "created": 0,
                    "model": "tiny", "choices": [{"index": 0, "text": " word",
                                                  "logprobs": None, "finish_reason": None,
                                                  "token_ids": [100 + i]}],
                    "usage": {"prompt_tokens": 30, "total_tokens": 30 + i,
                              "completion_tokens": i}}))
            writer.write(_event({"id": "cmpl-drip", "object": "text_completion", "created": 0,
                                 "model": "tiny", "choices": [],
                                 "usage": {"prompt_tokens": 30, "total_tokens": 30 + tokens,
                                           "completion_tokens": tokens}}))
            writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        pass


async def _serve_drip(port: int) -> None:
    server = await asyncio.start_server(_drip, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def _one(session: object, url: str, body: dict[str, object]) -> tuple[float, float]:
    start = time.monotonic()
    first = 0.0
    async with session.post(url + "/v1/completions", json=body) as resp:  # type: ignore[attr-defined]
        assert resp.status == 200, await resp.text()
        async for _ in resp.content.iter_any():
            if not first:
                first = time.monotonic()
    return start, first


async def _bursts(url: str, gateway: object, rounds: int, tokens: int) -> None:
    import aiohttp

    body = {"model": "tiny", "prompt": "hello world " * 10, "max_tokens": tokens,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=2 * STREAMS)
    async with aiohttp.ClientSession(connector=connector,
                                     headers={"authorization": "Bearer sk-probe"}) as session:
        for _ in range(5):  # warm-up: connections opened on both sides
            await asyncio.gather(*[_one(session, url, body) for _ in range(STREAMS)])
        cpu, last_first, ttft = [], [], []
        total0 = gateway.cpu_seconds()  # type: ignore[attr-defined]
        for _ in range(rounds):
            cpu0, t0 = gateway.cpu_seconds(), time.monotonic()  # type: ignore[attr-defined]
            times = await asyncio.gather(*[_one(session, url, body) for _ in range(STREAMS)])
            await asyncio.sleep(0.05)
            cpu.append((gateway.cpu_seconds() - cpu0) / STREAMS * 1000)  # type: ignore[attr-defined]
            last_first.append((max(f for _, f in times) - t0) * 1000)
            ttft.append(statistics.median(f - s for s, f in times) * 1000)
            await asyncio.sleep(0.05)
        total = gateway.cpu_seconds() - total0  # type: ignore[attr-defined]

    def spread(values: list[float]) -> str:
        ordered = sorted(values)
        return (f"{statistics.median(values):.3f} [{ordered[len(ordered) // 10]:.3f}, "
                f"{ordered[len(ordered) * 9 // 10]:.3f}]")

    print(f"gateway CPU per request, all rounds: {total / rounds / STREAMS * 1000:.3f} ms")
    print(f"gateway CPU per request, per burst (ms): {spread(cpu)}")
    print(f"last stream's first chunk after (ms): {spread(last_first)}; "
          f"median TTFT (ms): {spread(ttft)}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--drip-server"]:
        asyncio.run(_serve_drip(int(argv[1])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--drip", action="store_true",
                        help="events one write each, 5 ms apart (per-chunk cost)")
    args = parser.parse_args(argv)
    from tokenpace.bench import Server, fast_upstream_server, free_port, start_all

    home = Path(tempfile.mkdtemp(prefix="tokenpace-probe-"))
    upstream_port, gateway_port = free_port(), free_port()
    (home / "gateway.yaml").write_text(
        f'engines: [{{url: "http://127.0.0.1:{upstream_port}", max_inflight: 256, models: [tiny]}}]\n'
        f'ledger: "sqlite:///{home}/ledger.db"\n'
        'tenants: [{id: probe, api_keys: ["sk-probe"]}]\n')
    if args.drip:
        upstream = Server([sys.executable, __file__, "--drip-server", str(upstream_port)],
                          upstream_port, home / "upstream.log")
    else:
        upstream = fast_upstream_server(upstream_port, home / "upstream.log")
    gateway = Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config",
                      str(home / "gateway.yaml"), "--port", str(gateway_port),
                      "--log-level", "warning"], gateway_port, home / "gateway.log")
    start_all([upstream, gateway])
    print(f"gateway pid {gateway.proc.pid}", flush=True)
    try:
        asyncio.run(_bursts(gateway.base_url, gateway, args.rounds, args.tokens))
    finally:
        gateway.stop()
        upstream.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
