"""The streaming relay over real HTTP: event bytes as the engine wrote them, usage counted
over every choice."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_A, GatewayProcess, base_config

SEPARATORS = "\u0085\u2028\u2029"


def raw_events(url: str, path: str, body: dict[str, Any]) -> list[bytes]:
    """The ``data:`` payloads of a stream, split on LF only (the SSE framing vLLM uses)."""
    resp = httpx.post(url + path, json=body, headers={"authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert resp.status_code == 200, resp.text
    return [line[6:] for line in resp.content.split(b"\n") if line.startswith(b"data: ")]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_events_are_byte_identical_to_the_engines(
        kind: str, gateway: GatewayProcess, engine: EngineServer) -> None:
    """Text with U+0085, U+2028, U+2029 unescaped (as vLLM writes them), each event cut by
    the engine inside a multi-byte character: the client gets the engine's bytes."""
    if kind == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "UNICODE"}]}
    else:
        path, body = "/v1/completions", {"prompt": "UNICODE"}
    body.update(model="fake", max_tokens=4, stream=True)
    direct = raw_events(engine.url, path, body)
    through = raw_events(gateway.url, path, body)
    assert len(direct) == 5 and direct[-1] == b"[DONE]"
    for sep in SEPARATORS:
        assert sep.encode() in direct[0]
    assert through == direct


def test_an_abandoned_multi_choice_stream_is_charged_every_choices_tokens(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    """n=4: vLLM's continuous usage counts one choice per chunk; the charge is the sum."""
    gw = make_gateway(base_config(engine.url, tmp_path / "u.db"))
    received = 0
    with httpx.stream("POST", gw.url + "/v1/completions", headers={"authorization": f"Bearer {KEY_A}"},
                      json={"model": "fake", "prompt": "SLOW", "max_tokens": 60, "n": 4,
                            "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                received += 1
                if received == 24:
                    break
    seen = engine.engine.requests[-1]
    deadline = time.monotonic() + 5
    while not seen.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert seen.aborted
    rows = gw.rows(1)
    assert rows[0].finish_reason == "cancelled"
    # within one token per choice of what the engine generated
    assert seen.streamed - 4 <= rows[0].completion_tokens <= seen.streamed
    assert rows[0].completion_tokens >= 24


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SLOW"}]}),
    ("/v1/completions", {"prompt": "SLOW"}),
])
def test_a_stream_cut_short_is_charged_the_engines_count_not_what_it_relayed(
        engine: EngineServer, make_gateway: Any, tmp_path: Path, path: str,
        body: dict[str, Any]) -> None:
    """The engine generated 5 tokens more than it sent before its abort landed
    (``book_extra``): the row charges the engine's count, asked of it after the cut."""
    engine.engine.book_extra = 5
    gw = make_gateway(base_config(engine.url, tmp_path / "u.db"))
    received = 0
    with httpx.stream("POST", gw.url + path, headers={"authorization": f"Bearer {KEY_A}"},
                      json={"model": "fake", "max_tokens": 60, "stream": True, **body}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                received += 1
                if received == 6:
                    break
    [row] = gw.rows(1)
    seen = engine.engine.requests[-1]
    assert seen.aborted and row.finish_reason == "cancelled"
    assert row.completion_tokens == seen.streamed + 5 < 60
    assert engine.engine.book_calls >= 1


def test_a_plain_request_cut_short_is_charged_the_engines_count_not_its_reservation(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    """``request_timeout`` cuts a non-streamed request: nothing arrived, and the engine's
    count (asked of it) is charged, not the reservation of 30; behind an engine that
    cannot tell (404), the reservation."""
    config = base_config(engine.url, tmp_path / "u.db")
    config["request_timeout"] = "400ms"
    gw = make_gateway(config)
    body = {"model": "fake", "prompt": "SLOW", "max_tokens": 30}
    engine.engine.book_extra = 2
    assert post(gw, body).status_code == 504
    [asked] = gw.rows(1)  # settled once the engine answered
    engine.engine.book_extra = None
    assert post(gw, body).status_code == 504
    _, plain = gw.rows(2)
    assert [asked.finish_reason, plain.finish_reason] == ["timeout", "timeout"]
    first = engine.engine.requests[0]
    assert first.aborted and asked.completion_tokens == first.streamed + 2 < 30
    assert plain.completion_tokens == 30
    assert gw.wait_metric("tokenpace_gateway_inflight_requests", 0, tenant="team-a") == 0


def post(gw: GatewayProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.url + "/v1/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {KEY_A}"})
