"""The relay's event framing and usage handling, on bytes as vLLM writes them."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenpace.gateway.wire import ChunkRewriter, EventSplitter

SEPARATORS = "\u0085\u2028\u2029"


def chunk(text: str, index: int = 0, usage: dict[str, int] | None = None,
          finish: str | None = None, tail: dict[str, Any] | None = None) -> bytes:
    """A chat chunk serialised like vLLM's ``model_dump_json``: compact, non-ASCII raw,
    ``usage`` after ``choices`` and before the optional fields."""
    body: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                            "model": "tiny", "choices": [{"index": index, "delta": {"content": text},
                                                          "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    body.update(tail or {})
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def usage(completion: int, prompt: int = 5) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def split_all(stream: bytes, cuts: list[int]) -> list[bytes]:
    splitter = EventSplitter()
    out: list[bytes] = []
    last = 0
    for cut in sorted(set(cuts)) + [len(stream)]:
        out += splitter.feed(stream[last:cut])
        last = cut
    return out + splitter.flush()


def test_unicode_line_separators_stay_inside_their_event() -> None:
    events = [chunk(f"a{sep}b") for sep in SEPARATORS] + [b"[DONE]"]
    stream = b"".join(b"data: " + e + b"\n\n" for e in events)
    assert split_all(stream, []) == events
    # str.splitlines (httpx's aiter_lines) would cut them: the defect this guards against
    assert len(stream.decode().splitlines()) > 2 * len(events)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab\u20ac\U0001f600\"\\") + list(SEPARATORS)),
                    max_size=12),
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
       newline=st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_any_split_of_the_byte_stream_gives_the_same_events(text: str, cuts: list[int],
                                                             newline: bytes) -> None:
    """Network reads cut anywhere, inside multi-byte characters included; any SSE line end."""
    events = [chunk(text), chunk(text + "x", usage=usage(2)), b"[DONE]"]
    stream = b"".join(b"data: " + e + newline + newline for e in events)
    assert split_all(stream, [c % (len(stream) + 1) for c in cuts]) == events


def test_non_data_fields_are_skipped_and_the_space_after_the_colon_is_optional() -> None:
    stream = b": keep-alive\n\nevent: x\ndata:{\"a\":1}\n\ndata: [DONE]\n\n"
    assert split_all(stream, [3, 20]) == [b'{"a":1}', b"[DONE]"]


@given(text=st.text(max_size=20))
def test_usage_is_cut_out_byte_for_byte(text: str) -> None:
    """Without usage asked for, the client gets exactly the chunk the engine would have sent
    without usage: no re-serialisation (which would escape U+2028 and reorder nothing else)."""
    rewriter = ChunkRewriter(wants_usage=False, wants_continuous_usage=False)
    tail = {"system_fingerprint": "fp"}
    assert rewriter.event(chunk(text, usage=usage(1), tail=tail)) == chunk(text, tail=tail)
    assert rewriter.event(chunk(text, usage=usage(2))) == chunk(text)
    assert rewriter.progress.completion_tokens == 2


def test_usage_the_client_asked_for_is_kept() -> None:
    final = b'{"id":"x","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[],' \
            b'"usage":{"prompt_tokens":5,"total_tokens":8,"completion_tokens":3,' \
            b'"prompt_tokens_details":{"cached_tokens":0}}}'
    only_final = ChunkRewriter(wants_usage=True, wants_continuous_usage=False)
    assert only_final.event(chunk("a", usage=usage(1))) == chunk("a")
    assert only_final.event(final) == final
    none = ChunkRewriter(wants_usage=False, wants_continuous_usage=False)
    assert none.event(final) is None
    every = ChunkRewriter(wants_usage=True, wants_continuous_usage=True)
    assert every.event(chunk("a", usage=usage(1))) == chunk("a", usage=usage(1))
    assert none.progress.completion_tokens == 3 and none.progress.prompt_tokens == 5


def test_multi_choice_continuous_usage_is_summed_over_choices() -> None:
    """vLLM's continuous usage counts the chunk's own choice: an n=4 stream the client drops
    after k tokens per choice has generated 4k tokens, not k."""
    rewriter = ChunkRewriter(wants_usage=False, wants_continuous_usage=False)
    for k in range(1, 6):
        for index in range(4):
            rewriter.event(chunk("t", index=index, usage=usage(k)))
    assert rewriter.progress.completion_tokens == 20
    assert rewriter.progress.per_choice == {0: 5, 1: 5, 2: 5, 3: 5}


def test_final_usage_is_the_engines_total() -> None:
    rewriter = ChunkRewriter(wants_usage=False, wants_continuous_usage=False)
    for index in range(2):
        rewriter.event(chunk("t", index=index, usage=usage(3), finish="length"))
    rewriter.event(b'{"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":6,'
                   b'"total_tokens":11}}')
    assert rewriter.progress.completion_tokens == 6
    assert rewriter.progress.finish_reason == "length"
    assert rewriter.event(b"[DONE]") == b"[DONE]" and rewriter.progress.done


def test_first_token_and_errors() -> None:
    rewriter = ChunkRewriter(wants_usage=False, wants_continuous_usage=False)
    rewriter.event(chunk("", usage=usage(0)))  # the role chunk: no token yet
    assert not rewriter.progress.first_token
    rewriter.event(chunk("a", usage=usage(1)))
    assert rewriter.progress.first_token
    error = b'{"error":{"message":"boom","type":"InternalServerError","code":500}}'
    assert rewriter.event(error) == error
    assert rewriter.progress.error["message"] == "boom"


def test_a_chunk_without_usage_is_read_whole() -> None:
    """An engine that ignores continuous_usage_stats still gets its first token noticed."""
    rewriter = ChunkRewriter(wants_usage=False, wants_continuous_usage=False)
    assert rewriter.event(chunk("hi", finish="stop")) == chunk("hi", finish="stop")
    assert rewriter.progress.first_token and rewriter.progress.finish_reason == "stop"


def test_usage_is_cut_from_json_with_spaces_too() -> None:
    rewriter = ChunkRewriter(wants_usage=False, wants_continuous_usage=False)
    spaced = b'{"id": "x", "choices": [{"index": 0, "text": "a"}], "usage": {"completion_tokens": 1}}'
    assert rewriter.event(spaced) == b'{"id": "x", "choices": [{"index": 0, "text": "a"}]}'
    first = b'{"usage": {"completion_tokens": 2}, "id": "x", "choices": [{"index": 0, "text": "a"}]}'
    assert rewriter.event(first) == b'{"id": "x", "choices": [{"index": 0, "text": "a"}]}'
    assert rewriter.progress.completion_tokens == 2
