"""The Batch API's uploads and stores against one real gateway process, as a hostile tenant
would use them: each bound is checked at the source (bytes the client could send before
the refusal, objects the store kept), never by timing.

One gateway for the module (its engine's gate closed: batches stay unfinished); each test
uses tenants of its own, so what one stores does not count against another's bounds.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import GatewayProcess, base_config

MIB = 1024 * 1024
MAX_FILE = 1536 * 1024  # two stored parts
TENANTS = ("flood", "lines", "files", "batches", "bytes", "other", "slots")
BOUNDARY = b"tpgboundary53"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("uploads")
    engine = EngineServer()
    engine.engine.gate = threading.Event()  # lines wait at the engine: batches stay open
    engine.start()
    config = base_config(engine.url, tmp / "usage.db")
    config["tenants"] += [{"id": t, "api_keys": [f"sk-{t}"]} for t in TENANTS]
    config["batch"] = {"max_file_bytes": MAX_FILE, "max_files": 5,
                       "max_batches": 3, "max_stored_bytes": 4 * MIB, "max_uploads": 16,
                       "max_tenant_uploads": 12}
    gateway = GatewayProcess(tmp, config).start()
    yield gateway
    gateway.stop()
    engine.engine.gate.set()
    engine.stop()


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer sk-{tenant}"}


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def _upload_head(tenant: str, filename: str = "in.jsonl") -> bytes:
    """A chunked upload's request head and the multipart up to the file's first byte."""
    head = (b"POST /v1/files HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer sk-" + tenant.encode()
            + b"\r\ncontent-type: multipart/form-data; boundary=" + BOUNDARY
            + b"\r\ntransfer-encoding: chunked\r\n\r\n")
    fields = (b"--" + BOUNDARY + b'\r\ncontent-disposition: form-data; name="purpose"\r\n\r\n'
              b"batch\r\n--" + BOUNDARY + b'\r\ncontent-disposition: form-data; name="file"; '
              b'filename="' + filename.encode() + b'"\r\n\r\n')
    return head + _chunk(fields)


def _upload_tail(content: bytes) -> bytes:
    return _chunk(content + b"\r\n--" + BOUNDARY + b"--\r\n") + b"0\r\n\r\n"


def _response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        got = sock.recv(65536)
        if not got:
            break
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def jsonl(n: int, start: int = 0) -> bytes:
    return "".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 2}}) + "\n" for i in range(start, start + n)).encode()


@pytest.mark.parametrize(("tenant", "line", "code"), [
    ("flood", b"x" * 1023 + b"\n", "file_too_large"),  # 1 KiB lines: the byte bound first
    ("lines", b"ab\n", "too_many_requests"),  # 3-byte lines: the line bound first
])
def test_an_endless_upload_is_refused_once_past_its_bound(gw: GatewayProcess, tenant: str,
                                                          line: bytes, code: str) -> None:
    """An upload without Content-Length that never ends: the refusal comes, and the
    connection closes, while the client has sent at most half of 128 MiB (about the bound
    plus the sockets' buffers, which Linux caps at 36 MiB on loopback); a gateway that reads
    the upload before checking it answers only after all of it, one that answers but
    keeps the connection reads (and drops) all of it."""
    total, piece = 128 * MIB, line * (64 * 1024 // len(line))
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    try:
        sock.sendall(_upload_head(tenant))
        sent = 0
        try:
            while sent < total:
                sock.sendall(_chunk(piece))
                sent += len(piece)
                if select.select([sock], [], [], 0)[0]:
                    break  # the answer came
        except OSError:
            pass  # the gateway closed the connection: it reads nothing more
        status, body = _response(sock)
        closed = False
        try:  # the rest is not read: the gateway closed the connection with its answer
            while sent < total:
                sock.sendall(_chunk(piece))
                sent += len(piece)
        except OSError:
            closed = True
    finally:
        sock.close()
    assert (status, body["error"]["code"]) == ((413, code) if code == "file_too_large"
                                               else (400, code))
    assert closed and sent < total // 2, f"the gateway read {sent} bytes of the upload"
    listed = httpx.get(f"{gw.url}/v1/files", headers=auth(tenant)).json()
    assert listed["data"] == []


def _concurrent(gw: GatewayProcess, heads: list[bytes], tails: list[bytes]) -> list[Any]:
    """Open one connection per request, send each head (the route starts and checks what it
    can before the body), then every tail together; the answers in order."""
    socks = [socket.create_connection(("127.0.0.1", gw.port), timeout=30) for _ in heads]
    try:
        for sock, head in zip(socks, heads, strict=True):
            sock.sendall(head)
        time.sleep(0.5)  # every route has started and checked what it can without the body
        for sock, tail in zip(socks, tails, strict=True):
            sock.sendall(tail)
        return [_response(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def test_concurrent_uploads_keep_exactly_max_files(gw: GatewayProcess) -> None:
    """Twelve uploads that all start while the tenant has no file: five kept (max_files),
    seven refused with 400 too_many_files, whatever their order."""
    content = jsonl(2)
    answers = _concurrent(gw, [_upload_head("files")] * 12, [_upload_tail(content)] * 12)
    assert Counter(status for status, _ in answers) == {200: 5, 400: 7}
    assert {b["error"]["code"] for s, b in answers if s != 200} == {"too_many_files"}
    listed = httpx.get(f"{gw.url}/v1/files", headers=auth("files")).json()
    assert len(listed["data"]) == 5


def test_concurrent_batch_creates_keep_exactly_max_batches(gw: GatewayProcess) -> None:
    """Eight creates sent at once: three batches made (max_batches), five refused with
    429 too_many_batches; a body past 64 KiB is refused with 413 and the connection closed."""
    upload = httpx.post(f"{gw.url}/v1/files", headers=auth("batches"),
                        files={"file": ("in.jsonl", jsonl(1))}, data={"purpose": "batch"})
    assert upload.status_code == 200, upload.text
    body = json.dumps({"input_file_id": upload.json()["id"], "completion_window": "24h",
                       "endpoint": "/v1/chat/completions"}).encode()
    head = (b"POST /v1/batches HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer sk-batches\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
    answers = _concurrent(gw, [head + body[:10]] * 8, [body[10:]] * 8)
    assert Counter(status for status, _ in answers) == {200: 3, 429: 5}
    assert {b["error"]["code"] for s, b in answers if s != 200} == {"too_many_batches"}
    listed = httpx.get(f"{gw.url}/v1/batches", headers=auth("batches")).json()
    assert len(listed["data"]) == 3
    huge = httpx.post(f"{gw.url}/v1/batches", headers=auth("batches"),
                      content=b'{"metadata": "' + b"x" * (256 * 1024) + b'"}')
    assert huge.status_code == 413 and huge.headers["connection"] == "close"


def test_stored_bytes_are_bounded_per_tenant(gw: GatewayProcess) -> None:
    """Files (and outputs) of a tenant stay within max_stored_bytes (4 MiB): an upload that
    would pass it is refused with 400 storage_full, a batch is refused once the tenant is
    at the bound (its output would have no room), a deletion makes room again; a file
    larger than one stored part reads back whole."""
    def upload(size: int, tenant: str = "bytes") -> httpx.Response:
        content = (b"z" * 127 + b"\n") * (size // 128)
        return httpx.post(f"{gw.url}/v1/files", headers=auth(tenant),
                          files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})

    kept = [upload(MAX_FILE) for _ in range(2)]  # 3 MiB
    assert [r.status_code for r in kept] == [200, 200]
    over = upload(MAX_FILE)
    assert over.status_code == 400 and over.json()["error"]["code"] == "storage_full"
    assert "batch.max_stored_bytes" in over.json()["error"]["message"]
    assert upload(MIB).status_code == 200  # exactly 4 MiB
    refused = httpx.post(f"{gw.url}/v1/batches", headers=auth("bytes"), json={
        "input_file_id": kept[0].json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "storage_full"
    assert upload(128, tenant="other").status_code == 200  # another tenant's room is its own
    first = kept[0].json()["id"]
    read = httpx.get(f"{gw.url}/v1/files/{first}/content", headers=auth("bytes"))
    assert read.status_code == 200 and read.content == (b"z" * 127 + b"\n") * (MAX_FILE // 128)
    deleted = httpx.delete(f"{gw.url}/v1/files/{first}", headers=auth("bytes"))
    assert deleted.status_code == 200
    assert upload(MAX_FILE).status_code == 200
    files = httpx.get(f"{gw.url}/v1/files", headers=auth("bytes")).json()["data"]
    assert sum(f["bytes"] for f in files) <= 4 * MIB


def test_a_tenant_reads_at_most_max_tenant_uploads_at_once(gw: GatewayProcess) -> None:
    """max_tenant_uploads (12 in this gateway): a thirteenth upload while twelve are being
    read is refused at once with 429 too_many_uploads and retry-after, before its body;
    the twelve then end as max_files (5) allows."""
    socks = [socket.create_connection(("127.0.0.1", gw.port), timeout=30) for _ in range(12)]
    try:
        for sock in socks:
            sock.sendall(_upload_head("slots"))
        deadline = time.monotonic() + 10
        while True:  # the twelve have started once a thirteenth is refused
            extra = httpx.post(f"{gw.url}/v1/files", headers=auth("slots"),
                               files={"file": ("in.jsonl", jsonl(1))},
                               data={"purpose": "batch"})
            if extra.status_code != 200 or time.monotonic() > deadline:
                break
            httpx.delete(f"{gw.url}/v1/files/{extra.json()['id']}", headers=auth("slots"))
        assert extra.status_code == 429, extra.text
        assert extra.json()["error"]["code"] == "too_many_uploads"
        assert extra.headers["retry-after"] == "1"
        for sock in socks:
            sock.sendall(_upload_tail(jsonl(1)))
        statuses = [_response(sock)[0] for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert sorted(statuses) == [200] * 5 + [400] * 7
