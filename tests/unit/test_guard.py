"""The HTTP guard: 400 for bodies pacing cannot serve, everything else untouched."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tokenpace.engine._guard import RequestGuard, RequestRefused, check_request_body

USER = "vllm_xargs.output_rate_user"
RATE = "vllm_xargs.output_rate_tokens_per_second"


def _rate(value: Any) -> dict:
    return {"vllm_xargs": {"output_rate_user": "alice", "output_rate_tokens_per_second": value}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"vllm_xargs": {"output_rate_user": ""}}, USER),
        ({"vllm_xargs": {"output_rate_user": None}}, USER),
        ({"vllm_xargs": {"output_rate_user": 7}}, USER),
        ({"vllm_xargs": {"output_rate_user": ["a"]}}, USER),
        ({"vllm_xargs": {"output_rate_user": "u" * 257}}, USER),
        (_rate("100"), RATE),
        (_rate(True), RATE),
        (_rate(None), RATE),
        (_rate([100]), RATE),
        (_rate(0), RATE),
        (_rate(-5), RATE),
        (_rate(float("inf")), RATE),
        (_rate(float("nan")), RATE),
        (_rate(10**400), RATE),
        ({"vllm_xargs": {"output_rate_tokens_per_second": 0}}, RATE),
        ({"vllm_xargs": {"output_rate_end_user": ""}}, "vllm_xargs.output_rate_end_user"),
        ({"vllm_xargs": {"output_rate_end_user": 5}}, "vllm_xargs.output_rate_end_user"),
        ({"vllm_xargs": {"output_rate_end_user": "e" * 257}}, "vllm_xargs.output_rate_end_user"),
        ({"vllm_xargs": {"output_rate_end_user_tokens_per_second": -1}},
         "vllm_xargs.output_rate_end_user_tokens_per_second"),
        ({"vllm_xargs": {"output_rate_end_user_tokens_per_second": "5"}},
         "vllm_xargs.output_rate_end_user_tokens_per_second"),
        ({"vllm_xargs": {"output_rate_application": ""}}, "vllm_xargs.output_rate_application"),
        ({"vllm_xargs": {"output_rate_application": ["bot"]}},
         "vllm_xargs.output_rate_application"),
        ({"vllm_xargs": {"output_rate_application_tokens_per_second": 0}},
         "vllm_xargs.output_rate_application_tokens_per_second"),
        ({"vllm_xargs": {"output_rate_application_tokens_per_second": float("nan")}},
         "vllm_xargs.output_rate_application_tokens_per_second"),
        ({"vllm_xargs": {"output_rate_application_end_user_tokens_per_second": True}},
         "vllm_xargs.output_rate_application_end_user_tokens_per_second"),
    ],
)
def test_refused_bodies_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(RequestRefused) as err:
        check_request_body(body)
    assert err.value.param == param


@pytest.mark.parametrize(
    "body",
    [
        {"use_beam_search": False},
        {"vllm_xargs": {"output_rate_user": "u" * 256}},
        {"vllm_xargs": {"other": 1}},
        _rate(1),
        _rate(2.5),
        _rate(1e6),
        {"vllm_xargs": {"output_rate_tokens_per_second": 50}},  # the engine decides on trust
        {"vllm_xargs": {"output_rate_end_user": "alice",
                        "output_rate_end_user_tokens_per_second": 4.5}},
        {"vllm_xargs": "not an object: vLLM's own validation answers this"},
        [1, 2],
        "text",
    ],
)
def test_accepted_bodies(body: Any) -> None:
    check_request_body(body)


class _Echo:
    """Downstream app: answers with the exact bytes it received."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


def _post(content: bytes, content_type: str = "application/json",
          method: str = "POST") -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=RequestGuard(_Echo()))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
            return await c.request(method, "/v1/completions", content=content,
                                   headers={"content-type": content_type})

    return asyncio.run(go())


def test_good_body_reaches_the_app_byte_for_byte() -> None:
    raw = json.dumps({"prompt": "hé", "vllm_xargs": {"output_rate_user": "alice"}}).encode()
    resp = _post(raw, "application/json; charset=utf-8")
    assert resp.status_code == 200 and resp.content == raw


def test_bad_body_gets_an_openai_style_400() -> None:
    resp = _post(json.dumps({"use_beam_search": True}).encode())
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "use_beam_search" and error["code"] == 400
    assert error["type"] == "BadRequestError" and "beam search" in error["message"]


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b'{"broken": ', "application/json"),
        (b"\xff\xfe", "application/json"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json"),
        (b'{"use_beam_search": true}', "text/plain"),
    ],
)
def test_what_the_guard_cannot_read_goes_to_vllm_unchanged(content: bytes, content_type: str) -> None:
    resp = _post(content, content_type)
    assert resp.status_code == 200 and resp.content == content


@pytest.mark.parametrize("raw", [b"NaN", b"1e999", b"-1", b"0", b"true", b'"100"'])
def test_malformed_rate_gets_a_400_naming_the_field(raw: bytes) -> None:
    body = b'{"prompt": "x", "vllm_xargs": {"output_rate_tokens_per_second": ' + raw + b"}}"
    resp = _post(body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == RATE and RATE in error["message"]


def test_other_methods_pass() -> None:
    resp = _post(b"", method="GET")
    assert resp.status_code == 200
