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


def test_the_guard_notes_each_ended_exchange_and_the_route_tells_it() -> None:
    """Each JSON POST's ``x-request-id`` is noted once its exchange ended (answered, or
    cancelled as a client that leaves cancels it); ``/tokenpace/v1/aborted`` with an
    ``exchange`` says whether it had ended before the scheduler was asked."""
    from types import SimpleNamespace

    from tokenpace.engine._aborted import ABORTED_PATH, ENDED_EXCHANGES

    asked_when: list[bool] = []

    class Core:
        async def call_utility_async(self, method: str, ids: list[str]) -> dict:
            asked_when.append("gw-left" in ENDED_EXCHANGES)
            return {"output_tokens": {}, "prompt_tokens": {}, "running": []}

    class Slow:
        async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
            await receive()
            await asyncio.sleep(30)  # still rendering the prompt when the client leaves

    app_state = SimpleNamespace(state=SimpleNamespace(
        engine_client=SimpleNamespace(engine_core=Core())))

    async def go() -> None:
        answered = RequestGuard(_Echo())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=answered),
                                     base_url="http://engine") as client:
            await client.post("/v1/completions", content=b'{"prompt": "x"}',
                              headers={"content-type": "application/json",
                                       "x-request-id": "gw-answered"})
        assert "gw-answered" in ENDED_EXCHANGES
        slow = RequestGuard(Slow())
        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"content-type", b"application/json"),
                             (b"x-request-id", b"gw-left")]}

        async def receive() -> dict:
            return {"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}

        async def send(message: dict) -> None:
            pass

        task = asyncio.ensure_future(slow(scope, receive, send))
        await asyncio.sleep(0.05)
        assert "gw-left" not in ENDED_EXCHANGES, "still being served"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert "gw-left" in ENDED_EXCHANGES
        route = RequestGuard(_Echo())
        for exchange, expected in (("gw-left", True), ("gw-never", False), (None, None)):
            body: dict[str, Any] = {"request_ids": ["cmpl-gw-left-0"]}
            if exchange is not None:
                body["exchange"] = exchange
            sent: list[dict] = []
            route_scope = {"type": "http", "method": "POST", "path": ABORTED_PATH,
                           "headers": [(b"content-type", b"application/json")],
                           "app": app_state}

            async def route_receive(body: dict = body) -> dict:
                return {"type": "http.request", "body": json.dumps(body).encode(),
                        "more_body": False}

            async def route_send(message: dict) -> None:
                sent.append(message)

            await route(route_scope, route_receive, route_send)
            assert sent[0]["status"] == 200
            answer = json.loads(sent[1]["body"])
            assert answer.get("exchange_ended") == expected, (exchange, answer)
        assert asked_when[0] is True, "noted before the scheduler was asked"

    asyncio.run(go())


def test_an_id_sent_again_is_not_ended_while_its_second_exchange_is_under_way() -> None:
    from tokenpace.engine._aborted import EndedExchanges

    book = EndedExchanges(keep=2)
    book.begin("a")
    assert "a" not in book
    book.end("a")
    assert "a" in book
    book.begin("a")  # the same id again (a retry to the same engine)
    assert "a" not in book
    book.end("a")
    assert "a" in book
    for other in ("b", "c"):
        book.begin(other)
        book.end(other)
    assert "a" not in book and "b" in book and "c" in book  # the oldest forgotten
