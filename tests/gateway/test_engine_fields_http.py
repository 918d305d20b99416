"""A large body goes to the engine without the top-level fields the engine's OpenAPI
document does not declare (vLLM parses such fields and drops them); small bodies, and
engines without a document, get every field as before. Real gateway process, fake engine."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.gateway._engine import EngineServer, FakeEngine
from tests.gateway.conftest import KEY_B, GatewayProcess, base_config
from tokenpace.gateway.fleet import request_fields

CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "stream",
               "stream_options", "vllm_xargs", "priority", "cache_salt", "temperature"]
OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "paths": {"/v1/chat/completions": {"post": {"requestBody": {"content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/ChatRequest"}}}}}},
        "/health": {"get": {}}},
    "components": {"schemas": {"ChatRequest": {
        "type": "object", "properties": {name: {} for name in CHAT_FIELDS}}}},
}


def _chat(gw: GatewayProcess, **extra: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", timeout=60,
                      headers={"authorization": f"Bearer {KEY_B}"},
                      json={"model": "fake", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}], **extra})


def _learned(engine: FakeEngine, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(path == "/openapi.json" for path, _ in engine.other_calls):
        assert time.monotonic() < deadline, "the gateway never read /openapi.json"
        time.sleep(0.05)
    time.sleep(0.3)  # its answer parsed


def test_a_large_body_loses_only_the_fields_the_engine_does_not_declare(
        make_gateway: Any, tmp_path: Path) -> None:
    server = EngineServer(FakeEngine(openapi=OPENAPI)).start()
    try:
        gw = make_gateway(base_config(server.url, tmp_path / "usage.db"))
        pad = "x" * (100 * 1024)
        # Nothing is asked of the engine until a large body goes to it; that one goes whole.
        time.sleep(2.5)  # a health check or more
        assert not any(path == "/openapi.json" for path, _ in server.engine.other_calls)
        assert _chat(gw, pad=pad).status_code == 200
        assert server.engine.requests[-1].body["pad"] == pad
        _learned(server.engine)
        assert _chat(gw, pad=pad, temperature=0.5).status_code == 200
        assert _chat(gw, pad="small", temperature=0.5).status_code == 200
        large, small = (seen.body for seen in server.engine.requests[-2:])
        assert "pad" not in large and large["temperature"] == 0.5
        assert large["messages"] == [{"role": "user", "content": "hi"}]
        assert "vllm_xargs" in large  # the gateway's own fields are written after the trim
        assert small["pad"] == "small"  # under 64 KiB: sent whole
    finally:
        server.stop()


def test_an_engine_without_a_document_gets_every_field(make_gateway: Any,
                                                      tmp_path: Path) -> None:
    server = EngineServer(FakeEngine()).start()  # /openapi.json: 404
    try:
        gw = make_gateway(base_config(server.url, tmp_path / "usage.db"))
        assert _chat(gw, pad="x" * (100 * 1024)).status_code == 200
        _learned(server.engine)
        assert _chat(gw, pad="x" * (100 * 1024)).status_code == 200
        assert server.engine.requests[-1].body["pad"] == "x" * (100 * 1024)
    finally:
        server.stop()


def test_request_fields_follow_refs_and_unions_and_skip_what_they_cannot_read() -> None:
    document = {
        "paths": {
            "/a": {"post": {"requestBody": {"content": {"application/json": {"schema": {
                "anyOf": [{"$ref": "#/components/schemas/A"},
                          {"$ref": "#/components/schemas/B"}]}}}}}},
            "/b": {"post": {"requestBody": {"content": {"application/json": {"schema": {
                "anyOf": [{"$ref": "#/components/schemas/A"}, {"type": "object"}]}}}}}},
            "/c": {"post": {}},
            "/d": {"get": {}},
        },
        "components": {"schemas": {"A": {"properties": {"x": {}, "y": {}}},
                                   "B": {"properties": {"z": {}}}}},
    }
    assert request_fields(document) == {"/a": frozenset({"x", "y", "z"})}
    assert request_fields({}) == {}
