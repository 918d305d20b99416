"""The gateway's hot-path client to the engines (``_upstream``), against real sockets.

The server is a scripted HTTP/1.1 server in the test's own event loop: each test says what
it answers, and it records the connections it accepted, the requests it read and the
connections its peer closed, which is what the client's pooling, aborts and retries are
judged by.
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests._servers import free_port
from tokenpace.gateway.engines import ConnectFailed, Upstream, UpstreamError, _upstream

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]
HEADERS = {"content-type": "application/json", "x-request-id": "r1"}


class Script:
    """A real server: ``handler(request, writer)`` answers each request."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_peer = 0
        self.server: asyncio.Server | None = None
        self.port = 0
        self.reader: asyncio.StreamReader | None = None  # the connection being answered

    async def __aenter__(self) -> Script:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                self.reader = reader
                await self.handler(request, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_peer += 1
        finally:
            writer.close()


def chunked(*events: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def answer_json(request: bytes, writer: asyncio.StreamWriter) -> None:
    body = b'{"ok": true}'
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(body), body))
    await writer.drain()


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())


def test_a_request_is_sent_as_written_and_its_answer_read_whole() -> None:
    async def main() -> None:
        async with Script(answer_json) as server:
            upstream = Upstream(server.url, 8, 2.0, headers={"authorization": "Bearer engine-key"})
            resp = await upstream.post("/v1/completions", b'{"prompt": "hi"}', HEADERS)
            assert resp.status == 200
            assert resp.headers["content-type"] == "application/json"
            assert await resp.read() == b'{"ok": true}'
            resp.release()
            request = server.requests[0]
            assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
            assert b"\r\nauthorization: Bearer engine-key\r\n" in request
            assert b"\r\nx-request-id: r1\r\n" in request
            assert b"\r\ncontent-length: 16\r\n" in request
            assert request.endswith(b'\r\n\r\n{"prompt": "hi"}')
            await upstream.close()
    run(main)


def test_connections_are_kept_alive_and_reused() -> None:
    async def main() -> None:
        async with Script(answer_json) as server:
            upstream = Upstream(server.url, 8, 2.0)
            for _ in range(5):
                resp = await upstream.post("/v1/completions", b"{}", HEADERS)
                await resp.read()
                resp.release()
            assert server.connections == 1 and len(server.requests) == 5
            await upstream.close()
    run(main)


def test_an_idle_connection_older_than_keepalive_is_not_reused() -> None:
    async def main() -> None:
        async with Script(answer_json) as server:
            upstream = Upstream(server.url, 8, 0.05)
            for _ in range(2):
                resp = await upstream.post("/v1/completions", b"{}", HEADERS)
                await resp.read()
                resp.release()
                await asyncio.sleep(0.1)
            assert server.connections == 2
            await upstream.close()
    run(main)


def test_a_stream_is_read_as_it_arrives_and_the_connection_reused_after_its_end() -> None:
    release_rest = asyncio.Event()

    async def stream(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD + chunked(b"data: 1\n\n"))
        await writer.drain()
        await release_rest.wait()
        writer.write(chunked(b"data: 2\n\n", b"data: [DONE]\n\n"))
        await writer.drain()
        await asyncio.sleep(0.05)  # the terminator comes after the reader is done
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        async with Script(stream) as server:
            upstream = Upstream(server.url, 8, 2.0)
            resp = await upstream.post("/v1/completions", b"{}", HEADERS)
            assert await resp.chunk() == b"data: 1\n\n"  # before the rest was written
            release_rest.set()
            got = b""
            while b"[DONE]" not in got:
                got += await resp.chunk()
            assert got == b"data: 2\n\ndata: [DONE]\n\n"
            resp.release()  # before the chunked terminator arrived
            await asyncio.sleep(0.2)
            release_rest.clear()
            resp = await upstream.post("/v1/completions", b"{}", HEADERS)
            assert await resp.chunk() == b"data: 1\n\n"
            assert server.connections == 1  # the released connection was reused
            resp.close()
            await upstream.close()
    run(main)


def test_close_mid_stream_closes_the_connection_so_the_engine_aborts() -> None:
    async def endless(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD)
        while True:
            writer.write(chunked(b"data: x\n\n"))
            await writer.drain()
            await asyncio.sleep(0.01)

    async def main() -> None:
        async with Script(endless) as server:
            upstream = Upstream(server.url, 8, 2.0)
            resp = await upstream.post("/v1/completions", b"{}", HEADERS)
            await resp.chunk()
            resp.close()
            for _ in range(100):
                if server.closed_by_peer:
                    break
                await asyncio.sleep(0.01)
            assert server.closed_by_peer == 1
            await upstream.close()
    run(main)


def test_a_post_cancelled_before_the_head_closes_its_connection() -> None:
    async def main() -> None:
        async def never(request: bytes, writer: asyncio.StreamWriter) -> None:
            assert server.reader is not None
            await server.reader.read()  # returns (b"") when the client closes
            raise ConnectionResetError

        async with Script(never) as server:
            upstream = Upstream(server.url, 8, 2.0)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await upstream.post("/v1/completions", b"{}", HEADERS)
            for _ in range(100):
                if server.closed_by_peer:
                    break
                await asyncio.sleep(0.01)
            assert server.closed_by_peer == 1 and len(server.requests) == 1
            assert upstream._open == 0  # its place in the pool was given back
            await upstream.close()
    run(main)


def test_an_engine_that_drops_the_connection_mid_body_fails_the_read() -> None:
    async def drop(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD + chunked(b"data: 1\n\n"))
        await writer.drain()
        writer.transport.abort()

    async def main() -> None:
        async with Script(drop) as server:
            upstream = Upstream(server.url, 8, 2.0)
            resp = await upstream.post("/v1/completions", b"{}", HEADERS)
            assert await resp.chunk() == b"data: 1\n\n"
            with pytest.raises(UpstreamError):
                while await resp.chunk():
                    pass
            resp.close()
            assert upstream._open == 0
            await upstream.close()
    run(main)


def test_a_malformed_answer_is_an_upstream_error() -> None:
    async def garbage(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        async with Script(garbage) as server:
            upstream = Upstream(server.url, 8, 2.0)
            with pytest.raises(UpstreamError):
                await upstream.post("/v1/completions", b"{}", HEADERS)
            await upstream.close()
    run(main)


def test_requests_beyond_max_connections_wait_for_a_free_one() -> None:
    gate = asyncio.Event()

    async def held(request: bytes, writer: asyncio.StreamWriter) -> None:
        await gate.wait()
        await answer_json(request, writer)

    async def main() -> None:
        async with Script(held) as server:
            upstream = Upstream(server.url, 2, 2.0)

            async def one() -> bytes:
                resp = await upstream.post("/v1/completions", b"{}", HEADERS)
                body = await resp.read()
                resp.release()
                return body

            tasks = [asyncio.create_task(one()) for _ in range(3)]
            await asyncio.sleep(0.1)
            assert server.connections == 2 and len(server.requests) == 2
            gate.set()
            assert await asyncio.gather(*tasks) == [b'{"ok": true}'] * 3
            assert server.connections == 2  # the third reused a released connection
            await upstream.close()
    run(main)


def test_a_failed_connect_raises_at_once_and_sends_nothing() -> None:
    """Nothing was sent: the gateway sends the request to another engine of its pool, not
    to this one again; the next call connects anew."""
    class FirstConnectRefused(Upstream):
        """The first connect goes to a port nothing listens on: a real refusal."""

        attempts = 0

        async def _acquire(self, fresh: bool = False) -> _upstream._Connection:
            self.attempts += 1
            if self.attempts == 1:
                port, self._port = self._port, free_port()
                try:
                    return await super()._acquire(fresh)
                finally:
                    self._port = port
            return await super()._acquire(fresh)

    async def main() -> None:
        async with Script(answer_json) as server:
            upstream = FirstConnectRefused(server.url, 8, 2.0)
            with pytest.raises(ConnectFailed):
                await upstream.post("/v1/completions", b"{}", HEADERS)
            assert upstream.attempts == 1 and not server.requests
            resp = await upstream.post("/v1/completions", b"{}", HEADERS)
            assert await resp.read() == b'{"ok": true}'
            resp.release()
            assert upstream.attempts == 2 and len(server.requests) == 1
            await upstream.close()
    run(main)


def closing_on(nth: int, answer_first: bytes = b"") -> Handler:
    """Answers each connection's requests, except its ``nth`` (1-based): to that one it
    writes ``answer_first`` (maybe nothing) and closes, as an engine whose keep-alive
    timer fired as the request arrived would (with nothing written)."""
    seen: dict[int, int] = {}

    async def handler(request: bytes, writer: asyncio.StreamWriter) -> None:
        count = seen[id(writer)] = seen.get(id(writer), 0) + 1
        if count == nth:
            writer.write(answer_first)
            await writer.drain()
            writer.close()
            return
        await answer_json(request, writer)
    return handler


def test_a_kept_alive_connection_closed_unanswered_is_retried_on_a_new_one() -> None:
    async def main() -> None:
        async with Script(closing_on(2)) as server:
            upstream = Upstream(server.url, 8, 2.0)
            for _ in range(2):
                resp = await upstream.post("/v1/completions", b"{}", HEADERS)
                assert await resp.read() == b'{"ok": true}'
                resp.release()
            # the second request: written on the kept-alive connection, closed unanswered,
            # answered on a new connection
            assert server.connections == 2 and len(server.requests) == 3
            await upstream.close()
    run(main)


def test_a_new_connection_closed_unanswered_is_not_retried() -> None:
    async def main() -> None:
        async with Script(closing_on(1)) as server:
            upstream = Upstream(server.url, 8, 2.0)
            with pytest.raises(UpstreamError) as raised:
                await upstream.post("/v1/completions", b"{}", HEADERS)
            assert not isinstance(raised.value, _upstream.StaleConnection)
            assert server.connections == 1 and len(server.requests) == 1
            await upstream.close()
    run(main)


def test_a_kept_alive_connection_closed_after_a_byte_of_answer_is_not_retried() -> None:
    async def main() -> None:
        async with Script(closing_on(2, b"HTTP/1.1 200")) as server:
            upstream = Upstream(server.url, 8, 2.0)
            resp = await upstream.post("/v1/completions", b"{}", HEADERS)
            await resp.read()
            resp.release()
            with pytest.raises(UpstreamError) as raised:
                await upstream.post("/v1/completions", b"{}", HEADERS)
            assert not isinstance(raised.value, _upstream.StaleConnection)
            assert server.connections == 1 and len(server.requests) == 2
            await upstream.close()
    run(main)


def test_no_engine_at_all_is_a_connect_failure() -> None:
    async def main() -> None:
        upstream = Upstream(f"http://127.0.0.1:{free_port()}", 8, 2.0)
        with pytest.raises(ConnectFailed):
            await upstream.post("/v1/completions", b"{}", HEADERS)
        assert upstream._open == 0
        await upstream.close()
    run(main)


def test_reading_pauses_while_the_relay_lags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_upstream, "HIGH_WATER", 64 * 1024)
    piece = b"x" * 16384

    async def big(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (64 * len(piece)))
        for _ in range(64):
            writer.write(piece)
            await writer.drain()

    async def main() -> None:
        async with Script(big) as server:
            upstream = Upstream(server.url, 8, 2.0)
            resp = await upstream.post("/v1/completions", b"{}", HEADERS)
            await asyncio.sleep(0.3)  # the server writes while nobody reads
            conn = resp._conn
            assert conn._paused and conn._buffered < 64 * len(piece)
            assert len(await resp.read()) == 64 * len(piece)
            resp.release()
            await upstream.close()
    run(main)


def test_headers_that_would_split_the_request_are_refused() -> None:
    with pytest.raises(ValueError, match="line breaks"):
        Upstream("http://127.0.0.1:1", 8, 2.0, headers={"authorization": "Bearer x\r\nevil: 1"})
    with pytest.raises(ValueError, match="http"):
        Upstream("ftp://127.0.0.1:1", 8, 2.0)


def test_an_https_engine_is_reached_over_tls(tmp_path: Path) -> None:
    """A certificate made for the test (openssl), trusted by the client's context alone."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    client_side = ssl.create_default_context(cafile=str(cert))

    async def main() -> None:
        server = Script(answer_json)
        server.server = await asyncio.start_server(server._serve, "127.0.0.1", 0, ssl=server_side)
        server.port = server.server.sockets[0].getsockname()[1]
        try:
            url = f"https://127.0.0.1:{server.port}"
            upstream = Upstream(url, 8, 2.0, ssl_context=client_side)
            resp = await upstream.post("/v1/completions", b"{}", HEADERS)
            assert resp.status == 200 and await resp.read() == b'{"ok": true}'
            resp.release()
            await upstream.close()
            untrusting = Upstream(url, 8, 2.0)  # the system's roots do not know the test's cert
            with pytest.raises(ConnectFailed):
                await untrusting.post("/v1/completions", b"{}", HEADERS)
            await untrusting.close()
        finally:
            server.server.close()
    run(main)


def test_fetch_reads_a_whole_answer_and_reuses_the_connection() -> None:
    async def main() -> None:
        async with Script(answer_json) as server:
            upstream = Upstream(server.url, 8, 2.0)
            for _ in range(3):
                status, headers, body = await upstream.fetch("GET", "/metrics", 5.0)
                assert (status, headers["content-type"], body) == (200, "application/json",
                                                                   b'{"ok": true}')
            assert server.connections == 1
            assert server.requests[0].startswith(b"GET /metrics HTTP/1.1\r\n")
            await upstream.close()
    run(main)


def test_fetch_times_out_and_closes_its_connection_and_is_not_retried(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async def never(request: bytes, writer: asyncio.StreamWriter) -> None:
            assert server.reader is not None
            await server.reader.read()
            raise ConnectionResetError

        async with Script(never) as server:
            upstream = Upstream(server.url, 8, 2.0)
            with pytest.raises(TimeoutError):
                await upstream.fetch("GET", "/health", 0.1)
            assert upstream._open == 0
        nobody = Upstream(f"http://127.0.0.1:{free_port()}", 8, 2.0)
        with pytest.raises(ConnectFailed):
            await nobody.fetch("GET", "/health", 5.0)
    run(main)
    assert "retrying once" not in caplog.text  # the next periodic call is the retry
