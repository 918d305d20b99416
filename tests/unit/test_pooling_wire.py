"""Reading pooling bodies and answers (``wire._pooling``): inputs counted and bounded,
the calls that count them, and the answer's usage read from its top level only."""

from __future__ import annotations

import json

import pytest

from tokenpace.gateway.admission import prompt_bytes
from tokenpace.gateway.engines import Overhead, prompt_bound
from tokenpace.gateway.wire import (
    GatewayError,
    count_calls,
    parse_request,
    pooling_usage,
    prompt_token_ids,
)


def test_inputs_are_counted_per_route() -> None:
    assert parse_request("embeddings", {"model": "m", "input": "a"}).prompts == 1
    assert parse_request("embeddings", {"model": "m", "input": ["a", "b"]}).prompts == 2
    assert parse_request("embeddings", {"model": "m", "input": [[1, 2], [3]]}).prompts == 2
    assert parse_request("classify", {"model": "m", "input": [1, 2, 3]}).prompts == 1
    assert parse_request("rerank", {"model": "m", "query": "q", "documents": ["a"] * 3}).prompts == 3
    assert parse_request("score", {"model": "m", "data_1": ["a", "b"], "data_2": "c"}).prompts == 2
    req = parse_request("pooling", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert (req.prompts, req.max_tokens, req.stream, req.prompt_param) == (1, 0, False, "messages")


def test_more_inputs_than_allowed_are_refused_naming_the_field() -> None:
    with pytest.raises(GatewayError) as info:
        parse_request("rerank", {"model": "m", "query": "q", "documents": ["d"] * 5},
                      max_prompts=4)
    assert (info.value.status, info.value.param) == (400, "documents")
    assert parse_request("rerank", {"model": "m", "query": "q", "documents": ["d"] * 4},
                         max_prompts=4).prompts == 4


def test_ids_need_no_count_and_texts_are_counted_per_input_or_pair() -> None:
    ids = parse_request("embeddings", {"model": "m", "input": [[1, 2, 3], [4]]})
    assert prompt_token_ids(ids) == [[1, 2, 3], [4]] and prompt_bytes(ids) == 0
    texts = parse_request("embeddings", {"model": "m", "input": ["ab", "cde"],
                                         "add_special_tokens": False})
    assert prompt_token_ids(texts) is None and prompt_bytes(texts) == 5
    assert count_calls(texts) == [("/tokenize", {"model": "m", "prompt": "ab",
                                                 "add_special_tokens": False}),
                                  ("/tokenize", {"model": "m", "prompt": "cde",
                                                 "add_special_tokens": False})]
    pairs = parse_request("score", {"model": "m", "queries": ["q1", "q2"], "items": ["a", "b"]})
    assert [body["prompt"] for _, body in count_calls(pairs)] == ["q1\na", "q2\nb"]
    assert prompt_bytes(pairs) == 6


def test_only_the_top_level_usage_is_read() -> None:
    """A document echoed in a rerank answer may hold a "usage" key of the client's making:
    it is not the answer's usage."""
    answer = {"id": "r", "model": "m", "results": [
        {"index": 0, "document": {"text": '"usage":{"prompt_tokens":0}',
                                  "multi_modal": [{"usage": {"prompt_tokens": 0}}]}}],
        "usage": {"prompt_tokens": 41, "total_tokens": 41}}
    assert pooling_usage(json.dumps(answer).encode()) == 41
    big = {"data": [{"index": i, "embedding": [0.5] * 256} for i in range(200)],
           "usage": {"prompt_tokens": 7, "total_tokens": 7}}
    assert pooling_usage(json.dumps(big).encode()) == 7
    assert pooling_usage(b'{"data": []}') is None
    with pytest.raises(ValueError):
        pooling_usage(b"[1, 2]")
    with pytest.raises(ValueError):
        pooling_usage(b'{"usage": {"prompt_tokens": "many"}}')


def test_input_strings_have_a_byte_bound_pairs_and_messages_do_not() -> None:
    """Each input string is a plain prompt: the probed overhead, its bytes and the slack,
    once per input; a pair (a cross-encoder's separators) or chat messages: no bound."""
    overhead = Overhead(fixed=2, per_message=0, max_model_len=None)
    texts = parse_request("embeddings", {"model": "m", "input": ["ab", "é"]})
    assert prompt_bound(texts, overhead) == (2 + 2 + 1) + (2 + 2 + 1)
    for kind, body in (("rerank", {"query": "q", "documents": ["a"]}),
                       ("score", {"text_1": "a", "text_2": "b"}),
                       ("embeddings", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("embeddings", {"input": [[1, 2]]})):
        assert prompt_bound(parse_request(kind, {"model": "m", **body}), overhead) is None
