"""What the gateway's body parser refuses: JSON the engine (or its encoder) cannot take."""

from __future__ import annotations

import json

import pytest

from tokenpace.gateway.wire import GatewayError, parse_json_body


@pytest.mark.parametrize("raw, param, code", [
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content",
     "invalid_unicode"),
    (b'{"prompt": "x\\udfff"}', "prompt", "invalid_unicode"),
    ('{"prompt": "x\udc80"}'.encode("utf-8", "surrogatepass"), "prompt", "invalid_unicode"),
    ('{"prompt": "\ud800"}'.encode("utf-16", "surrogatepass"), "prompt", "invalid_unicode"),
    (b'{"tools": [{"function": {"name": "f\\ud800"}}]}', "tools[0].function.name",
     "invalid_unicode"),
    (b'{"chat_template_kwargs": {"x": NaN}}', "chat_template_kwargs.x", "invalid_number"),
    (b'{"tools": [{"parameters": {"max": Infinity}}]}', "tools[0].parameters.max",
     "invalid_number"),
    (b'{"temperature": -Infinity}', "temperature", "invalid_number"),
    (b'{"top_p": 1e400}', "top_p", "invalid_number"),
])
def test_unencodable_values_are_a_400_naming_the_field(raw: bytes, param: str, code: str) -> None:
    with pytest.raises(GatewayError) as info:
        parse_json_body(raw)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)
    assert param in info.value.message


def test_a_lone_surrogate_in_a_key_is_refused() -> None:
    with pytest.raises(GatewayError) as info:
        parse_json_body(b'{"vllm_xargs": {"\\udc00": 1}}')
    assert info.value.status == 400 and info.value.param == "vllm_xargs"


@pytest.mark.parametrize("raw", [
    b'{"prompt": "\\ud83d\\ude00 emoji as an escaped pair"}',
    '{"prompt": "\U0001f600 emoji as UTF-8"}'.encode(),
    b'{"temperature": 0.5, "top_p": 1e300, "n": 100000000000000000000}',
])
def test_valid_json_passes_unchanged(raw: bytes) -> None:
    assert parse_json_body(raw) == json.loads(raw)


def test_nesting_as_deep_as_the_parser_allows_is_walked_without_recursion() -> None:
    depth = 900
    raw = b'{"x": ' + b"[" * depth + b'"\\ud800"' + b"]" * depth + b"}"
    with pytest.raises(GatewayError) as info:
        parse_json_body(raw)
    path = "x" + "[0]" * depth  # echoed clipped: both ends, and how much was left out
    assert info.value.param == path[:100] + f"...[{len(path) - 200} characters]..." + path[-100:]
