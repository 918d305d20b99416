"""The hostile tenant's attacks for `tokenpace bench hostile`: one coroutine per attack.

Each attack runs against a gateway (``Target``) until ``stop`` is set, then returns what the
attacker saw as a ``Counter`` of outcomes (``"<kind>:<status>"`` for HTTP answers,
``"<kind>:timeout"``, ``"<kind>:<exception>"`` otherwise; raw-socket attacks count the
connections ``open_at_end``, ``closed_by_server_after_<N>s`` and ``answered:<status>``,
``N`` the seconds the connection lasted in 5 s steps). Every request has a timeout and
every socket is closed on the way out, so a hung gateway ends an attack as a figure, never
as a hang of the bench.

Sizes come from a ``Scale``: ``FULL`` is the battery as a hostile tenant would send it with
the gateway's default limits, ``QUICK`` a smaller one for CI and smoke runs. Bodies are
built once, before the phase, so the attacker's own CPU does not compete with the gateway
during it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

MIB = 1024 * 1024
EMOJI_ESCAPED = "\\ud83d\\ude00"  # one emoji as a client that escapes non-ASCII sends it


@dataclass(frozen=True)
class Scale:
    """How much each attack sends (module docstring)."""

    parse_bomb_bytes: int
    parse_bomb_connections: int
    batch_large_file_bytes: int
    batch_small_file_bytes: int
    batch_body_bytes: int
    batch_connections: int
    tokenize_bytes: int
    tokenize_connections: int
    slow_readers: int
    slow_reader_max_tokens: int
    model_name_bytes: int
    model_name_requests: int
    slowloris_connections: int  # of each kind: headers, body
    flood_connections: int


FULL = Scale(parse_bomb_bytes=4 * MIB, parse_bomb_connections=3,
             batch_large_file_bytes=100 * MIB, batch_small_file_bytes=5 * MIB,
             batch_body_bytes=50 * MIB, batch_connections=3,
             tokenize_bytes=4 * 1000 * 1000, tokenize_connections=16,
             slow_readers=32, slow_reader_max_tokens=3000,
             model_name_bytes=8 * MIB, model_name_requests=50,
             slowloris_connections=64, flood_connections=4000)
QUICK = Scale(parse_bomb_bytes=1 * MIB, parse_bomb_connections=2,
              batch_large_file_bytes=20 * MIB, batch_small_file_bytes=5 * MIB,
              batch_body_bytes=10 * MIB, batch_connections=2,
              tokenize_bytes=1 * 1000 * 1000, tokenize_connections=4,
              slow_readers=8, slow_reader_max_tokens=3000,
              model_name_bytes=8 * MIB, model_name_requests=5,
              slowloris_connections=8, flood_connections=500)

HTTP_TIMEOUT_S = 60.0  # any one attacker request
RAW_IO_TIMEOUT_S = 5.0  # connecting or sending a few bytes on a raw socket
STOP_GRACE_S = 2.0  # after the stop, for a raw-socket worker to count its connection


@dataclass(frozen=True)
class Target:
    """The gateway under attack and what the attacker may use."""

    url: str
    api_key: str
    model: str

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80


Attack = Callable[[Target, Scale, threading.Event], Awaitable[Counter[str]]]


def _label(exc: BaseException) -> str:
    return "timeout" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__


async def _until_stopped(stop: threading.Event, workers: list[Awaitable[None]]) -> None:
    """Run ``workers`` until ``stop`` is set (or all return); then those that do not end
    within ``STOP_GRACE_S`` (a request in flight) are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in workers]
    while not stop.is_set() and not all(t.done() for t in tasks):
        await asyncio.sleep(0.1)
    await asyncio.wait(tasks, timeout=STOP_GRACE_S)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _repeat(stop: threading.Event, seen: Counter[str], session: aiohttp.ClientSession,
                  requests: list[tuple[str, str, dict]], limit: int | None = None) -> None:
    """Send ``requests`` (kind, path, aiohttp keyword arguments) in turn, over and over,
    reading each answer whole, until ``stop`` (or ``limit`` sent)."""
    sent = 0
    while not stop.is_set() and (limit is None or sent < limit):
        for kind, path, kwargs in requests:
            if stop.is_set() or (limit is not None and sent >= limit):
                return
            sent += 1
            await _post(seen, session, kind, path, kwargs)


async def _post(seen: Counter[str], session: aiohttp.ClientSession, kind: str, path: str,
                kwargs: dict) -> None:
    """One request, its answer read whole; its outcome counted (``in_flight_at_stop`` when
    the attack ends before it does)."""
    try:
        async with session.post(path, **kwargs) as resp:
            await resp.read()
            seen[f"{kind}:{resp.status}"] += 1
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
        seen[f"{kind}:{_label(exc)}"] += 1
    except asyncio.CancelledError:
        seen[f"{kind}:in_flight_at_stop"] += 1
        raise


def _session(target: Target, connections: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        base_url=target.url, headers={"Authorization": f"Bearer {target.api_key}"},
        connector=aiohttp.TCPConnector(limit=connections + 1, force_close=True),
        timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S))


async def _http_attack(target: Target, stop: threading.Event, connections: int,
                       requests: list[tuple[str, str, dict]],
                       limit_each: int | None = None) -> Counter[str]:
    seen: Counter[str] = Counter()
    async with _session(target, connections) as session:
        await _until_stopped(stop, [_repeat(stop, seen, session, requests, limit_each)
                                    for _ in range(connections)])
    return seen


def parse_bomb_body(model: str, size: int) -> bytes:
    """A chat body of about ``size`` bytes: one escaped emoji, then a long list of zeros."""
    head = ('{"model": %s, "messages": [{"role": "user", "content": "hi %s"}], '
            '"max_tokens": 16, "pad": [' % (json.dumps(model), EMOJI_ESCAPED))
    count = max(1, (size - len(head) - 2) // 2)
    return (head + "0," * (count - 1) + "0]}").encode()


async def parse_bomb(target: Target, scale: Scale, stop: threading.Event) -> Counter[str]:
    """Large chat bodies with one escaped emoji and a long list of numbers, back to back."""
    body = parse_bomb_body(target.model, scale.parse_bomb_bytes)
    kwargs = {"data": body, "headers": {"Content-Type": "application/json"}}
    return await _http_attack(target, stop, scale.parse_bomb_connections,
                              [("chat", "/v1/chat/completions", kwargs)])


def _file_form(content: bytes) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", content, filename="lines.jsonl",
                   content_type="application/jsonl")
    return form


async def batch_uploads(target: Target, scale: Scale, stop: threading.Event) -> Counter[str]:
    """A file at the size limit, 5 MiB files of ``ab\\n``, a large ``POST /v1/batches``."""
    large = b"ab\n" * (scale.batch_large_file_bytes // 3)
    small = b"ab\n" * (scale.batch_small_file_bytes // 3)
    pad = "a" * scale.batch_body_bytes
    batch_body = json.dumps({"input_file_id": "file-none", "endpoint": "/v1/chat/completions",
                             "completion_window": "24h", "metadata": {"pad": pad}}).encode()
    seen: Counter[str] = Counter()

    async def worker(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            for kind, make in (("file_large", lambda: {"data": _file_form(large)}),
                               *[("file_5mib", lambda: {"data": _file_form(small)})] * 4,
                               ("batches_body", lambda: {"data": batch_body, "headers": {
                                   "Content-Type": "application/json"}})):
                if stop.is_set():
                    return
                path = "/v1/batches" if kind == "batches_body" else "/v1/files"
                await _post(seen, session, kind, path, make())

    async with _session(target, scale.batch_connections) as session:
        await _until_stopped(stop, [worker(session) for _ in range(scale.batch_connections)])
    return seen


async def tokenize_flood(target: Target, scale: Scale, stop: threading.Event) -> Counter[str]:
    """Concurrent ``/tokenize`` calls of a few MB each."""
    body = json.dumps({"model": target.model,
                       "prompt": "hello " * (scale.tokenize_bytes // 6)}).encode()
    kwargs = {"data": body, "headers": {"Content-Type": "application/json"}}
    return await _http_attack(target, stop, scale.tokenize_connections,
                              [("tokenize", "/tokenize", kwargs)])


async def huge_model_names(target: Target, scale: Scale,
                           stop: threading.Event) -> Counter[str]:
    """Chat requests whose model name is several MiB (``model_name_requests`` in all): the
    whole body one byte under ``model_name_bytes`` (the default body limit)."""
    fields = {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], "model": ""}
    name = "m" * (scale.model_name_bytes - len(json.dumps(fields)) - 1)
    body = json.dumps({**fields, "model": name}).encode()
    kwargs = {"data": body, "headers": {"Content-Type": "application/json"}}
    connections = 2
    return await _http_attack(target, stop, connections, [("chat", "/v1/chat/completions",
                                                           kwargs)],
                              limit_each=-(-scale.model_name_requests // connections))


async def _connect(target: Target, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, target.host_port),
                               RAW_IO_TIMEOUT_S)
    except BaseException:
        sock.close()
        raise
    return sock


def _request_head(target: Target, path: str, length: int) -> bytes:
    host, port = target.host_port
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {target.api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _status_of(received: bytes) -> str:
    parts = received.split(b" ", 2)
    return parts[1].decode(errors="replace") if len(parts) > 1 else "?"


def _ended(received: bytes, began: float) -> str:
    """How the server ended a connection: ``answered:<status>_after_<N>s`` or
    ``closed_by_server_after_<N>s`` (``N``: the seconds since ``began``, in 5 s steps)."""
    after = f"_after_{int((time.monotonic() - began) // 5 * 5)}s"
    return (f"answered:{_status_of(received)}" if received else "closed_by_server") + after


async def _trickle(sock: socket.socket, data: bytes, stop: threading.Event) -> str:
    """Send ``data`` one byte a second until ``stop``; what became of the connection."""
    loop = asyncio.get_running_loop()
    received = b""
    began = time.monotonic()
    for i in range(len(data)):
        if stop.is_set():
            break
        try:
            await asyncio.wait_for(loop.sock_sendall(sock, data[i:i + 1]), RAW_IO_TIMEOUT_S)
            got = await asyncio.wait_for(loop.sock_recv(sock, 4096), 1.0)
        except asyncio.TimeoutError:
            continue  # nothing from the server within the second: the connection holds
        except OSError:
            return _ended(received, began)
        if not got:
            return _ended(received, began)
        received += got
    return f"answered:{_status_of(received)}" if received else "open_at_end"


async def slowloris(target: Target, scale: Scale, stop: threading.Event) -> Counter[str]:
    """Connections that send their headers one byte a second, and others whose headers are
    whole but whose body comes one byte a second."""
    body = json.dumps({"model": target.model, "max_tokens": 16,
                       "messages": [{"role": "user", "content": "hi " * 300}]}).encode()
    head = _request_head(target, "/v1/chat/completions", len(body))
    seen: Counter[str] = Counter()

    async def one(kind: str) -> None:
        try:
            sock = await _connect(target)
        except (asyncio.TimeoutError, OSError) as exc:
            seen[f"{kind}:connect_{_label(exc)}"] += 1
            return
        try:
            if kind == "body":
                await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(sock, head),
                                       RAW_IO_TIMEOUT_S)
                seen[f"{kind}:{await _trickle(sock, body, stop)}"] += 1
            else:
                seen[f"{kind}:{await _trickle(sock, head + body, stop)}"] += 1
        except (asyncio.TimeoutError, OSError) as exc:
            seen[f"{kind}:{_label(exc)}"] += 1
        finally:
            sock.close()

    await _until_stopped(stop, [one(kind) for kind in ("headers", "body")
                                for _ in range(scale.slowloris_connections)])
    return seen


async def slow_readers(target: Target, scale: Scale, stop: threading.Event) -> Counter[str]:
    """Long streamed chats read one byte a second (small receive buffers)."""
    body = json.dumps({"model": target.model, "stream": True, "ignore_eos": True,
                       "max_tokens": scale.slow_reader_max_tokens,
                       "messages": [{"role": "user", "content": "tell me a story"}]}).encode()
    request = _request_head(target, "/v1/chat/completions", len(body)) + body
    seen: Counter[str] = Counter()
    loop = asyncio.get_running_loop()

    async def one() -> None:
        try:
            sock = await _connect(target, rcvbuf=1024)
        except (asyncio.TimeoutError, OSError) as exc:
            seen[f"stream:connect_{_label(exc)}"] += 1
            return
        received = b""
        outcome = "open_at_end"
        began = time.monotonic()
        try:
            await asyncio.wait_for(loop.sock_sendall(sock, request), RAW_IO_TIMEOUT_S)
            while not stop.is_set():
                try:
                    got = await asyncio.wait_for(loop.sock_recv(sock, 1), 1.0)
                except asyncio.TimeoutError:
                    continue
                if not got:
                    outcome = f"closed_by_server_after_{int((time.monotonic() - began) // 5 * 5)}s"
                    break
                received += got
                await asyncio.sleep(1.0)
        except (asyncio.TimeoutError, OSError) as exc:
            outcome = _label(exc)
        finally:
            sock.close()
            seen[f"stream:{outcome}"] += 1
            if len(received) >= 12:
                seen[f"stream:status_{_status_of(received)}"] += 1

    await _until_stopped(stop, [one() for _ in range(scale.slow_readers)])
    return seen


async def connection_flood(target: Target, scale: Scale,
                           stop: threading.Event) -> Counter[str]:
    """Thousands of idle connections, opened 100 at a time and held until ``stop``."""
    seen: Counter[str] = Counter()
    socks: list[socket.socket] = []

    async def open_one() -> None:
        try:
            socks.append(await _connect(target))
            seen["opened"] += 1
        except (asyncio.TimeoutError, OSError) as exc:
            seen[f"connect_{_label(exc)}"] += 1

    try:
        for start in range(0, scale.flood_connections, 100):
            if stop.is_set():
                break
            await asyncio.gather(*(open_one() for _ in
                                   range(min(100, scale.flood_connections - start))))
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for sock in socks:
            seen[_idle_state(sock)] += 1
    finally:
        for sock in socks:
            sock.close()
    return seen


def _idle_state(sock: socket.socket) -> str:
    try:
        got = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return "open_at_end"
    except OSError:
        return "reset_by_server"
    return "answered" if got else "closed_by_server"


MIN_SECONDS = {"slowloris": 40.0, "connection_flood": 40.0}
"""The shortest attack phase of the full battery for attacks on connections: long enough
to see a deadline of up to half a minute close them."""

ATTACKS: dict[str, Attack] = {
    "parse_bomb": parse_bomb,
    "batch_uploads": batch_uploads,
    "tokenize_flood": tokenize_flood,
    "slow_readers": slow_readers,
    "huge_model_names": huge_model_names,
    "slowloris": slowloris,
    "connection_flood": connection_flood,
}
"""Every attack, in the order the battery runs them."""


def run_attack(name: str, target: Target, scale: Scale, stop: threading.Event) -> Counter[str]:
    """Run one attack in this thread's own event loop until ``stop``."""
    return asyncio.run(ATTACKS[name](target, scale, stop))
