"""The ``model`` a request may name: bounded in length (``max_model_name_chars``), and a
client's string is echoed in an error only clipped."""

from __future__ import annotations

import json

import pytest

from tokenpace.gateway import ConfigError, parse_config
from tokenpace.gateway.wire import (
    MAX_MODEL_CHARS,
    MAX_PROMPTS,
    GatewayError,
    clip,
    parse_request,
)

GOOD = {"engines": ["http://e:8000"], "tenants": [{"id": "a", "api_keys": ["sk-a"]}],
        "ledger": "sqlite:///unused.db"}


def test_a_model_name_over_the_limit_is_a_400_with_a_clipped_echo() -> None:
    body = {"model": "m" * 1_000_000, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(GatewayError) as info:
        parse_request("chat", body)
    assert (info.value.status, info.value.param, info.value.code) == (400, "model",
                                                                      "invalid_value")
    assert "1000000 characters" in info.value.message and len(info.value.message) < 400
    body["model"] = "m" * MAX_MODEL_CHARS
    assert parse_request("chat", body).model == body["model"]
    assert parse_request("chat", {**body, "model": "m" * 5000}, max_model_chars=5000)


def test_clip_keeps_both_ends_and_says_how_much_it_left_out() -> None:
    assert clip("short") == "short"
    text = "a" * 150 + "b" * 1_000_000 + "c" * 150
    assert clip(text) == "a" * 100 + "...[1000100 characters]..." + "c" * 100
    assert len(clip(text, 10)) < 40


def test_max_model_name_chars_defaults_and_is_validated() -> None:
    assert parse_config(GOOD).max_model_name_chars == MAX_MODEL_CHARS == 256
    assert parse_config({**GOOD, "max_model_name_chars": 4096}).max_model_name_chars == 4096
    for bad in (0, "1k", True):
        with pytest.raises(ConfigError, match="max_model_name_chars"):
            parse_config({**GOOD, "max_model_name_chars": bad})


def test_a_batch_line_echoes_its_method_and_url_clipped() -> None:
    from tokenpace.gateway.batch._lines import read_line

    problems: list[str] = []
    for field in ("method", "url"):
        line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m"}, field: "x" * 1_000_000}
        raw = json.dumps(line).encode()
        assert read_line(1, raw, "/v1/chat/completions",
                         lambda code, message, *_: problems.append(message)) is None
    assert len(problems) == 2 and all(len(m) < 400 for m in problems)


def test_a_prompt_batch_over_the_limit_is_a_400() -> None:
    body = {"model": "m", "prompt": ["a"] * (MAX_PROMPTS + 1)}
    with pytest.raises(GatewayError) as info:
        parse_request("completion", body)
    assert (info.value.param, info.value.code) == ("prompt", "invalid_value")
    assert "max_prompts_per_request" in info.value.message
    assert parse_request("completion", {**body, "prompt": [[1]] * MAX_PROMPTS}).prompts == 2048
    assert parse_config(GOOD).max_prompts_per_request == MAX_PROMPTS
    with pytest.raises(ConfigError, match="max_prompts_per_request"):
        parse_config({**GOOD, "max_prompts_per_request": 0})
