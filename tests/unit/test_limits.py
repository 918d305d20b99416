"""Parsing and validation of the per-user rate table."""

from __future__ import annotations

import math

import pytest

from tokenpace.pacing import LimitsError, UserRateLimits, parse_overrides_arg


def test_seed_json_form():
    limits = UserRateLimits.from_json('{"user-a":100,"user-b":500}', default=20)
    assert limits.rate("user-a") == 100.0
    assert limits.rate("user-b") == 500.0
    assert limits.rate("anyone") == 20.0


def test_no_default_means_unlisted_users_are_unpaced():
    limits = UserRateLimits(None, {"a": 2.5})
    assert limits.rate("a") == 2.5
    assert limits.rate("b") is None


def test_fractional_rates():
    assert UserRateLimits.from_json('{"slow": 0.5, "odd": 2.5}').rate("slow") == 0.5


def test_json_file(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text('{"user-a": 100}', encoding="utf-8")
    assert UserRateLimits.from_file(path, default=1).rate("user-a") == 100
    assert parse_overrides_arg(f"@{path}") == {"user-a": 100.0}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('"user-a"', "expected a JSON object"),
        ('{"": 10}', "must not be empty"),
        ('{"a": 0}', "greater than 0"),
        ('{"a": -5}', "greater than 0"),
        ('{"a": NaN}', "greater than 0"),
        ('{"a": Infinity}', "greater than 0"),
        ('{"a": "100"}', "must be a number"),
        ('{"a": true}', "must be a number"),
        ('{"a": null}', "must be a number"),
        ('{"a": [1]}', "must be a number"),
        ('{"%s": 1}' % ("x" * 257), "at most 256"),
    ],
)
def test_refused_with_a_message_naming_the_problem(text, message):
    with pytest.raises(LimitsError, match=message):
        UserRateLimits.from_json(text)


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "5", True, [1]])
def test_bad_default(bad):
    with pytest.raises(LimitsError, match="default rate"):
        UserRateLimits(bad, {})


@pytest.mark.parametrize("bad_user", [1, None, ""])
def test_bad_user_ids_in_mapping(bad_user):
    with pytest.raises(LimitsError, match="user id"):
        UserRateLimits(None, {bad_user: 1.0})


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(LimitsError, match="cannot read limits file .*nope.json"):
        parse_overrides_arg(f"@{tmp_path / 'nope.json'}")


def test_bare_at_sign():
    with pytest.raises(LimitsError, match="path of a limits file"):
        parse_overrides_arg("@")


def test_table_is_immutable():
    limits = UserRateLimits(1.0, {"a": 2.0})
    with pytest.raises(TypeError):
        limits.overrides["b"] = 3.0  # type: ignore[index]
