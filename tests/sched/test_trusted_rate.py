"""Rates sent by a trusted gateway, on vLLM's real scheduler (sync and async)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.sched._harness import NS, make_sim, max_in_window
from tokenpace.engine import RATE_EXTRA_ARG, _warn

BURST_S = 0.1
TRUSTED = {"trusted_gateway": True}
modes = pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])


def sent(value: Any) -> dict[str, Any]:
    """The ``vllm_xargs`` a gateway adds: the user's rate."""
    return {RATE_EXTRA_ARG: value}


def assert_paced_at(times: list[int], rate: float, seconds: float) -> None:
    """The limiter's promise for the charges ``times`` spread over ``seconds``."""
    assert len(times) >= rate * seconds - 1, len(times)
    for window_s in (0.05, 0.5, 1.0, seconds):
        assert max_in_window(times, int(window_s * NS)) <= (window_s + BURST_S) * rate + 1, window_s


@pytest.fixture
def engine_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Warnings of the engine logger, also where vLLM's logging configuration stops the
    "vllm" logger from propagating to the root logger that caplog listens on."""
    logger = logging.getLogger("vllm.tokenpace.engine")
    caplog.set_level(logging.WARNING, logger=logger.name)
    reaches_root = True
    node: logging.Logger | None = logger
    while node is not None and node.parent is not None:
        if not node.propagate:
            reaches_root = False
            break
        node = node.parent
    if reaches_root:
        yield caplog
        return
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def warnings_of(log: pytest.LogCaptureFixture) -> list[str]:
    # A record can reach caplog's handler twice (through the engine logger and the root,
    # depending on what earlier tests did to vLLM's logging): count each record once.
    unique = {id(r): r for r in log.records}
    return [r.getMessage() for r in unique.values() if r.levelno == logging.WARNING]


@modes
def test_trusted_rate_paces_its_user_and_others_stay_unpaced(tiny_model: Path, is_async: bool):
    """No default rate: the gateway's rate is the only one; a user without one is free."""
    sim = make_sim(tiny_model, is_async=is_async, pacing=TRUSTED)
    assert sim.scheduler.planner is not None, "trusted_gateway alone turns pacing on"
    for i in range(3):
        sim.add(f"a{i}", "a", max_tokens=1000, xargs=sent(20))
    sim.add("b0", "b", max_tokens=1000)
    sim.run(5)
    assert_paced_at(sim.user_times("a"), 20, 5)
    b_steps = [step for step, _, user, _ in sim.dispatched if user == "b"]
    assert len(b_steps) >= sim.step_index - 2, "b has no rate: it samples every step"


@modes
def test_a_new_rate_replaces_the_old_one_without_a_fresh_burst(tiny_model: Path, is_async: bool):
    sim = make_sim(tiny_model, is_async=is_async,
                   pacing={**TRUSTED, "default_user_output_tokens_per_second": 5})
    sim.add("r0", "a", max_tokens=2000, xargs=sent(20))
    sim.run(3)
    change_ns = sim.clock.now_ns
    assert_paced_at(sim.user_times("a"), 20, 3)
    sim.add("r1", "a", max_tokens=2000, xargs=sent(50.5))
    limiter = sim.scheduler.planner.limiter
    assert limiter.limits.rate("a") == 50.5 and limiter.limits.default == 5
    sim.run(3)
    after = [t for t in sim.user_times("a") if t >= change_ns]
    assert_paced_at(after, 50.5, 3)
    sim.add("r2", "a", max_tokens=10, xargs=sent(2.5))  # down again: slower at once
    slow_from = sim.clock.now_ns
    sim.run(2)
    slow = [t for t in sim.user_times("a") if t >= slow_from]
    assert len(slow) <= (2 + BURST_S) * 2.5 + 1, len(slow)


@modes
def test_the_same_rate_again_leaves_the_limits_alone(tiny_model: Path, is_async: bool):
    sim = make_sim(tiny_model, is_async=is_async, pacing=TRUSTED)
    sim.add("r0", "a", xargs=sent(20))
    limits = sim.scheduler.planner.limiter.limits
    sim.add("r1", "a", xargs=sent(20.0))
    assert sim.scheduler.planner.limiter.limits is limits


@modes
def test_untrusted_rate_is_ignored_and_reported_once(
    tiny_model: Path, is_async: bool, engine_log: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(_warn, "_said", set())  # as in a fresh engine process
    sim = make_sim(tiny_model, is_async=is_async,
                   pacing={"default_user_output_tokens_per_second": 10})
    sim.add("r0", "a", max_tokens=1000, xargs=sent(100))
    sim.add("r1", "a", max_tokens=1000, xargs=sent(100))
    sim.run(4)
    assert sim.scheduler.planner.limiter.limits.rate("a") == 10
    assert_paced_at(sim.user_times("a"), 10, 4)
    reports = [m for m in warnings_of(engine_log) if RATE_EXTRA_ARG in m]
    assert len(reports) == 1 and "--trusted-gateway" in reports[0], reports


@modes
def test_bad_rates_are_logged_and_ignored(
    tiny_model: Path, is_async: bool, engine_log: pytest.LogCaptureFixture
):
    sim = make_sim(tiny_model, is_async=is_async,
                   pacing={**TRUSTED, "default_user_output_tokens_per_second": 10})
    bad = {"bool": True, "str": "100", "zero": 0, "neg": -3, "inf": math.inf,
           "nan": math.nan, "list": [5]}
    for name, value in bad.items():
        sim.add(f"bad-{name}", "a", max_tokens=1000, xargs=sent(value))
    sim.add("bad-who", None, xargs={"output_rate_user": 7, RATE_EXTRA_ARG: 99})
    sim.run(3)
    limits = sim.scheduler.planner.limiter.limits
    assert limits.rate("a") == 10 and limits.rate("__anonymous__") == 10
    assert not limits.overrides
    assert_paced_at(sim.user_times("a"), 10, 3)
    messages = warnings_of(engine_log)
    for name in [*bad, "who"]:
        assert any(f"request bad-{name}:" in m and "ignored" in m for m in messages), name


@modes
def test_limits_file_reload_forgets_sent_rates_until_the_next_request(
    tiny_model: Path, is_async: bool, tmp_path: Path
):
    """No default rate, so the limits file is the only other source of rates."""
    limits_file = tmp_path / "limits.json"
    limits_file.write_text('{"u": 10}')
    sim = make_sim(tiny_model, is_async=is_async, pacing={
        **TRUSTED, "user_output_tokens_per_second": f"@{limits_file}",
    })
    limiter = sim.scheduler.planner.limiter
    sim.add("g0", "g", max_tokens=1000, xargs=sent(40))
    sim.run(0.5)
    assert limiter.limits.rate("g") == 40 and limiter.limits.rate("u") == 10
    limits_file.write_text('{"u": 20}')
    os.utime(limits_file, ns=(1, 2))
    sim.run(1.5)
    assert limiter.limits.rate("u") == 20
    assert limiter.limits.rate("g") is None  # forgotten: g is unpaced until it sends again
    sim.add("g1", "g", max_tokens=1000, xargs=sent(40))
    assert limiter.limits.rate("g") == 40 and limiter.limits.rate("u") == 20


def test_trusted_gateway_alone_selects_the_paced_scheduler(tiny_model: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from tokenpace.engine import _hooks

    args = EngineArgs(model=str(tiny_model), kv_cache_memory_bytes=64 * 1024 * 1024,
                      enforce_eager=True, additional_config={"tokenpace": TRUSTED})
    config = args.create_engine_config()
    assert config.scheduler_config.scheduler_cls == _hooks.PACED_SCHEDULER



@modes
def test_an_older_rate_version_arriving_late_does_not_undo_a_newer_one(tiny_model: Path,
                                                                        is_async: bool):
    """The gateway lowers one engine's share by control call while a request that carried
    the older, higher share may still be on its way: its version is older, so it is not
    adopted (the sum of a tenant's shares over its engines never exceeds its rate)."""
    from tokenpace.engine import RATE_VERSION_EXTRA_ARG

    sim = make_sim(tiny_model, is_async=is_async, pacing=TRUSTED)
    sim.add("a0", "a", max_tokens=1000, xargs={**sent(40), RATE_VERSION_EXTRA_ARG: 5})
    assert sim.scheduler.set_user_rates({"a": (20.0, 6)}) == {"a": (20.0, 6)}
    sim.add("a1", "a", max_tokens=1000, xargs={**sent(1000), RATE_VERSION_EXTRA_ARG: 5})
    sim.add("a2", "a", max_tokens=1000, xargs=sent(1000) | {RATE_VERSION_EXTRA_ARG: 4})
    sim.run(5)
    assert_paced_at(sim.user_times("a"), 20, 5)
    assert sim.scheduler.set_user_rates({"a": (50.0, 3)}) == {"a": (20.0, 6)}
    assert sim.scheduler.set_user_rates({"b": (7.0, None)}) == {"b": (7.0, None)}


@modes
def test_rate_control_needs_a_trusted_gateway(tiny_model: Path, is_async: bool):
    sim = make_sim(tiny_model, is_async=is_async, pacing={"default_user_output_tokens_per_second": 5})
    with pytest.raises(PermissionError, match="trusted_gateway"):
        sim.scheduler.set_user_rates({"a": (20.0, 1)})
