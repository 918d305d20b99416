"""Where tokenpace changes vLLM's classes outside the scheduler: five wrapped methods
(1-5) and the engine core's utility methods (6).

vLLM offers no supported seam for these, so each of 1-5 is a small wrapper around one
method, installed once per process by ``register`` (only for classes whose module that
process imported), that calls the original and does one extra thing. Every wrapped name,
and every vLLM method the wrappers call, is listed in ``_vllm.HOOKED_METHODS`` and checked
by a test.

1. ``EngineArgs.create_engine_config`` (API-server process): when the ``tokenpace``
   section enables pacing, refuse unsupported modes before any engine process starts,
   and select ``PacedScheduler`` or ``PacedAsyncScheduler`` to match the async-scheduling
   mode vLLM settled on. This is what makes plain ``vllm serve --additional-config``
   paced.
2. ``EngineCoreProc._process_engine_step`` (engine process): before a step, while no
   request can run because every user with work is out of quota, block on the engine's
   input queue for ``scheduler.idle_wait_seconds()`` instead of re-running ``schedule()``
   every millisecond. A new request, an abort or a shutdown arrives on that queue, so it
   ends the wait at once; the wait never happens inside ``schedule()``, and steps that
   would run nothing do not reach the model workers.
3. ``WorkerProc._init_message_queues`` (worker processes): vLLM's workers spin on their
   shared-memory input queue for one second after each message. A paced engine steps
   with gaps (a 5 tok/s user with every stream throttled: five steps a second), so the
   worker would never stop spinning; with pacing on, it spins for ``WORKER_SPIN_S`` and
   then naps between looks (see ``limit_worker_spin``). While the engine's idle wait
   runs, the step hint (``_step_hint``) tells the worker that no step can come before a
   known instant, and it naps at once.
4. ``DPLBAsyncMPClient.get_core_engine_for_request`` (API-server process, data parallel
   with vLLM's own load balancing): every rank has its own scheduler and limiter, so a
   user spread over the ranks would get its rate once per rank. The wrapper sets the
   request's ``data_parallel_rank`` to ``user_rank(user, ranks)`` before vLLM picks the
   engine, so all of a user's requests meet one limiter. It sits below every endpoint
   (completions, chat, responses, the Python API) and overrides a client's own
   ``X-data-parallel-rank`` header, which would otherwise let a client pick a second rank
   and a second quota.
5. ``AsyncLLM.add_request`` (API-server process), with identity headers configured
   (``user_header``): writes the identity the request's headers gave into its sampling
   parameters, replacing what its body said (``_header_identity``).
6. ``EngineCoreProc`` (engine process) gains four methods, not wrappers: vLLM runs a
   utility call by name on the engine core, and each is the engine side of one route of
   the API server: ``tokenpace_set_rates`` (``/tokenpace/v1/rates``, ``_control``),
   ``tokenpace_aborted_outputs`` (``/tokenpace/v1/aborted``, ``_aborted``),
   ``tokenpace_ended_requests`` (``/tokenpace/v1/ended``, ``_ended``) and
   ``tokenpace_pacing_stats`` (the pacing series of ``/metrics``, ``_metrics``).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import sys
import time
from typing import Any

from ._config import PacingConfig
from ._aborted import install_aborted_outputs
from ._ended import install_ended_requests
from ._control import install_rate_control
from ._header_identity import install_header_identity
from ._metrics import install_pacing_stats
from ._step_hint import StepHint

logger = logging.getLogger("vllm.tokenpace.engine")

PACED_SCHEDULER = "tokenpace.engine.PacedScheduler"
PACED_ASYNC_SCHEDULER = "tokenpace.engine.PacedAsyncScheduler"
WORKER_SPIN_S = 0.01
"""How long a worker that has finished a step spins for the next one: the engine's own work
between two decode steps (output processing, ``schedule()``) takes a few milliseconds on a
slow CPU, and a nap there would delay every step."""
WORKER_BUSY_PERIOD_S = 0.03
"""While steps follow each other this closely (the engine is busy, not paced into gaps),
the worker spins for up to this long instead of ``WORKER_SPIN_S``: on a loaded CPU the
engine's work between steps can take over 10 ms, and napping there cost about 6% of
throughput against stock vLLM (`bench overhead`, 32 streams, 2 cores)."""
WORKER_NAP_S = 0.0005
WORKER_MAX_NAP_S = 0.02
"""After that, the worker naps between looks at its queue until vLLM's own one-second
spin ends; each nap is a tenth of the time waited so far (0.5 to 20 ms). A step that
follows a gap starts at most ~10% of the gap later, and an idle worker uses about 1% of a
core instead of a whole one."""
WORKER_HINT_POLL_S = 0.05
"""While the engine's step hint says no step can come yet, the worker sleeps on vLLM's
notification socket (a step sent wakes it at once), looking at the hint again at least
this often: when the hint's instant comes, and should a notification be lost."""
DATA_PARALLEL_ENV = "TOKENPACE_DATA_PARALLEL"
"""Set by the API server for its engine processes: ``N`` (users pinned to one of N ranks
by this API server) or ``N/external`` (one server per rank behind a load balancer)."""
MAX_IDLE_S = 1.0
"""Longest idle wait without a step, so that a limits-file edit is seen within a second."""

_MARK = "__tokenpace_hook__"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts.

    It only wraps classes whose modules this process has already imported, so it costs
    nothing where they are not used (a worker never imports the API layer, and so on).
    """
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is not None:
        install_config_hook(arg_utils.EngineArgs)
    core = sys.modules.get("vllm.v1.engine.core")
    if core is not None:
        install_idle_wait(core.EngineCoreProc)
        install_rate_control(core.EngineCoreProc)
        install_aborted_outputs(core.EngineCoreProc)
        install_ended_requests(core.EngineCoreProc)
        install_pacing_stats(core.EngineCoreProc)
    executor = sys.modules.get("vllm.v1.executor.multiproc_executor")
    if executor is not None:
        install_worker_spin_limit(executor.WorkerProc)
    client = sys.modules.get("vllm.v1.engine.core_client")
    if client is not None:
        install_rank_pinning(client.DPLBAsyncMPClient)
    async_llm = sys.modules.get("vllm.v1.engine.async_llm")
    if async_llm is not None:
        install_header_identity(async_llm.AsyncLLM, _wrap)


def _wrap(cls: type, name: str, make: Any) -> bool:
    """Replace ``cls.name`` by ``make(original)`` unless already done; True if installed."""
    original = getattr(cls, name)
    if getattr(original, _MARK, False):
        return False
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(cls, name, wrapper)
    return True


# -- 1. scheduler selection and start-up refusals ---------------------------------------


def configure_pacing(vllm_config: Any, async_requested: bool | None = None) -> PacingConfig:
    """Make a resolved ``VllmConfig`` paced if its ``tokenpace`` section says so.

    Raises ``ValueError`` (which vLLM prints as the reason start-up failed) naming the
    unsupported mode or the bad configuration key.
    """
    from ._modes import unsupported_modes
    from ._vllm import internals_problems

    pacing = PacingConfig.from_additional_config(vllm_config.additional_config)
    if not pacing.runs_scheduler:
        return pacing
    problems = internals_problems()
    if problems:
        raise ValueError("tokenpace cannot pace this vLLM: " + "; ".join(problems))
    refused = unsupported_modes(vllm_config)
    if refused:
        raise ValueError("tokenpace output pacing does not support " + "; ".join(refused))
    if pacing.identity_headers:
        import vllm.v1.engine.async_llm as async_llm

        install_header_identity(async_llm.AsyncLLM, _wrap)
    sched = vllm_config.scheduler_config
    if async_requested and not sched.async_scheduling:
        # vLLM's CPU platform turns async scheduling off as "not required"; it works, and
        # an operator who asked for it explicitly gets it.
        logger.warning("tokenpace: keeping --async-scheduling on as requested "
                       "(the platform had turned it off)")
        sched.async_scheduling = True
    matching = PACED_ASYNC_SCHEDULER if sched.async_scheduling else PACED_SCHEDULER
    named = _paced_class_named(sched.scheduler_cls)
    if sched.scheduler_cls is None:
        sched.scheduler_cls = matching
    elif named is not None and named != matching:
        # vLLM runs the named class whatever its engine loop does. The sync class under
        # async scheduling does not count the step in flight (vLLM PR #43724 warns of
        # this pairing); each class is tested only with its own mode.
        raise ValueError(
            f"--scheduler-cls {named} does not match async scheduling "
            f"{'on' if sched.async_scheduling else 'off'}: use {matching}, or leave "
            "--scheduler-cls out and tokenpace picks the class"
        )
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1:
        # The engine processes (started after this, with this environment) see a config
        # reduced to one rank of size 1 for dense models; this tells them the real size.
        os.environ[DATA_PARALLEL_ENV] = f"{parallel.data_parallel_size}" + (
            "/external" if parallel.data_parallel_external_lb else ""
        )
        if parallel.data_parallel_external_lb:
            logger.warning(
                "tokenpace: data parallel with external load balancing: this server runs "
                "one rank with its own limiter; the load balancer must send all of a "
                "user's requests to one server (tokenpace gateway's sticky routing does)"
            )
        else:
            import vllm.v1.engine.core_client as core_client

            install_rank_pinning(core_client.DPLBAsyncMPClient)
            logger.info("tokenpace: data parallel size %d: each user is pinned to one rank",
                        parallel.data_parallel_size)
    else:
        os.environ.pop(DATA_PARALLEL_ENV, None)
    return pacing


def _paced_class_named(scheduler_cls: Any) -> str | None:
    """``PACED_SCHEDULER`` or ``PACED_ASYNC_SCHEDULER`` when ``--scheduler-cls`` names one
    of them (by name, or as the class itself), else None."""
    if scheduler_cls is None:
        return None
    if isinstance(scheduler_cls, str):
        name = scheduler_cls
    else:
        name = f"{scheduler_cls.__module__}.{scheduler_cls.__qualname__}"
    if not name.startswith("tokenpace.engine."):
        return None
    tail = name.rsplit(".", 1)[-1]
    for paced in (PACED_SCHEDULER, PACED_ASYNC_SCHEDULER):
        if paced.rsplit(".", 1)[-1] == tail:
            return paced
    return None


def install_config_hook(engine_args_cls: type) -> bool:
    def make(original: Any) -> Any:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            config = original(self, *args, **kwargs)
            configure_pacing(config, getattr(self, "async_scheduling", None))
            return config

        return create_engine_config

    return _wrap(engine_args_cls, "create_engine_config", make)


# -- 2. idle wait in the engine loop -----------------------------------------------------


def idle_wait(core: Any, clock: Any = time.monotonic) -> None:
    """Before a step: block on the engine's input queue while no request can run.

    Waits until the earliest throttled user has quota again (``idle_wait_seconds()``), in
    one wait rather than in slices, so that steps which would run nothing never reach the
    model workers; gives up after ``MAX_IDLE_S`` so that a limits-file edit that makes
    someone ready sooner is seen. While it waits, the step hint tells the workers when the
    next step can come at the earliest, so they nap instead of spinning. A request that
    ends the wait is handled here (vLLM's loop drains the rest after the step). With
    async scheduling, a batch in flight that ran tokens must be collected first, so there
    is no wait then. Like vLLM's own wait for work, it pauses vLLM's watchdog (0.33).
    """
    wait_seconds = getattr(core.scheduler, "idle_wait_seconds", None)
    if wait_seconds is None:
        return
    for _, scheduler_output, _ in core.batch_queue or ():
        if scheduler_output.total_num_scheduled_tokens > 0:
            return
    if wait_seconds() <= 0:
        return  # the usual case, on every step: something can run
    from ._vllm import watchdog_paused  # imported here: vLLM is loaded in the engine process

    hint = _engine_hint()
    started = clock()
    deadline = started + MAX_IDLE_S
    request = None
    try:
        with watchdog_paused():  # as around vLLM 0.33's own wait for work
            while request is None and core.is_running():
                timeout = min(wait_seconds(), deadline - clock())
                if timeout <= 0:
                    break
                hint.set(time.monotonic_ns() + int(timeout * 1e9))
                try:
                    request = core.input_queue.get(timeout=timeout)
                except queue.Empty:
                    continue
        hint.set(0)  # before handling: the step for this request comes at once
        if request is not None:
            core._handle_client_request(*request)
    finally:
        hint.set(0)
        note = getattr(core.scheduler, "note_idle_wait", None)
        if note is not None:
            note(clock() - started)


_hint: StepHint | None = None


def _engine_hint() -> StepHint:
    global _hint
    if _hint is None:
        _hint = StepHint.create_for_this_engine()
    return _hint


def release_step_hint() -> None:
    """Remove this engine's step hint (at scheduler shutdown: vLLM ends engine processes
    without running ``atexit``)."""
    global _hint
    if _hint is not None:
        _hint.remove()
        _hint = None


def install_idle_wait(engine_core_proc_cls: type) -> bool:
    def make(original: Any) -> Any:
        def _process_engine_step(self: Any) -> bool:
            idle_wait(self)
            return bool(original(self))

        return _process_engine_step

    return _wrap(engine_core_proc_cls, "_process_engine_step", make)


# -- 3. worker spin limit ----------------------------------------------------------------


def limit_worker_spin(worker: Any, vllm_config: Any) -> None:
    """Make the worker's input-queue wait nap instead of spin once it has been idle a bit.

    vLLM's reader spins (``sched_yield``) for ``busy_loop_s`` (1 s) after each message and
    only then sleeps on a notification socket. Shortening ``busy_loop_s`` would be the
    obvious fix, but that socket can drop a notification under load (its high-water mark
    is 1) and the reader then waits for the 5 s re-check. So the spin keeps its length and
    its safety; after a short spin (``WorkerNap`` decides how short) it naps between looks,
    longer the longer it idles.
    """
    pacing = PacingConfig.of_started(vllm_config)
    if pacing is None or not pacing.enabled or not pacing.idle_wait:
        return
    condition = getattr(getattr(worker, "rpc_broadcast_mq", None), "_spin_condition", None)
    if condition is None or not hasattr(condition, "last_read"):
        return
    spin_wait = condition.wait
    nap = WorkerNap(condition.last_read, time.monotonic())
    hint: StepHint | None = None
    look_for_hint_at = 0.0

    hinted = False  # the last look saw the engine in its idle wait

    def wait(timeout_ms: int | None = None) -> None:
        nonlocal hint, look_for_hint_at, hinted
        now = time.monotonic()
        if hint is None and now >= look_for_hint_at:  # the engine creates it on its first wait
            hint = StepHint.open_for_parent_engine()
            look_for_hint_at = now + 1.0
        if hint is not None:
            not_before = hint.get()
            ahead = not_before / 1e9 - now
            if ahead > 0:  # the engine is idle until then: sleep until a step is sent
                hinted = True
                _await_step(condition, spin_wait, min(ahead, WORKER_HINT_POLL_S), timeout_ms)
                return
            if hinted or not_before:
                # The engine's wait ended (its deadline passed, or a request came): its
                # step comes now. Spin for it as after a step; the growing naps below
                # would count the whole wait as idle time and sleep up to 20 ms while
                # the engine spins for this worker's answer: CPU spent on every step of
                # an engine that paces each one.
                hinted = False
                nap.restart(now)
                spin_wait(timeout_ms)
                return
        pause = nap.pause_s(condition.last_read, now)
        if pause == 0.0 or now - condition.last_read > condition.busy_loop_s:
            spin_wait(timeout_ms)  # vLLM's spin, or after its busy period its socket wait
        else:
            time.sleep(pause)

    condition.wait = wait


def _await_step(condition: Any, spin_wait: Any, limit_s: float, timeout_ms: int | None) -> None:
    """Sleep on vLLM's own notification socket until the engine sends a message (a step,
    or its shutdown), or ``limit_s`` passes.

    vLLM's reader takes that socket only once it has been idle for ``busy_loop_s``; the
    engine's hint says it is idle now, so the reader takes it at once (``busy_loop_s`` is 0
    for this one call; the reader is single-threaded). A message the engine sends wakes
    it at once: a fresh user's first step is not delayed by a nap, and an idle wait costs
    a look every ``WORKER_HINT_POLL_S`` instead of every 5 ms (200 naps a second cost
    0.015 cores here, a third of a paced engine's CPU at 2 tok/s). The limit bounds what
    a lost notification (vLLM's socket keeps at most one) could cost a step.
    """
    limit_ms = max(1, int(limit_s * 1000))
    busy = condition.busy_loop_s
    condition.busy_loop_s = 0
    try:
        spin_wait(limit_ms if timeout_ms is None else min(timeout_ms, limit_ms))
    finally:
        condition.busy_loop_s = busy


class WorkerNap:
    """At each look of an idle worker at its input queue: spin (look again at once) or nap.

    vLLM stamps ``last_read`` when the worker *takes* a step, so by the time the step has
    run that stamp is old; the wait that matters starts at the first look after a new read.
    The time between two reads is the step period: while it is short the engine is busy
    and the worker keeps spinning a little longer, so that busy engines never wait on a nap.
    """

    def __init__(self, last_read: float, now: float) -> None:
        self._seen_read = last_read
        self._waiting_since = now
        self._period = float("inf")

    def restart(self, now: float) -> None:
        """A step is coming now: wait as right after a step (spin first)."""
        self._waiting_since = now

    def pause_s(self, last_read: float, now: float) -> float:
        """0.0 to spin, else how long to sleep before the next look."""
        if last_read != self._seen_read:
            self._period = last_read - self._seen_read
            self._seen_read, self._waiting_since = last_read, now
        waited = now - self._waiting_since
        spin_for = WORKER_BUSY_PERIOD_S if self._period <= WORKER_BUSY_PERIOD_S else WORKER_SPIN_S
        if waited <= spin_for:
            return 0.0
        return min(WORKER_MAX_NAP_S, max(WORKER_NAP_S, waited / 10))


def install_worker_spin_limit(worker_proc_cls: type) -> bool:
    def make(original: Any) -> Any:
        def _init_message_queues(self: Any, input_shm_handle: Any, vllm_config: Any) -> None:
            original(self, input_shm_handle, vllm_config)
            limit_worker_spin(self, vllm_config)

        return _init_message_queues

    return _wrap(worker_proc_cls, "_init_message_queues", make)


# -- 4. one data-parallel rank per user --------------------------------------------------


def _pins_users(client: Any) -> bool:
    """Whether this engine client paces (read once per client from its configuration)."""
    pins = getattr(client, "_tokenpace_pins_users", None)
    if pins is None:
        config = PacingConfig.of_started(client.vllm_config)
        pins = client._tokenpace_pins_users = config is not None and config.enabled
    return bool(pins)


def install_rank_pinning(client_cls: type) -> bool:
    from ..pacing import user_rank
    from ._identity import request_user

    def make(original: Any) -> Any:
        def get_core_engine_for_request(self: Any, request: Any) -> Any:
            if getattr(request, "sampling_params", None) is not None and _pins_users(self):
                # Cost: one BLAKE2b of the user id per rank, once per request.
                request.data_parallel_rank = user_rank(request_user(request),
                                                       len(self.core_engines))
            return original(self, request)

        return get_core_engine_for_request

    return _wrap(client_cls, "get_core_engine_for_request", make)


def data_parallel_of(parallel_config: Any) -> tuple[int, int, bool]:
    """(this engine's rank, ranks, whether the API server pins users to ranks).

    Read in an engine process: vLLM gives each rank of a dense model a configuration of
    one rank of size 1 (keeping the rank as ``data_parallel_index``), so the size comes
    from ``DATA_PARALLEL_ENV`` when the API server set it.
    """
    rank = getattr(parallel_config, "data_parallel_index", None)
    if rank is None:
        rank = parallel_config.data_parallel_rank
    size, external = parallel_config.data_parallel_size, parallel_config.data_parallel_external_lb
    value = os.environ.get(DATA_PARALLEL_ENV, "")
    if value:
        count, _, kind = value.partition("/")
        if count.isdigit() and int(count) > size:
            size, external = int(count), kind == "external"
    return rank, size, size > 1 and not external
