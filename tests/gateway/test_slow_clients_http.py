"""Slow clients against a real gateway process: headers and bodies sent a byte a second are
cut at their deadlines while another tenant is served; beyond ``max_connections`` a
request is answered 503; a client that does not read its stream does not keep the
engine's slot once the engine's answer is complete."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.gateway._engine import EngineServer, FakeEngine
from tests.gateway.conftest import KEY_A, KEY_B

CHAT = {"model": "fake", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _config(engine_url: str, ledger: Path, **top: Any) -> dict[str, Any]:
    return {
        "engines": [{"url": engine_url, "max_inflight": 2}],
        "ledger": f"sqlite:///{ledger}",
        "tenants": [{"id": "team-a", "api_keys": [KEY_A]},
                    {"id": "team-b", "api_keys": [KEY_B]}],
        **top,
    }


def _served(url: str, key: str = KEY_B, stream: bool = False) -> int:
    resp = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30,
                      headers={"authorization": f"Bearer {key}"})
    return resp.status_code


def _read_answer(sock: socket.socket, limit_s: float, until: bytes | None = None
                 ) -> tuple[bytes, bool]:
    """What the gateway sent on ``sock`` until it closed it (True), ``until`` ended it, or
    ``limit_s`` passed."""
    sock.settimeout(0.2)
    got = bytearray()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not (until and got.endswith(until)):
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return bytes(got), True
        if not data:
            return bytes(got), True
        got += data
    return bytes(got), False


class Trickle(threading.Thread):
    """Sends ``data`` one byte a second on ``sock`` until it is sent or the peer closes."""

    def __init__(self, sock: socket.socket, data: bytes) -> None:
        super().__init__(daemon=True)
        self.sock, self.data, self.sent = sock, data, 0
        self.stop = threading.Event()

    def run(self) -> None:
        for byte in self.data:
            if self.stop.is_set():
                return
            try:
                self.sock.send(bytes([byte]))
            except OSError:
                return
            self.sent += 1
            self.stop.wait(1.0)


def test_headers_and_bodies_a_byte_a_second_are_cut_while_another_tenant_is_served(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    gw = make_gateway(_config(engine.url, tmp_path / "usage.db", header_timeout="2s",
                              body_timeout="2s", body_min_rate=1024))
    host, port = "127.0.0.1", gw.port
    headers = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
               f"authorization: Bearer {KEY_A}\r\ncontent-type: application/json\r\n"
               f"content-length: 200\r\n\r\n").encode()
    # A slowloris on the headers, and one whose headers arrive whole and body a byte a second.
    on_headers = socket.create_connection((host, port))
    on_body = socket.create_connection((host, port))
    on_body.sendall(headers)
    trickles = [Trickle(on_headers, headers), Trickle(on_body, b"{" + b" " * 199)]
    for t in trickles:
        t.start()
    try:
        # The other tenant is served meanwhile.
        assert [_served(gw.url) for _ in range(3)] == [200, 200, 200]
        for sock, trickle, what in ((on_headers, trickles[0], "headers"),
                                    (on_body, trickles[1], "body")):
            answer, closed = _read_answer(sock, limit_s=15)
            assert closed, f"the {what} slowloris was not cut"
            assert answer.startswith(b"HTTP/1.1 408"), answer
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "request_timeout" and what in error["message"]
            # Cut long before it was done: a 2 s deadline against 75 and 200 seconds.
            assert trickle.sent < 20, (what, trickle.sent)
    finally:
        for t in trickles:
            t.stop.set()
        on_headers.close()
        on_body.close()
    # The body's request got past authentication: its ledger row says how it ended.
    rows = [r for r in gw.rows(4) if r.tenant == "team-a"]
    assert [r.finish_reason for r in rows] == ["client_disconnected"]
    assert _served(gw.url, KEY_A) == 200


def test_beyond_max_connections_idle_ones_make_room_and_requests_under_way_get_503(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    gw = make_gateway(_config(engine.url, tmp_path / "usage.db", max_connections=3))
    # Three connections that send nothing (a flood's): a request still gets in, in the
    # place of the one idle the longest, which is closed.
    idle = [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(3)]
    try:
        assert _served(gw.url) == 200
        _, closed = _read_answer(idle[0], limit_s=10)
        assert closed
    finally:
        for sock in idle:
            sock.close()
    # Three connections with a request under way (headers whole, body not yet): a new
    # connection's request is answered 503.
    busy = [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(3)]
    try:
        for sock in busy:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         + f"authorization: Bearer {KEY_A}\r\n".encode()
                         + b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{")
        time.sleep(0.5)  # the server reads them (should it not yet, they are idle: 200)
        resp = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=30,
                          headers={"authorization": f"Bearer {KEY_B}"})
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "too_many_connections"
        assert resp.headers["retry-after"] == "1"
        assert len(engine.engine.requests) == 1  # the first request's, not this one's
    finally:
        for sock in busy:
            sock.close()
    deadline = time.monotonic() + 10
    while _served(gw.url) != 200:
        assert time.monotonic() < deadline, "the gateway did not take connections again"
        time.sleep(0.1)


def _open_unread_stream(port: int, key: str, max_tokens: int) -> socket.socket:
    """A streamed request on a socket with a small receive buffer that is then not read."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({**CHAT, "max_tokens": max_tokens, "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                 + f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n"
                   f"content-length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_clients_that_do_not_read_their_streams_do_not_keep_engine_slots(
        make_gateway: Any, tmp_path: Path) -> None:
    fake = FakeEngine(token_delay_s=0.0)
    engine = EngineServer(fake).start()
    try:
        # Each answer is kept whole in the gateway's memory.
        gw = make_gateway(_config(engine.url, tmp_path / "usage.db",
                                  stream_buffer_bytes=16 << 20,
                                  tenant_stream_buffer_bytes=64 << 20))
        # About 6.5 MB of events each: more than the sockets' buffers between the engine
        # and a client that does not read hold (the engine stalls at about 43,000 tokens
        # here when the gateway waits for the client).
        max_tokens = 50_000
        readers = [_open_unread_stream(gw.port, KEY_A, max_tokens) for _ in range(3)]
        try:
            # Three streams on an engine of two slots: all three ran to their end in the
            # engine while none of their clients read a byte.
            deadline = time.monotonic() + 60
            while sum(s.finished for s in fake.requests) < 3:
                assert time.monotonic() < deadline, (
                    f"engine finished {sum(s.finished for s in fake.requests)} of 3 streams "
                    f"(active {fake.active}): slow readers keep their slots")
                time.sleep(0.05)
            assert fake.active == 0
            assert gw.wait_metric("tokenpace_gateway_inflight_requests", 0, tenant="team-a") == 0
            # The other tenant gets a slot at once.
            assert _served(gw.url) == 200
            rows = gw.rows(4)
            a_rows = [r for r in rows if r.tenant == "team-a"]
            assert len(a_rows) == 3 and all(r.completion_tokens == max_tokens for r in a_rows)
            # Then each client reads its whole answer, from the gateway's memory.
            for sock in readers:
                answer, _ = _read_answer(sock, limit_s=30, until=b"\r\n0\r\n\r\n")
                assert b"data: [DONE]" in answer, answer[-200:]
                assert answer.count(b'"delta"') == max_tokens
        finally:
            for sock in readers:
                sock.close()
    finally:
        engine.stop()

