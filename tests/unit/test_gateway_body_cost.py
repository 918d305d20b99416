"""What reading a body costs: linear in its size, with nothing allocated per value.

A body's bytes are the client's to choose; one escaped emoji makes the parser's check walk
the whole parsed body. These tests count what that walk and the request's own checks
allocate (``tracemalloc``'s peak, measured above the parsed body, which the request needs
anyway), never how long they take: a walk that allocates per value (a path string per
list item) holds hundreds of bytes per item and fails every bound here by far.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from tokenpace.gateway.admission import prompt_bytes
from tokenpace.gateway.wire import GatewayError, parse_json_body, parse_request, prompt_token_ids

ITEMS = 50_000
EMOJI = b'"x": "\\ud83d\\ude00", '  # a valid pair, sent escaped: it makes the body walked


def _peak(fn: Callable[[], Any]) -> int:
    """Bytes allocated at the peak of ``fn()`` above what was allocated before it: the
    least of three calls. ``tracemalloc`` counts every thread's allocations, and in the full
    suite threads that earlier tests left running (a ledger writer, an event loop) allocate
    now and then; the function's own peak is the same in each call."""
    peaks = []
    for _ in range(3):
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            fn()
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
        finally:
            tracemalloc.stop()
    return min(peaks)


def _walk_only(raw: bytes) -> Callable[[], None]:
    """The check of an already parsed body (the parse's own allocations left out)."""
    from tokenpace.gateway.wire import _request
    body = json.loads(raw)
    return lambda: _request._refuse_unencodable(body)


BODIES = {
    "token ids": b'{' + EMOJI + b'"prompt": [' + b",".join([b"7"] * ITEMS) + b"]}",
    "ASCII strings": b'{' + EMOJI + b'"prompt": [' + b",".join([b'"a"'] * ITEMS) + b"]}",
    "non-ASCII strings": b'{' + EMOJI + b'"prompt": [' + b",".join([b'"\\u00e9"'] * ITEMS)
    + b"]}",
    "mixed items": b'{' + EMOJI + b'"v": [' + b",".join([b'1, "a", 0.5, null, {}'] * (ITEMS // 5))
    + b"]}",
    "objects": b'{' + EMOJI + b'"messages": ['
    + b",".join([b'{"role": "user", "content": "\\u00e9"}'] * (ITEMS // 10)) + b"]}",
}


@pytest.mark.parametrize("name", BODIES)
def test_the_walk_allocates_nothing_per_value(name: str) -> None:
    # A path string per item, as a walk that names every value would build, is > 50 bytes
    # each: 2.5 MB here. The walk keeps one iterator per open container.
    assert _peak(_walk_only(BODIES[name])) < 64 * 1024


def test_a_walk_as_deep_as_the_parser_allows_allocates_per_level_only() -> None:
    depth = 900
    raw = b'{' + EMOJI + b'"x": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    assert _peak(_walk_only(raw)) < depth * 200


def test_parsing_allocates_about_the_parsed_body_only() -> None:
    # The parsed body of 50,000 small ints is the list's pointers (8 bytes an item, ints
    # below 256 are shared): 0.4 MB. A per-item path was 30x that.
    raw = BODIES["token ids"]
    assert _peak(lambda: parse_json_body(raw)) < 3 * 8 * ITEMS + len(raw) * 4


def test_the_request_checks_allocate_nothing_per_prompt_item() -> None:
    body = parse_json_body(BODIES["token ids"])
    body["model"] = "m"

    def checks() -> None:
        req = parse_request("completion", body)
        assert prompt_token_ids(req) == [body["prompt"]]
        assert prompt_bytes(req) == 0

    assert _peak(checks) < 64 * 1024
    strings = parse_json_body(BODIES["ASCII strings"])
    strings["model"] = "m"
    # (a batch this long needs max_prompts_per_request raised)
    assert _peak(lambda: prompt_bytes(parse_request("completion", strings, max_prompts=ITEMS))
                 ) < 64 * 1024


@pytest.mark.parametrize("bad, param", [
    (b'"\\ud800"', "prompt[49999]"),
    (b"NaN", "prompt[49999]"),
])
def test_a_bad_value_at_the_end_of_a_long_list_is_found_and_named(bad: bytes, param: str) -> None:
    raw = b'{"prompt": [' + b",".join([b"7"] * (ITEMS - 1) + [bad]) + b"]}"
    with pytest.raises(GatewayError) as info:
        parse_json_body(raw)
    assert info.value.param == param


def test_a_long_key_is_echoed_clipped() -> None:
    key = "k" * 100_000
    raw = json.dumps({key: ["\ud800"]}).encode()
    with pytest.raises(GatewayError) as info:
        parse_json_body(raw)
    assert info.value.param is not None and len(info.value.param) < 300
    assert len(info.value.message) < 500
