"""Validation of additional_config["tokenpace"] (no vLLM needed)."""

from __future__ import annotations

import pytest

from tokenpace.engine._config import PacingConfig, PacingConfigError


def test_absent_section_means_off():
    assert not PacingConfig.from_additional_config({}).enabled
    assert not PacingConfig.from_additional_config(None).enabled


def test_default_and_overrides_object():
    cfg = PacingConfig.from_additional_config({"tokenpace": {
        "default_user_output_tokens_per_second": 100,
        "user_output_tokens_per_second": {"user-a": 100, "user-b": 500},
        "event_log": "/tmp/x.jsonl",
    }})
    assert cfg.enabled and cfg.limits.rate("user-b") == 500 and cfg.limits.rate("z") == 100
    assert str(cfg.event_log) == "/tmp/x.jsonl"


def test_overrides_from_file(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text('{"a": 2.5}')
    cfg = PacingConfig.from_section({
        "default_user_output_tokens_per_second": 1,
        "user_output_tokens_per_second": f"@{path}",
    })
    assert cfg.limits.rate("a") == 2.5 and cfg.limits_file == path


@pytest.mark.parametrize(("section", "message"), [
    ([], "must be an object"),
    ({"default_user_output_tokens_per_second": 0}, "greater than 0"),
    ({"default_user_output_tokens_per_second": "10"}, "must be a number"),
    ({"default_user_output_tokens_per_second": 10, "typo": 1}, "unknown key.*'typo'"),
    ({"default_user_output_tokens_per_second": 10, "end_user_output_tokens_per_second": 0},
     "end_user_output_tokens_per_second.*greater than 0"),
    ({"user_output_tokens_per_second": {"a": 1}}, "needs 'default_user_output_tokens_per_second'"),
    ({"default_user_output_tokens_per_second": 1, "user_output_tokens_per_second": {"a": -1}},
     "user_output_tokens_per_second.*greater than 0"),
    ({"default_user_output_tokens_per_second": 1, "user_output_tokens_per_second": 5},
     "must be an object of user id"),
    ({"default_user_output_tokens_per_second": 1, "user_output_tokens_per_second": "@/nope.json"},
     "cannot read limits file"),
    ({"default_user_output_tokens_per_second": 1, "event_log": 3}, "event_log"),
])
def test_refusals_name_the_key(section, message):
    with pytest.raises(PacingConfigError, match=message):
        PacingConfig.from_section(section)


def test_trusted_gateway_alone_turns_pacing_on_with_no_default_rate():
    cfg = PacingConfig.from_additional_config({"tokenpace": {"trusted_gateway": True}})
    assert cfg.enabled and cfg.trusted_gateway
    assert cfg.limits.default is None and cfg.limits.rate("anyone") is None
    assert cfg.idle_wait


def test_trusted_gateway_allows_overrides_without_a_default(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text('{"a": 3}')
    cfg = PacingConfig.from_section({
        "trusted_gateway": True, "idle_wait": False,
        "user_output_tokens_per_second": f"@{path}",
    })
    assert cfg.limits.rate("a") == 3 and cfg.limits.rate("b") is None
    assert cfg.limits_file == path and not cfg.idle_wait


def test_trusted_gateway_keeps_a_given_default():
    cfg = PacingConfig.from_section({
        "trusted_gateway": True, "default_user_output_tokens_per_second": 7,
    })
    assert cfg.trusted_gateway and cfg.limits.rate("b") == 7


def test_without_trusted_gateway_nothing_changes():
    assert not PacingConfig.from_section({"trusted_gateway": False}).enabled
    cfg = PacingConfig.from_section({"default_user_output_tokens_per_second": 1})
    assert not cfg.trusted_gateway
    with pytest.raises(PacingConfigError, match="needs 'default_user_output_tokens_per_second'"):
        PacingConfig.from_section({
            "trusted_gateway": False, "user_output_tokens_per_second": {"a": 1},
        })


@pytest.mark.parametrize("value", ["true", 1, 0, None, [True]])
def test_trusted_gateway_must_be_a_boolean(value):
    with pytest.raises(PacingConfigError, match=r"\['trusted_gateway'\] must be true or false"):
        PacingConfig.from_section({"trusted_gateway": value})


def test_trusted_gateway_still_checks_the_default_rate():
    with pytest.raises(PacingConfigError, match="default_user_output_tokens_per_second"):
        PacingConfig.from_section({
            "trusted_gateway": True, "default_user_output_tokens_per_second": 0,
        })


def test_an_end_user_rate_paces_end_users_inside_their_users():
    cfg = PacingConfig.from_section({"default_user_output_tokens_per_second": 100,
                                     "end_user_output_tokens_per_second": 5})
    assert cfg.end_user_rate == 5.0
    assert PacingConfig.from_section({"trusted_gateway": True}).end_user_rate is None


def test_lanes_key() -> None:
    from tokenpace.engine import PacingConfig as Config
    from tokenpace.pacing import LanePolicy

    default = Config.from_section({"default_user_output_tokens_per_second": 5})
    assert default.lanes == LanePolicy() and not default.lanes_requested
    off = Config.from_section({"default_user_output_tokens_per_second": 5, "lanes": False})
    assert off.lanes is None
    alone = Config.from_section({"lanes": {"min_share": 0.2}})
    assert not alone.enabled and alone.runs_scheduler and alone.lanes == LanePolicy(0.2)
    assert not Config.from_section({"lanes": True}).runs_scheduler


@pytest.mark.parametrize("value,message", [
    ("yes", "must be true, false or an object"),
    ({"min_share": 0.7}, "from 0 to 0.5"),
    ({"min_share": True}, "from 0 to 0.5"),
    ({"share": 0.1}, "unknown key(s) 'share'"),
])
def test_bad_lanes_are_refused_by_key(value: object, message: str) -> None:
    from tokenpace.engine import PacingConfig as Config, PacingConfigError

    with pytest.raises(PacingConfigError, match="lanes") as info:
        Config.from_section({"lanes": value})
    assert message in str(info.value)
