"""The engine's book of ended requests' counts (``engine._aborted``), alone."""

from __future__ import annotations

import pytest

from tokenpace.engine._aborted import EndedRequests, parse_ids, tokenpace_aborted_outputs


class Req:
    def __init__(self, request_id: str, output: int, prompt: int = 5) -> None:
        self.request_id, self.num_output_tokens = request_id, output
        self.num_prompt_tokens = prompt


def test_the_book_forgets_the_oldest_beyond_its_size() -> None:
    book = EndedRequests(keep=3)
    for i in range(5):
        book.ended(Req(f"r{i}-suffix12", i, prompt=10 + i))
    assert book.lookup([f"r{i}" for i in range(5)]) == {"r2": (12, 2), "r3": (13, 3),
                                                        "r4": (14, 4)}
    assert book.lookup(["r4-suffix12"]) == {"r4-suffix12": (14, 4)}


def test_an_id_without_a_suffix_is_kept_as_it_is() -> None:
    """VLLM_DISABLE_REQUEST_ID_RANDOMIZATION: the id has no suffix to take off."""
    book = EndedRequests()
    book.ended(Req("plain", 7))
    assert book.lookup(["plain"]) == {"plain": (5, 7)}


def test_a_request_is_running_from_its_start_to_its_end() -> None:
    """By the API server's id; n > 1 children (``{i}_`` + the id) each on their own."""
    book = EndedRequests()
    for rid in ("cmpl-x-0-abcdefgh", "0_chatcmpl-y-12345678", "1_chatcmpl-y-12345678"):
        book.started(rid)
    ids = ["cmpl-x-0", "0_chatcmpl-y", "1_chatcmpl-y", "unknown"]
    assert book.running(ids) == ["cmpl-x-0", "0_chatcmpl-y", "1_chatcmpl-y"]
    book.ended(Req("0_chatcmpl-y-12345678", 3, prompt=4))
    assert book.running(ids) == ["cmpl-x-0", "1_chatcmpl-y"]
    assert book.lookup(ids) == {"0_chatcmpl-y": (4, 3)}


def test_the_engines_answer_splits_prompt_output_and_running() -> None:
    book = EndedRequests()
    book.started("chatcmpl-a-abcdefgh")
    book.started("chatcmpl-b-abcdefgh")
    book.ended(Req("chatcmpl-a-abcdefgh", 9, prompt=21))

    class Scheduler:
        ended_requests = book
        requests = {"chatcmpl-b-abcdefgh": object(), "no-random-part": object()}

    class Core:
        scheduler = Scheduler

    answer = tokenpace_aborted_outputs(
        Core, ["chatcmpl-a", "chatcmpl-b", "no-random-part", "chatcmpl-c"])
    assert answer == {"output_tokens": {"chatcmpl-a": 9}, "prompt_tokens": {"chatcmpl-a": 21},
                      "running": ["chatcmpl-b", "no-random-part"]}


def test_an_engine_without_the_book_answers_404() -> None:
    class Core:
        scheduler = object()

    assert tokenpace_aborted_outputs(Core, ["x"])["status"] == 404


@pytest.mark.parametrize("body", [{}, {"request_ids": []}, {"request_ids": "x"},
                                  {"request_ids": [1]}, [], {"request_ids": ["x"] * 1025}])
def test_bad_queries_are_refused(body: object) -> None:
    with pytest.raises(ValueError):
        parse_ids(body)
