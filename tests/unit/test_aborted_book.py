"""The engine's book of aborted requests' output counts (``engine._aborted``), alone."""

from __future__ import annotations

import pytest

from tokenpace.engine._aborted import AbortedOutputs, parse_ids


class Req:
    def __init__(self, request_id: str, tokens: int) -> None:
        self.request_id, self.num_output_tokens = request_id, tokens


def test_the_book_forgets_the_oldest_beyond_its_size() -> None:
    book = AbortedOutputs(keep=3)
    book.record(Req(f"r{i}-suffix12", i) for i in range(5))
    assert book.lookup([f"r{i}" for i in range(5)]) == {"r2": 2, "r3": 3, "r4": 4}
    assert book.lookup(["r4-suffix12"]) == {"r4-suffix12": 4}


def test_an_id_without_a_suffix_is_kept_as_it_is() -> None:
    """VLLM_DISABLE_REQUEST_ID_RANDOMIZATION: the id has no suffix to take off."""
    book = AbortedOutputs()
    book.record([Req("plain", 7)])
    assert book.lookup(["plain"]) == {"plain": 7}


@pytest.mark.parametrize("body", [{}, {"request_ids": []}, {"request_ids": "x"},
                                  {"request_ids": [1]}, [], {"request_ids": ["x"] * 1025}])
def test_bad_queries_are_refused(body: object) -> None:
    with pytest.raises(ValueError):
        parse_ids(body)
