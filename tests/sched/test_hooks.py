"""The vLLM hooks: plugin-driven scheduler selection, start-up refusals, idle wait."""

from __future__ import annotations

import os
import queue
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tokenpace.engine import _hooks, _vllm
from tokenpace.engine._step_hint import StepHint, hint_path
from tokenpace.pacing import MAX_IDLE_WAIT_S

PACING = {"tokenpace": {"default_user_output_tokens_per_second": 10}}


def _config(model: Path, **kwargs: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model), kv_cache_memory_bytes=64 * 1024 * 1024,
                      enforce_eager=True, **kwargs)
    return args.create_engine_config()


def test_hooked_vllm_names_exist() -> None:
    assert _vllm.hook_problems() == []


def test_plugin_entry_point_is_registered() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "tokenpace"]
    assert ep.load() is _hooks.register


def test_plain_vllm_config_selects_the_paced_scheduler(tiny_model: Path) -> None:
    config = _config(tiny_model, additional_config=PACING)
    assert config.scheduler_config.scheduler_cls == _hooks.PACED_SCHEDULER
    assert config.scheduler_config.async_scheduling is False  # the CPU platform's choice


def test_explicit_async_scheduling_selects_the_async_class(tiny_model: Path) -> None:
    config = _config(tiny_model, additional_config=PACING, async_scheduling=True)
    assert config.scheduler_config.async_scheduling is True
    assert config.scheduler_config.scheduler_cls == _hooks.PACED_ASYNC_SCHEDULER


def test_without_the_section_vllm_is_untouched(tiny_model: Path) -> None:
    config = _config(tiny_model, additional_config={"other": 1}, async_scheduling=True)
    assert config.scheduler_config.scheduler_cls is None
    assert config.scheduler_config.async_scheduling is False


def test_start_up_refuses_another_scheduler_class(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match=r"does not support another custom scheduler class"):
        _config(tiny_model, additional_config=PACING,
                scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_start_up_refuses_the_paced_class_of_the_other_mode(tiny_model: Path,
                                                            async_scheduling: bool) -> None:
    """vLLM runs whatever ``--scheduler-cls`` names; the class must match the loop."""
    wrong = _hooks.PACED_SCHEDULER if async_scheduling else _hooks.PACED_ASYNC_SCHEDULER
    right = _hooks.PACED_ASYNC_SCHEDULER if async_scheduling else _hooks.PACED_SCHEDULER
    with pytest.raises(ValueError, match=rf"--scheduler-cls {wrong} does not match async "
                                         rf"scheduling .*: use {right}"):
        _config(tiny_model, additional_config=PACING, scheduler_cls=wrong,
                async_scheduling=async_scheduling)
    config = _config(tiny_model, additional_config=PACING, scheduler_cls=right,
                     async_scheduling=async_scheduling)
    assert config.scheduler_config.scheduler_cls == right


def test_start_up_takes_speculative_decoding(tiny_model: Path) -> None:
    """Drafts are paced (``pacing._drafts``): the paced class is selected as usual."""
    config = _config(tiny_model, additional_config=PACING, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2,
        "prompt_lookup_max": 2, "prompt_lookup_min": 1,
    })
    assert config.scheduler_config.scheduler_cls == _hooks.PACED_SCHEDULER


def test_start_up_names_a_bad_key(tiny_model: Path) -> None:
    bad = {"tokenpace": {"default_user_output_tokens_per_second": "fast"}}
    with pytest.raises(ValueError, match=r"default_user_output_tokens_per_second"):
        _config(tiny_model, additional_config=bad)


# -- idle wait ---------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Queue(queue.Queue):
    """A real queue whose timed waits advance a fake clock instead of sleeping."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.clock = clock
        self.waits: list[float] = []
        self.hints: list[float] = []

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        self.waits.append(timeout or 0.0)
        # What a worker of this engine reads while the engine waits.
        worker_side = StepHint(hint_path(os.getpid()), create=False)
        self.hints.append((worker_side.get() - time.monotonic_ns()) / 1e9)
        try:
            return super().get(block=False)
        except queue.Empty:
            self.clock.t += timeout or 0.0
            raise


class _Scheduler:
    def __init__(self, clock: _Clock, ready_at: float) -> None:
        self.clock, self.ready_at = clock, ready_at
        self.idle_waits: list[float] = []

    def idle_wait_seconds(self) -> float:
        return min(MAX_IDLE_WAIT_S, max(0.0, self.ready_at - self.clock()))

    def note_idle_wait(self, waited_s: float) -> None:
        self.idle_waits.append(waited_s)


def _core(clock: _Clock, ready_at: float, batch: list | None = None) -> SimpleNamespace:
    handled: list[Any] = []
    return SimpleNamespace(
        scheduler=_Scheduler(clock, ready_at), input_queue=_Queue(clock), batch_queue=batch,
        is_running=lambda: True, _handle_client_request=lambda *r: handled.append(r),
        handled=handled,
    )


def test_waits_once_until_the_earliest_user_is_ready_and_tells_the_workers() -> None:
    clock = _Clock()
    core = _core(clock, ready_at=0.12)
    _hooks.idle_wait(core, clock)
    assert core.input_queue.waits == pytest.approx([0.12])
    assert clock.t == pytest.approx(0.12)
    assert core.scheduler.idle_waits == pytest.approx([0.12])  # for /metrics
    # During the wait the workers read "no step for 0.12 s"; after it, "any time".
    assert core.input_queue.hints[0] == pytest.approx(0.12, abs=0.01)
    assert StepHint(hint_path(os.getpid()), create=False).get() == 0


def test_a_request_ends_the_wait_and_is_handled() -> None:
    clock = _Clock()
    core = _core(clock, ready_at=10.0)
    core.input_queue.put(("ADD", "req"))
    _hooks.idle_wait(core, clock)
    assert core.handled == [("ADD", "req")] and clock.t == 0.0
    assert core.scheduler.idle_waits == [0.0]


def test_long_waits_stop_after_a_second_to_see_limit_changes() -> None:
    clock = _Clock()
    core = _core(clock, ready_at=30.0)
    _hooks.idle_wait(core, clock)
    assert clock.t == pytest.approx(_hooks.MAX_IDLE_S)


def test_no_wait_while_a_batch_with_tokens_is_in_flight() -> None:
    clock = _Clock()
    busy = [(None, SimpleNamespace(total_num_scheduled_tokens=3), None)]
    core = _core(clock, ready_at=1.0, batch=busy)
    _hooks.idle_wait(core, clock)
    assert core.input_queue.waits == []
    empty = [(None, SimpleNamespace(total_num_scheduled_tokens=0), None)]
    core = _core(clock, ready_at=clock.t + 0.05, batch=empty)
    _hooks.idle_wait(core, clock)
    assert core.input_queue.waits == [pytest.approx(0.05)]


def test_stock_schedulers_never_wait() -> None:
    clock = _Clock()
    core = _core(clock, ready_at=1.0)
    core.scheduler = object()
    _hooks.idle_wait(core, clock)
    assert core.input_queue.waits == []


def test_the_idle_wait_pauses_vllms_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33 disables its stack-dump watchdog while its loop waits for work; the idle
    wait is such a wait. On 0.32, which has no watchdog, the wait is the same without."""
    try:
        from vllm.config import WatchdogConfig
        from vllm.utils import watch_dog
    except ImportError:
        watch_dog = None
    clock = _Clock()
    core = _core(clock, ready_at=0.2)
    seen: list[bool] = []
    if watch_dog is not None:
        dog = watch_dog.ThreadedWatchDog("test", WatchdogConfig(timeout=1), _hooks.logger)
        monkeypatch.setattr(watch_dog, "_watch_dog", dog)  # installed, its thread not started
        original_get = core.input_queue.get

        def get(block: bool = True, timeout: float | None = None) -> Any:
            seen.append(dog.active)
            return original_get(block, timeout)

        core.input_queue.get = get
    _hooks.idle_wait(core, clock)
    assert core.input_queue.waits == pytest.approx([0.2])
    if watch_dog is not None:
        assert seen == [False], "the watchdog is paused during the wait"
        assert dog.active, "and watches again after it"


# -- worker nap ---------------------------------------------------------------------------


def _looks(nap: _hooks.WorkerNap, read: float, start: float, until: float,
           step: float = 0.001) -> list[tuple[float, float]]:
    """Look at the queue every ``step`` seconds from ``start``; (time, pause) of each look."""
    out, t = [], start
    while t < until:
        out.append((t, nap.pause_s(read, t)))
        t += step
    return out


def test_a_busy_worker_spins_through_the_gap_between_steps() -> None:
    nap = _hooks.WorkerNap(last_read=0.0, now=0.0)
    # Steps every 20 ms; each leaves the worker waiting 15 ms for the next one.
    for k in range(1, 5):
        looks = _looks(nap, read=0.02 * k, start=0.02 * k + 0.005, until=0.02 * (k + 1))
        assert all(pause == 0.0 for _, pause in looks), (k, looks)


def test_a_paced_worker_naps_after_ten_milliseconds() -> None:
    nap = _hooks.WorkerNap(last_read=0.0, now=0.0)
    nap.pause_s(0.2, 0.201)  # steps 200 ms apart: the engine is paced into gaps
    looks = _looks(nap, read=0.2, start=0.201, until=0.4)
    spinning = [t for t, pause in looks if pause == 0.0]
    assert max(spinning) <= 0.201 + _hooks.WORKER_SPIN_S + 1e-9
    pauses = [pause for t, pause in looks if t > 0.22]
    assert min(pauses) >= _hooks.WORKER_NAP_S
    assert max(pauses) <= _hooks.WORKER_MAX_NAP_S
    assert pauses == sorted(pauses)  # the longer it waits, the longer it naps


def test_a_busy_worker_that_goes_idle_naps_after_its_longer_spin() -> None:
    nap = _hooks.WorkerNap(last_read=0.0, now=0.0)
    nap.pause_s(0.02, 0.025)  # a 20 ms step period
    assert nap.pause_s(0.02, 0.025 + _hooks.WORKER_BUSY_PERIOD_S - 0.001) == 0.0
    assert nap.pause_s(0.02, 0.025 + _hooks.WORKER_BUSY_PERIOD_S + 0.001) > 0.0


def test_engines_learn_the_data_parallel_size_from_their_api_server(monkeypatch) -> None:
    # vLLM hands each rank of a dense model a config of size 1 (rank kept as the index).
    reduced = SimpleNamespace(data_parallel_index=1, data_parallel_rank=0,
                              data_parallel_size=1, data_parallel_external_lb=False)
    monkeypatch.delenv(_hooks.DATA_PARALLEL_ENV, raising=False)
    assert _hooks.data_parallel_of(reduced) == (1, 1, False)
    monkeypatch.setenv(_hooks.DATA_PARALLEL_ENV, "2")
    assert _hooks.data_parallel_of(reduced) == (1, 2, True)
    monkeypatch.setenv(_hooks.DATA_PARALLEL_ENV, "4/external")
    assert _hooks.data_parallel_of(reduced) == (1, 4, False)


def test_step_hint_files_of_dead_engines_are_removed(tmp_path) -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = hint_path(int(dead))
    stale.write_bytes(b"\0" * 8)
    hint = StepHint.create_for_this_engine()
    try:
        assert not stale.exists()
        assert hint.path.exists() and hint.get() == 0
    finally:
        hint.remove()
    assert not hint.path.exists()


def test_a_worker_sleeps_on_vllms_socket_while_its_engine_says_no_step_can_come(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker side of the step hint, on vLLM's real SpinCondition: while the engine
    is idle the worker waits on vLLM's notification socket (a step sent wakes it), for at
    most ``WORKER_HINT_POLL_S`` a look; once the wait ends it spins as after a step."""
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    # This process plays the worker: its engine is its parent process.
    engine_side = StepHint(hint_path(os.getppid()), create=True)
    context = zmq.Context()
    address = f"inproc://tokenpace-test-{os.getpid()}"
    # The engine's side binds first, as in vLLM: a SUB socket with CONFLATE connected to an
    # inproc address nobody has bound made libzmq abort at the later destroy in about half
    # of the runs ("Assertion failed: ok (src/ctx.cpp:789)", its pending-connection path).
    writer = SpinCondition(False, context, address)
    condition = SpinCondition(True, context, address)
    calls: list[tuple[Any, float]] = []
    vllm_wait = condition.wait

    def counted_wait(timeout_ms: int | None = None) -> None:
        calls.append((timeout_ms, condition.busy_loop_s))
        vllm_wait(timeout_ms)

    condition.wait = counted_wait
    worker = SimpleNamespace(rpc_broadcast_mq=SimpleNamespace(_spin_condition=condition))
    try:
        _hooks.limit_worker_spin(worker, SimpleNamespace(additional_config=PACING))
        condition.last_read = time.monotonic()  # a step was just taken: vLLM would spin
        engine_side.set(time.monotonic_ns() + 60 * 10**9)  # the engine is idle for a minute
        condition.wait()  # nothing sent: the socket wait times out after a look's limit
        limit_ms = int(_hooks.WORKER_HINT_POLL_S * 1000)
        assert calls == [(limit_ms, 0)] and condition.busy_loop_s == 1
        # A step sent wakes the worker at once: with a 30 s limit, it returns well before.
        monkeypatch.setattr(_hooks, "WORKER_HINT_POLL_S", 30.0)
        writer.notify()
        t0 = time.monotonic()
        condition.wait()
        assert time.monotonic() - t0 < 15.0 and calls[-1] == (30_000, 0)
        engine_side.set(0)  # the engine's wait ended: back to vLLM's spin
        condition.wait()
        assert calls[-1] == (None, 1)
    finally:
        engine_side.remove()
        context.destroy(linger=0)
