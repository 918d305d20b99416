"""The book of ended requests in order (``engine._ended``, ``EndedRequests.since``), alone:
numbering, forgetting, the cursor, the merge of data-parallel ranks and the route."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from tokenpace.engine._aborted import EndedRequests
from tokenpace.engine._ended import (
    MAX_LIMIT,
    handle_ended,
    merge,
    parse_cursor,
    parse_query,
    tokenpace_ended_requests,
)


class Req:
    def __init__(self, request_id: str, output: int, prompt: int = 5) -> None:
        self.request_id, self.num_output_tokens = request_id, output
        self.num_prompt_tokens = prompt


def filled(n: int, keep: int = 65_536) -> EndedRequests:
    clock = iter(float(t) for t in range(1000, 2000))
    book = EndedRequests(keep=keep, clock=lambda: next(clock))
    for i in range(n):
        book.ended(Req(f"chatcmpl-g{i}-abcdefgh", i, prompt=10 + i), f"u{i % 2}")
    return book


def test_entries_are_numbered_in_the_order_they_ended() -> None:
    book = filled(3)
    after, entries = book.since(None, 10)
    assert after == -1 and book.oldest == 0
    assert entries == [("chatcmpl-g0-abcdefgh", "u0", 10, 0, 1000.0),
                       ("chatcmpl-g1-abcdefgh", "u1", 11, 1, 1001.0),
                       ("chatcmpl-g2-abcdefgh", "u0", 12, 2, 1002.0)]
    assert book.since(0, 1) == (0, entries[1:2])
    assert book.since(2, 10) == (2, [])  # nothing new: the cursor stays


def test_the_ring_forgets_the_oldest_beyond_its_size() -> None:
    book = filled(7, keep=3)
    assert book.oldest == 4
    after, entries = book.since(1, 10)  # 2 and 3 were forgotten before they were read
    assert after == 3 and [e[3] for e in entries] == [4, 5, 6]
    assert book.since(99, 10)[0] == 3  # not this book's number: from the oldest


def test_the_engines_answer_gives_api_ids_and_the_books_numbers() -> None:
    book = filled(3)

    class Core:
        scheduler = SimpleNamespace(ended_requests=book)

    answer = tokenpace_ended_requests(Core, {"after": {book.book: 0, "ffff": 7}, "limit": 5})
    assert answer == {"book": book.book, "oldest": 0, "after": 0, "requests": [
        [1, "chatcmpl-g1", "u1", 11, 1, 1001.0], [2, "chatcmpl-g2", "u0", 12, 2, 1002.0]]}
    assert tokenpace_ended_requests(SimpleNamespace(scheduler=object()),
                                    {"after": {}, "limit": 5})["status"] == 404
    assert tokenpace_ended_requests(Core, {"after": {}, "limit": 0})["status"] == 400


def test_ranks_are_merged_by_end_time_and_cut_to_the_limit() -> None:
    rank0 = {"book": "a0", "oldest": 0, "after": 4, "requests": [
        [5, "chatcmpl-x", "u", 1, 2, 10.0], [6, "chatcmpl-y", "u", 1, 2, 30.0]]}
    rank1 = {"book": "b1", "oldest": 3, "after": 8, "requests": [
        [9, "chatcmpl-z", "v", 1, 2, 20.0], [10, "chatcmpl-w", "v", 1, 2, 40.0]]}
    answer = merge([rank0, rank1], 3)
    assert [(e["book"], e["seq"]) for e in answer["requests"]] == [("a0", 5), ("b1", 9),
                                                                   ("a0", 6)]
    assert parse_cursor(answer["next"]) == {"a0": 6, "b1": 9}
    assert answer["oldest"] == {"a0": 0, "b1": 3}


@pytest.mark.parametrize("query", [b"after=xyz", b"after=ab:1:2", b"after=ab:-2",
                                   b"limit=0", f"limit={MAX_LIMIT + 1}".encode(),
                                   b"limit=1&limit=2", b"since=3",
                                   b"after=" + b",".join(b"%x:1" % i for i in range(300))])
def test_bad_queries_are_refused(query: bytes) -> None:
    with pytest.raises(ValueError):
        parse_query(query)


def test_a_good_query() -> None:
    assert parse_query(b"after=3f9c:41,a0:-1&limit=20") == ({"3f9c": 41, "a0": -1}, 20)
    assert parse_query(b"") == ({}, 1000)


class Engine:
    def __init__(self, *answers: dict[str, Any]) -> None:
        self.answers, self.asked = list(answers), []

    async def call_utility_all_async(self, method: str, *args: Any) -> list[dict[str, Any]]:
        self.asked.append((method, *args))
        return self.answers


def call(engine: Engine, *, method: str = "GET", query: bytes = b"", keys: list[str] | None = None,
         headers: tuple[tuple[bytes, bytes], ...] = ()) -> tuple[int, dict[str, Any]]:
    app = SimpleNamespace(state=SimpleNamespace(engine_client=SimpleNamespace(engine_core=engine),
                                                args=SimpleNamespace(api_key=keys)))
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": method, "path": "/tokenpace/v1/ended",
             "query_string": query, "headers": list(headers), "app": app}
    asyncio.run(handle_ended(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


def test_the_route_answers_get_with_the_engines_key_when_it_has_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    rank = {"book": "a0", "oldest": 0, "after": -1,
            "requests": [[0, "chatcmpl-x", "u", 1, 2, 10.0]]}
    engine = Engine(rank)
    status, body = call(engine, query=b"limit=5")
    assert status == 200 and body["next"] == "a0:0" and body["requests"][0]["user"] == "u"
    assert engine.asked == [("tokenpace_ended_requests", {"after": {}, "limit": 5})]
    assert call(engine, method="POST")[0] == 405
    assert call(engine, keys=["k1"])[0] == 401
    assert call(engine, keys=["k1"], headers=((b"authorization", b"Bearer k1"),))[0] == 200
    assert call(engine, query=b"limit=x")[0] == 400
    assert call(Engine({"error": "no book", "status": 404}))[0] == 404
