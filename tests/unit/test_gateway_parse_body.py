"""``admission.parse_body``: a large body is parsed in a worker thread with the same
answers as on the event loop, one per tenant at a time, its lock dropped when free."""

from __future__ import annotations

import asyncio

import pytest

from tokenpace.gateway.admission import LARGE_BODY_BYTES, parse_body
from tokenpace.gateway.admission import _parse
from tokenpace.gateway.wire import GatewayError

PAD = b"0," * (LARGE_BODY_BYTES // 2)
LIMITS = {"max_model_chars": 256, "max_prompts": 8}


def _body(last: bytes) -> bytes:
    return b'{"model": "m", "prompt": "hi", "pad": [' + PAD + last + b"]}"


def test_large_bodies_are_parsed_and_refused_as_small_ones() -> None:
    async def run() -> None:
        # Several tenants' large bodies at once, each in its worker thread, beside small
        # ones on the loop: each thread's hook flag is its own.
        good, nan = _body(b"1"), _body(b"NaN")
        results = await asyncio.gather(
            parse_body("a", "completion", good, **LIMITS),
            parse_body("b", "completion", nan, **LIMITS),
            parse_body("a", "completion", good, **LIMITS),
            parse_body("c", "completion", b'{"model": "m", "prompt": "hi"}', **LIMITS),
            return_exceptions=True)
        assert [type(r).__name__ for r in results] == [
            "ParsedRequest", "GatewayError", "ParsedRequest", "ParsedRequest"]
        # Refused by the strict parser: a body this large is not parsed again by Python's
        # to name the value (that second parse is what a parse bomb would buy).
        assert isinstance(results[1], GatewayError) and results[1].code == "invalid_json"
        assert "finite numbers" in results[1].message and results[1].status == 400
        assert _parse._parsing == {}

    asyncio.run(run())


def test_a_small_body_refused_by_the_strict_parser_is_named_by_its_path() -> None:
    small = b'{"model": "m", "prompt": "hi", "pad": [0, 0, NaN]}'
    with pytest.raises(GatewayError) as info:
        asyncio.run(parse_body("a", "completion", small, **LIMITS))
    assert info.value.code == "invalid_number" and info.value.param == "pad[2]"


def test_a_large_body_with_a_long_model_name_is_refused() -> None:
    raw = b'{"model": "' + b"m" * 300 + b'", "prompt": "hi", "pad": [' + PAD + b"1]}"
    with pytest.raises(GatewayError) as info:
        asyncio.run(parse_body("a", "completion", raw, **LIMITS))
    assert info.value.param == "model"
