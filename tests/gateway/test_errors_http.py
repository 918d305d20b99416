"""Every answer of the gateway is JSON in OpenAI's error format, whatever went wrong."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests._servers import free_port
from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_A, GatewayProcess, base_config


def test_405_is_a_request_error(gateway: GatewayProcess) -> None:
    resp = httpx.get(gateway.url + "/v1/completions", headers={"authorization": f"Bearer {KEY_A}"})
    assert resp.status_code == 405
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_a_client_that_drops_while_sending_its_body_is_client_disconnected(gateway: GatewayProcess) -> None:
    url = urlsplit(gateway.url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"authorization: Bearer " + KEY_A.encode() + b"\r\ncontent-length: 100000\r\n\r\n"
                     b'{"model": "fake", "prompt": "')
        time.sleep(0.3)
    rows = gateway.rows(1)
    assert [r.finish_reason for r in rows] == ["client_disconnected"]
    time.sleep(0.2)
    log = gateway.log()
    assert "Traceback" not in log, log


def test_a_refused_connect_to_the_only_engine_is_tried_twice_then_a_503(
        make_gateway: Any, tmp_path: Path) -> None:
    """With no engine listening the client gets a JSON 503 ``engine_unavailable`` with
    ``retry-after``: the pool's last engine is tried twice (one refusal could be
    a blip), then taken out of dispatch (tests/gateway/test_engine_failures_http.py has a
    pool of two)."""
    port = free_port()
    cfg = base_config(f"http://127.0.0.1:{port}", tmp_path / "u.db")
    cfg["engines"][0]["models"] = ["fake"]  # routed without the engine's /v1/models
    gw = make_gateway(cfg)
    resp = httpx.post(gw.url + "/v1/completions", headers={"authorization": f"Bearer {KEY_A}"},
                      json={"model": "fake", "prompt": [1, 2, 3], "max_tokens": 2}, timeout=30)
    assert resp.status_code == 503
    assert resp.json()["error"]["code"] == "engine_unavailable"
    assert resp.headers["retry-after"] == "2"
    assert gw.log().count("refused a connection") == 1
    assert gw.metric("tokenpace_gateway_engine_refused_connections_total",
                     engine=cfg["engines"][0]["url"]) == 2.0


def test_unexpected_errors_are_json_500_with_the_request_id(engine: EngineServer, make_gateway: Any,
                                                            tmp_path: Path) -> None:
    """A body the gateway's own code trips on (a number too large for a float, sent where
    the gateway multiplies with it) is a bug to log, never a plain-text 500."""
    gw = make_gateway(base_config(engine.url, tmp_path / "u.db"))
    resp = httpx.post(gw.url + "/v1/completions", headers={"authorization": f"Bearer {KEY_A}"},
                      json={"model": "fake", "prompt": "hi", "max_tokens": 2, "n": 10 ** 400}, timeout=30)
    if resp.status_code < 500:  # the body validation refused it first: also fine
        assert resp.json()["error"]["type"] == "invalid_request_error"
        return
    assert resp.status_code == 500
    body = resp.json()["error"]
    assert body["code"] == "internal_error" and resp.headers["x-request-id"] in body["message"]
    assert gw.log().count(resp.headers["x-request-id"]) == 1


def test_a_storm_of_abandoned_streams_logs_no_write_warnings(engine: EngineServer, make_gateway: Any,
                                                            tmp_path: Path) -> None:
    """Clients that reset their connection mid-stream are ordinary: each is one
    ``cancelled`` row, its slot is freed, and the log stays quiet (the old relay kept writing
    to the dead socket and asyncio logged "socket.send() raised exception." for each write)."""
    engine.engine.token_delay_s = 0.001
    config = base_config(engine.url, tmp_path / "u.db", max_output_tokens=2000)
    config["engines"][0]["max_inflight"] = 64
    gw = make_gateway(config)
    url = urlsplit(gw.url)
    body = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 2000, "stream": True}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + KEY_A.encode() + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n")

    def abandon() -> None:
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(head + body)
            got = b""
            while got.count(b"data: ") < 3:
                more = sock.recv(65536)
                assert more and b" 200 " in (got + more)[:20], got + more
                got += more
            # close with a reset, as a killed client does, while the gateway is writing
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    threads = [threading.Thread(target=abandon) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = gw.rows(40, timeout_s=60)
    assert {r.finish_reason for r in rows} == {"cancelled"}
    assert gw.wait_metric("tokenpace_gateway_inflight_requests", 0, timeout_s=30, tenant="team-a") == 0
    log = gw.log()
    assert "socket.send() raised exception" not in log and "Traceback" not in log, log[-3000:]
