"""What the gateway asks an engine for a request cut short (``gateway.relay._counts``),
against an engine route simulated in process: the API server's ids of each route's
engine requests, the sums, the waits and the shape found from the engine's answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tokenpace.engine import ABORTED_PATH
from tokenpace.engine._aborted import MAX_IDS_PER_CALL
from tokenpace.gateway.relay import ask_engine_counts
from tokenpace.gateway.relay import _counts
from tokenpace.gateway.relay._counts import engine_request_ids


class Book:
    """The engine's side: ended requests' (prompt, output), running ids; ``after``: the
    calls after which the requests in ``later`` end (as an abort landing does)."""

    def __init__(self, ended: dict[str, tuple[int, int]], running: tuple[str, ...] = (),
                 later: dict[str, tuple[int, int]] | None = None, after: int = 0,
                 with_prompts: bool = True, exchanges_ended: tuple[str, ...] = ()) -> None:
        self.ended, self.running = dict(ended), set(running)
        self.later, self.after, self.with_prompts = later or {}, after, with_prompts
        self.exchanges_ended = set(exchanges_ended)
        self.calls: list[list[str]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == ABORTED_PATH
        asked = json.loads(request.content)
        ids = asked["request_ids"]
        assert 0 < len(ids) <= MAX_IDS_PER_CALL
        self.calls.append(ids)
        if len(self.calls) > self.after:
            self.ended.update(self.later)
            self.running -= set(self.later)
        found = {r: self.ended[r] for r in ids if r in self.ended}
        body: dict[str, Any] = {"output_tokens": {r: o for r, (_, o) in found.items()},
                                "running": [r for r in ids if r in self.running]}
        if self.with_prompts:
            body["prompt_tokens"] = {r: p for r, (p, _) in found.items()}
        if "exchange" in asked:
            body["exchange_ended"] = asked["exchange"] in self.exchanges_ended
        return httpx.Response(200, json=body)


def ask(handler: Callable[[httpx.Request], httpx.Response], kind: str, request_id: str = "g",
        wait_s: float = 1.0, **shape: int) -> tuple[int | None, int] | None:
    async def go() -> tuple[int | None, int] | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                     base_url="http://engine") as client:
            return await ask_engine_counts(client, kind, request_id, wait_s, **shape)
    return asyncio.run(go())


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_counts, "ASK_EVERY_S", 0.01)


def test_the_api_servers_ids_of_each_route() -> None:
    """vLLM 0.32: chat and Messages ``chatcmpl-X``, completions ``cmpl-X-{prompt}``,
    Responses ``resp_X_{turn}``; n > 1 choices ``{i}_`` + the id."""
    assert engine_request_ids("chat", "g") == [("chatcmpl-g",)]
    assert engine_request_ids("messages", "g") == [("chatcmpl-g",)]
    assert engine_request_ids("chat", "g", n=2) == [("0_chatcmpl-g", "1_chatcmpl-g")]
    assert engine_request_ids("completion", "g") == [("cmpl-g-0",)]
    assert engine_request_ids("completion", "g", n=2, prompts=2) == [
        ("0_cmpl-g-0", "1_cmpl-g-0"), ("0_cmpl-g-1", "1_cmpl-g-1")]
    assert engine_request_ids("responses", "g")[:2] == [("resp_g_0",), ("resp_g_1",)]
    with pytest.raises(ValueError):
        engine_request_ids("embeddings", "g")


def test_the_id_limit_is_the_engines() -> None:
    assert _counts.MAX_IDS_PER_CALL == MAX_IDS_PER_CALL


def test_a_chat_request_is_its_engine_requests_count() -> None:
    book = Book({"chatcmpl-g": (21, 37)})
    assert ask(book.handle, "chat", n=1, prompts=1) == (21, 37)
    assert book.calls == [["chatcmpl-g"]]


def test_choices_share_their_prompt_and_prompts_add_up() -> None:
    """n=2 over two prompts: outputs add up over the four engine requests, each prompt is
    counted once (as vLLM's usage counts it)."""
    book = Book({"0_cmpl-g-0": (5, 10), "1_cmpl-g-0": (5, 11),
                 "0_cmpl-g-1": (7, 12), "1_cmpl-g-1": (7, 13)})
    assert ask(book.handle, "completion", n=2, prompts=2) == (12, 46)


def test_the_shape_is_found_from_the_engines_answers() -> None:
    """No n and prompts given (crash recovery): first the choices of the first prompt,
    then the further prompts, a page at a time."""
    book = Book({f"{i}_chatcmpl-g": (4, i + 1) for i in range(3)})
    assert ask(book.handle, "chat") == (4, 6)
    book = Book({f"cmpl-g-{p}": (p + 1, 10) for p in range(3)})
    assert ask(book.handle, "completion") == (6, 30)
    book = Book({f"{i}_cmpl-g-{p}": (p + 1, 2) for p in range(3) for i in range(2)})
    assert ask(book.handle, "completion") == (6, 12)
    # More choices than one page of them
    book = Book({f"{i}_chatcmpl-g": (4, 1) for i in range(70)})
    assert ask(book.handle, "chat") == (4, 70)


def test_many_prompts_take_several_calls() -> None:
    book = Book({f"cmpl-g-{p}": (1, 1) for p in range(1500)})
    assert ask(book.handle, "completion", n=1, prompts=1500) == (1500, 1500)
    assert [len(c) for c in book.calls] == [1024, 476]
    book.calls.clear()
    assert ask(book.handle, "completion") == (1500, 1500)


def test_a_request_still_running_is_waited_for() -> None:
    """The abort lands a moment after the gateway first asks: it asks again."""
    book = Book({}, running=("chatcmpl-g",), later={"chatcmpl-g": (21, 40)}, after=3)
    assert ask(book.handle, "chat", n=1, prompts=1) == (21, 40)
    assert len(book.calls) == 4


def test_one_choice_ended_early_waits_for_the_others() -> None:
    book = Book({"0_chatcmpl-g": (9, 5)}, running=("1_chatcmpl-g",),
                later={"1_chatcmpl-g": (9, 8)}, after=2)
    assert ask(book.handle, "chat", n=2, prompts=1) == (9, 13)


def test_responses_sum_the_turns_it_ran() -> None:
    """A response with built-in tools: turn 0 finished, turn 1 was cut (running until its
    abort lands); each turn has its own prompt."""
    book = Book({"resp_g_0": (30, 12)}, running=("resp_g_1",),
                later={"resp_g_1": (50, 4)}, after=2)
    assert ask(book.handle, "responses") == (80, 16)


def test_what_ended_by_the_deadline_is_a_lower_bound_without_a_prompt() -> None:
    book = Book({"0_chatcmpl-g": (9, 5)}, running=("1_chatcmpl-g",))
    assert ask(book.handle, "chat", wait_s=0.1, n=2, prompts=1) == (None, 5)


def test_an_older_engine_gives_no_prompt() -> None:
    book = Book({"chatcmpl-g": (21, 37)}, with_prompts=False)
    assert ask(book.handle, "messages") == (None, 37)


@pytest.mark.parametrize("kind", ["chat", "completion", "responses"])
def test_nothing_known_in_time_is_none(kind: str) -> None:
    book = Book({})
    assert ask(book.handle, kind, wait_s=0.05) is None
    assert len(book.calls) >= 2  # it asked again before giving up


def test_plain_vllm_is_none_at_once() -> None:
    calls = []

    def plain(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(404, json={"detail": "Not Found"})

    assert ask(plain, "chat") is None
    assert ask(plain, "completion", n=1, prompts=1) is None
    assert len(calls) == 2


def test_an_engine_that_does_not_answer_is_none() -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    assert ask(down, "responses") is None


@pytest.mark.parametrize("shape", [{"n": 1, "prompts": 1}, {}])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_an_exchange_that_ended_before_reaching_the_scheduler_generated_nothing(
        kind: str, shape: dict[str, int]) -> None:
    """The engine's API server ended the request's exchange (the client left while it was
    still reading or rendering it) and its scheduler knows none of its ids: nothing was
    generated, said at once, not the reservation after the whole wait."""
    book = Book({}, exchanges_ended=("g",))
    assert ask(book.handle, kind, wait_s=5.0, **shape) == (None, 0)
    assert len(book.calls) <= 3  # the shape's pages when not known, then the ids
    # The exchange still open there (or another API server asked): as before.
    assert ask(Book({}).handle, kind, wait_s=0.05, **shape) is None
    # Known to the scheduler: its counts, whatever the exchange.
    known = Book({"chatcmpl-g" if kind == "chat" else "cmpl-g-0": (21, 7)},
                 exchanges_ended=("g",))
    assert ask(known.handle, kind, **shape) == (21, 7)
