"""`tokenpace serve` argument translation: validated before vLLM starts, naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenpace.serve import (AUTH_MIDDLEWARE, GUARD_MIDDLEWARE, HEALTH_MIDDLEWARE, ServeUsageError,
                             build_command)

RATE = "--default-user-output-tokens-per-second"
USERS = "--user-output-tokens-per-second"
EVENTS = "--output-rate-event-log"
TRUSTED = "--trusted-gateway"
ALLOW = "--allow-unauthenticated-trusted-gateway"


@pytest.fixture(autouse=True)
def _engine_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trusted engine needs a key; tests of other flags get one from the environment."""
    monkeypatch.setenv("VLLM_API_KEY", "sk-engine")


def _additional(args: list[str]) -> dict:
    return json.loads(args[args.index("--additional-config") + 1])


def test_seed_flags_become_the_tokenpace_section(tmp_path: Path) -> None:
    cmd = build_command(
        ["my/model", RATE, "100", USERS, '{"user-a": 100, "user-b": 500}',
         "--max-num-seqs", "64", "--max-num-active-seqs", "16", EVENTS, "ev.jsonl"],
        cwd=tmp_path,
    )
    assert cmd.pacing
    assert cmd.vllm_args[:2] == ["--model", "my/model"]
    assert cmd.vllm_args[2:6] == ["--max-num-seqs", "64", "--max-num-active-seqs", "16"]
    assert _additional(cmd.vllm_args) == {"tokenpace": {
        "default_user_output_tokens_per_second": 100,
        "user_output_tokens_per_second": {"user-a": 100, "user-b": 500},
        "event_log": str(tmp_path / "ev.jsonl"),
    }}
    assert cmd.vllm_args[-2:] == ["--middleware", GUARD_MIDDLEWARE]


def test_without_a_default_rate_it_is_plain_vllm() -> None:
    """vLLM's own scheduler and routes; only its policy and capacity on ``/health`` (for a
    gateway's reserved slots)."""
    cmd = build_command(["m", "--port", "9000", "--async-scheduling"])
    assert not cmd.pacing
    assert cmd.vllm_args == ["--model", "m", "--port", "9000", "--async-scheduling",
                             "--middleware", HEALTH_MIDDLEWARE]


def test_equals_form_underscores_and_fractional_rates(tmp_path: Path) -> None:
    cmd = build_command([f"{RATE}=2.5", "--user_output_tokens_per_second={\"a\": 1}"])
    section = _additional(cmd.vllm_args)["tokenpace"]
    assert section["default_user_output_tokens_per_second"] == 2.5
    assert section["user_output_tokens_per_second"] == {"a": 1}


def test_limits_file_is_validated_now_and_passed_as_an_absolute_path(tmp_path: Path) -> None:
    (tmp_path / "limits.json").write_text('{"a": 7}')
    cmd = build_command(["m", RATE, "5", USERS, "@limits.json"], cwd=tmp_path)
    section = _additional(cmd.vllm_args)["tokenpace"]
    assert section["user_output_tokens_per_second"] == f"@{tmp_path / 'limits.json'}"


def test_given_additional_config_is_kept_and_merged() -> None:
    cmd = build_command(["m", "--additional-config", '{"other": {"x": 1}}', RATE, "10"])
    assert _additional(cmd.vllm_args) == {
        "other": {"x": 1}, "tokenpace": {"default_user_output_tokens_per_second": 10}
    }


def test_a_tokenpace_section_in_additional_config_turns_pacing_on_too() -> None:
    cmd = build_command(
        ["m", "--additional-config", '{"tokenpace": {"default_user_output_tokens_per_second": 3}}']
    )
    assert cmd.pacing and GUARD_MIDDLEWARE in cmd.vllm_args


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([RATE, "abc"], f"argument {RATE}: expected a number"),
        ([RATE, "0"], "greater than 0"),
        ([RATE, "nan"], "finite number"),
        ([RATE], f"argument {RATE}: expected a value"),
        ([RATE, "--port", "1"], f"argument {RATE}: expected a value"),
        ([RATE, "1", RATE, "2"], "given more than once"),
        (["--end-user-output-tokens-per-second", "5"],
         "argument --end-user-output-tokens-per-second: needs"),
        ([RATE, "20", "--end-user-output-tokens-per-second", "fast"],
         "argument --end-user-output-tokens-per-second: expected a number"),
        ([RATE, "20", "--end-user-output-tokens-per-second", "-2"], "greater than 0"),
        ([USERS, '{"a": 1}'], f"argument {USERS}: needs {RATE}"),
        ([RATE, "1", USERS, '{"a": -1}'], "rate of user 'a'"),
        ([RATE, "1", USERS, "{not json"], USERS),
        ([RATE, "1", USERS, "@/nonexistent/limits.json"], "cannot read limits file"),
        ([RATE, "1", EVENTS, "/nonexistent/dir/ev.jsonl"], f"argument {EVENTS}: directory"),
        ([RATE, "1", "--scheduler-cls", "my.Sched"], "argument --scheduler-cls"),
        ([RATE, "1", "--additional-config", '{"tokenpace": {}}'], "use one or the other"),
        (["--additional-config", "[1]"], "must be a JSON object"),
        (["--additional-config", "{"], "not valid JSON"),
        (["--additional-config", '{"tokenpace": {"default_user_output_tokens_per_second": -1}}'],
         "argument --additional-config"),
        (["--additional-config", '{"tokenpace": {"bogus": 1}}'], "bogus"),
    ],
)
def test_bad_flags_are_refused_by_name(args: list[str], message: str) -> None:
    with pytest.raises(ServeUsageError, match=None) as err:
        build_command(["m", *args])
    assert message in str(err.value)


def test_trusted_gateway_alone_turns_pacing_on() -> None:
    cmd = build_command(["m", TRUSTED, "--port", "9000"])
    assert cmd.pacing
    assert cmd.vllm_args[:4] == ["--model", "m", "--port", "9000"]
    assert _additional(cmd.vllm_args) == {"tokenpace": {"trusted_gateway": True}}
    assert cmd.vllm_args[-4:] == ["--middleware", GUARD_MIDDLEWARE, "--middleware", AUTH_MIDDLEWARE]


@pytest.mark.parametrize("args, environ", [
    (["--api-key", "k1"], {}),
    (["--api_key=k1"], {}),
    (["--api-key", "k1", "k2"], {}),
    ([], {"VLLM_API_KEY": "k"}),
])
def test_trusted_gateway_with_a_key_adds_the_auth_middleware(args: list[str], environ: dict) -> None:
    cmd = build_command(["m", TRUSTED, *args], environ=environ)
    assert cmd.vllm_args.count("--middleware") == 2 and AUTH_MIDDLEWARE in cmd.vllm_args
    for key in args:
        assert key in cmd.vllm_args, "vLLM keeps its own --api-key too"


@pytest.mark.parametrize("args, environ", [
    ([], {}),
    ([], {"VLLM_API_KEY": ""}),
    (["--api-key"], {}),
    (["--api-key", "--port", "1"], {}),
])
def test_trusted_gateway_without_a_key_refuses_to_start(args: list[str], environ: dict) -> None:
    with pytest.raises(ServeUsageError) as err:
        build_command(["m", TRUSTED, *args], environ=environ)
    assert str(err.value).startswith(f"argument {TRUSTED}: needs an API key")
    assert ALLOW in str(err.value)


def test_unauthenticated_trusted_gateway_only_when_asked_for_explicitly() -> None:
    cmd = build_command(["m", TRUSTED, ALLOW], environ={})
    assert cmd.pacing and AUTH_MIDDLEWARE not in cmd.vllm_args
    assert ALLOW not in cmd.vllm_args
    with pytest.raises(ServeUsageError, match=f"argument {ALLOW}: only with {TRUSTED}"):
        build_command(["m", ALLOW], environ={})


def test_non_trusted_engines_need_no_key() -> None:
    cmd = build_command(["m", RATE, "5"], environ={})
    assert AUTH_MIDDLEWARE not in cmd.vllm_args


def test_trusted_gateway_with_rates_and_underscores(tmp_path: Path) -> None:
    (tmp_path / "limits.json").write_text('{"a": 7}')
    cmd = build_command(["m", USERS, "@limits.json", "--trusted_gateway"], cwd=tmp_path)
    assert _additional(cmd.vllm_args)["tokenpace"] == {
        "user_output_tokens_per_second": f"@{tmp_path / 'limits.json'}",
        "trusted_gateway": True,
    }
    cmd = build_command(["m", TRUSTED, RATE, "10"])
    assert _additional(cmd.vllm_args)["tokenpace"] == {
        "default_user_output_tokens_per_second": 10, "trusted_gateway": True,
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([f"{TRUSTED}=x"], f"argument {TRUSTED}: takes no value, got 'x'"),
        ([f"{TRUSTED}="], f"argument {TRUSTED}: takes no value"),
        ([TRUSTED, TRUSTED], f"argument {TRUSTED}: given more than once"),
        ([TRUSTED, "--additional-config", '{"tokenpace": {}}'], "use one or the other"),
        (["--additional-config", '{"tokenpace": {"trusted_gateway": "yes"}}'],
         "argument --additional-config: additional_config['tokenpace']['trusted_gateway']"),
        ([TRUSTED, "--scheduler-cls", "my.Sched"], "argument --scheduler-cls"),
    ],
)
def test_bad_trusted_gateway_flags_are_refused_by_name(args: list[str], message: str) -> None:
    with pytest.raises(ServeUsageError) as err:
        build_command(["m", *args])
    assert message in str(err.value)


def test_our_scheduler_class_may_be_named_explicitly() -> None:
    cmd = build_command(["m", RATE, "1", "--scheduler-cls", "tokenpace.engine.PacedScheduler"])
    assert "tokenpace.engine.PacedScheduler" in cmd.vllm_args


def test_cli_reports_a_bad_flag_and_exits_2_without_starting_vllm() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tokenpace.cli", "serve", "m", RATE, "fast"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"tokenpace serve: error: argument {RATE}")
    assert "vllm" not in proc.stdout.lower()


def test_cli_help_lists_the_pacing_flags() -> None:
    proc = subprocess.run([sys.executable, "-m", "tokenpace.cli", "serve", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for flag in (RATE, USERS, EVENTS, TRUSTED, ALLOW):
        assert flag in proc.stdout
    assert "vllm_xargs.output_rate_tokens_per_second" in proc.stdout


def test_an_end_user_rate_goes_into_the_section() -> None:
    from tokenpace.serve import build_command

    cmd = build_command(["m", RATE, "20", "--end-user-output-tokens-per-second", "4.5"])
    config = json.loads(cmd.vllm_args[cmd.vllm_args.index("--additional-config") + 1])
    assert config["tokenpace"]["end_user_output_tokens_per_second"] == 4.5


def test_identity_headers_go_into_the_section() -> None:
    cmd = build_command(["m", RATE, "20", "--user-header", "X-Tenant-Id",
                         "--require-user-header", "--application-header=x-app",
                         "--end_user_header", "x-end-user"])
    assert _additional(cmd.vllm_args)["tokenpace"] == {
        "default_user_output_tokens_per_second": 20, "user_header": "x-tenant-id",
        "application_header": "x-app", "end_user_header": "x-end-user",
        "require_user_header": True}
    assert cmd.pacing and cmd.vllm_args[-2:] == ["--middleware", GUARD_MIDDLEWARE]


@pytest.mark.parametrize(("args", "message"), [
    (["m", "--user-header", "x-t"], "argument --user-header: needs --default-user"),
    (["m", RATE, "5", "--user-header", "x t"], "argument --user-header must be an HTTP header"),
    (["m", RATE, "5", "--end-user-header", "Authorization"],
     "argument --end-user-header: 'authorization' carries"),
    (["m", RATE, "5", "--require-user-header"], "argument --require-user-header: only with"),
    (["m", RATE, "5", "--user-header"], "argument --user-header: expected a value"),
    (["m", RATE, "5", "--user-header", "x", "--application-header", "X"],
     "must be different headers"),
])
def test_bad_identity_header_flags_are_refused_by_name(args: list[str], message: str) -> None:
    with pytest.raises(ServeUsageError, match=message):
        build_command(args)


def test_cli_help_lists_the_identity_header_flags() -> None:
    proc = subprocess.run([sys.executable, "-m", "tokenpace.cli", "serve", "--help"],
                          capture_output=True, text=True, timeout=60)
    for flag in ("--user-header", "--require-user-header", "--application-header",
                 "--end-user-header"):
        assert flag in proc.stdout


def test_priority_scheduling_turns_lanes_on_and_makes_hold_room(tmp_path: Path) -> None:
    cmd = build_command(["m", "--scheduling-policy", "priority", "--max-num-seqs", "16"],
                        cwd=tmp_path)
    assert not cmd.pacing  # lanes alone: nobody is paced
    assert GUARD_MIDDLEWARE in cmd.vllm_args  # tokenpace's scheduler runs: its /metrics series
    assert _additional(cmd.vllm_args) == {"tokenpace": {"lanes": {}}}
    args = cmd.vllm_args
    assert args[args.index("--max-num-seqs") + 1] == "32"
    assert args[args.index("--max-num-active-seqs") + 1] == "16"
    assert args.count("--max-num-seqs") == 1
    # An operator's own split is kept as given.
    cmd = build_command(["m", "--scheduling-policy=priority", "--max-num-seqs=24",
                         "--max-num-active-seqs=16"], cwd=tmp_path)
    assert "--max-num-seqs=24" in cmd.vllm_args and "--max-num-active-seqs=16" in cmd.vllm_args
    # Without --max-num-seqs there is no room to make: one line says so.
    cmd = build_command(["m", "--scheduling-policy", "priority"], cwd=tmp_path)
    assert any("--max-num-active-seqs" in w for w in cmd.warnings)


def test_lane_flags_go_into_the_section(tmp_path: Path) -> None:
    cmd = build_command(["m", "--scheduling-policy", "priority", "--max-num-seqs", "8",
                         RATE, "5", "--lane-min-share", "0.25"], cwd=tmp_path)
    assert cmd.pacing
    assert _additional(cmd.vllm_args)["tokenpace"]["lanes"] == {"min_share": 0.25}
    cmd = build_command(["m", "--scheduling-policy", "priority", "--max-num-seqs", "8",
                         "--no-lanes"], cwd=tmp_path)
    assert _additional(cmd.vllm_args) == {"tokenpace": {"lanes": False}}
    assert "--max-num-active-seqs" not in cmd.vllm_args
    # FCFS: nothing about lanes is added.
    cmd = build_command(["m", "--max-num-seqs", "8"], cwd=tmp_path)
    assert "--additional-config" not in cmd.vllm_args


@pytest.mark.parametrize("args,message", [
    (["m", "--lane-min-share", "0.2"], "only with --scheduling-policy priority"),
    (["m", "--scheduling-policy", "priority", "--lane-min-share", "0.9"], "from 0 to 0.5"),
    (["m", "--scheduling-policy", "priority", "--lane-min-share", "x"], "from 0 to 0.5"),
    (["m", "--scheduling-policy", "priority", "--lane-min-share", "0.2", "--no-lanes"],
     "not with --no-lanes"),
])
def test_bad_lane_flags_are_refused_by_name(args: list[str], message: str) -> None:
    with pytest.raises(ServeUsageError, match="--lane-min-share") as info:
        build_command(args)
    assert message in str(info.value)
