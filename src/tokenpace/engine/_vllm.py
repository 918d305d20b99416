"""Every vLLM internal that the adapter relies on, named in one place.

vLLM's scheduler is not a public interface. tokenpace supports the vLLM series in
``SUPPORTED_VLLM_SERIES`` and checks at start-up (and in a test) that the names below
still exist, so a different vLLM fails loudly with a list of what changed instead of
mis-pacing silently. Every difference between the supported series that the adapter has
to know about is handled here (see ``watchdog_paused``); docs/engine/versions.md "vLLM versions"
lists each seam and how it was verified on each series.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

SUPPORTED_VLLM_SERIES = ("0.32.", "0.33.")

# Scheduler attributes read or written around `schedule()`:
# - running, requests, waiting, policy: the queues and the preemption policy;
# - current_step: `schedule()` increments it first, then skips a running request while
#   `current_step < request.next_decode_eligible_step` (our "skip this step" seam);
# - max_num_active_reqs: waiting admission stops when len(running) reaches it (raised for
#   one call by the number of throttled requests, capped by max_num_running_reqs);
# - max_num_scheduled_tokens: upper bound of one request's tokens in one step;
# - kv_holding_waiting: the second queue that waiting admission takes from (with waiting);
# - num_sampled_tokens_per_step: the sure tokens of a decode step (1), beyond which the
#   tokens a step returns are accepted speculative drafts (_scheduler._return_rejected).
SCHEDULER_ATTRIBUTES = (
    "running",
    "requests",
    "waiting",
    "kv_holding_waiting",
    "policy",
    "current_step",
    "max_num_active_reqs",
    "max_num_running_reqs",
    "max_num_scheduled_tokens",
    "num_sampled_tokens_per_step",
    "num_spec_tokens",  # k, the drafts a decode step may verify (bulk windows, _drafts)
    "connector",  # None without a KV connector (bulk windows need none)
    "vllm_config",
)
# Methods overridden (hooks) or called.
SCHEDULER_METHODS = (
    "schedule",
    "add_request",
    "_handle_blocked_waiting_request",  # False defers a waiting request for this step
    "_reserve_prefill_lookahead",  # sees the final chunk size of a waiting request
    # (bound on the instance for a step that starts with requests waiting, see _scheduler)
    "shutdown",
    # (request, delay_free_blocks=False): the one place every request that ends passes,
    # once, with its status already finished: from update_from_output (a stop, max_tokens)
    # and from finish_requests (an abort, an error); its counts are kept there (_aborted).
    # (0.32 calls it from those two places only.)
    "_free_request",
    "update_from_output",  # (SchedulerOutput, ModelRunnerOutput): rejected drafts go back
)
# Speculative decoding (_scheduler._grant_drafts): the drafts a decode step will verify are
# ``request.spec_token_ids`` when schedule() starts (cut there to the user's quota); the
# ones it scheduled are SchedulerOutput.scheduled_spec_decode_tokens (request id -> list),
# and ModelRunnerOutput.sampled_token_ids[req_id_to_index[request id]] holds the sure
# tokens followed by the accepted drafts.
# Bulk windows of drafts (_windows): the engine's batch queue holds at most
# VllmConfig.max_concurrent_batches steps (2 under async scheduling with pipeline parallel
# 1), so at most one step is in flight when schedule() runs; update_from_output(that
# SchedulerOutput) applies its results, after the aborts that came while it ran. A request
# that ended meanwhile is gone from ``requests`` and gets nothing; a preempted one gets
# them as stale output, or not at all (drop_stale_output: a prefix-cache reset), told
# apart by its output length. Request.is_finished() marks one counted when it ended.
# Request fields used to decide whether a step samples and to skip it.
REQUEST_ATTRIBUTES = (
    "request_id",
    "sampling_params",
    "priority",
    "arrival_time",
    "status",
    "num_computed_tokens",
    "num_tokens",
    "num_tokens_with_spec",
    "spec_token_ids",
    "_all_token_ids",  # its length is num_tokens_with_spec without drafts (read per step)
    "num_output_placeholders",
    "next_decode_eligible_step",
    "lora_request",  # its adapter: at most max_loras adapters per step (_lora_misfits)
    "is_prefill_chunk",  # set by _update_after_schedule: False after a sampling step
    "_output_token_ids",  # its length, before and after a step's results: tokens delivered
    # (and, in a bulk window of drafts, once per window; it only grows, except for a
    # streaming-input session, which vLLM marks:)
    "resumable",
    # An ended request's counts, kept for the gateway (_aborted): the tokens generated
    # (delivered ones; under async scheduling not the step still in flight) and the prompt.
    "num_output_tokens",
    "num_prompt_tokens",
)

# Methods wrapped outside the scheduler (see _hooks), as (module, class, method), and the
# attributes the wrappers read.
HOOKED_METHODS = (
    ("vllm.engine.arg_utils", "EngineArgs", "create_engine_config"),
    ("vllm.v1.engine.core", "EngineCoreProc", "_process_engine_step"),
    ("vllm.v1.engine.core", "EngineCoreProc", "_handle_client_request"),
    ("vllm.v1.engine.core", "EngineCoreProc", "is_running"),
    ("vllm.v1.executor.multiproc_executor", "WorkerProc", "_init_message_queues"),
    ("vllm.v1.engine.core_client", "DPLBAsyncMPClient", "get_core_engine_for_request"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "add_request"),
)
# EngineCoreProc instance attributes: scheduler, input_queue (a queue.Queue of
# (request_type, request)), batch_queue (None or deque of (future, SchedulerOutput, future)).
# DPLBAsyncMPClient (API server, data parallel): core_engines (one per rank, in rank order),
# vllm_config; EngineCoreRequest: sampling_params, data_parallel_rank (the rank it goes to
# when set; the X-data-parallel-rank header sets it too).
# ParallelConfig: data_parallel_size, data_parallel_rank, data_parallel_external_lb,
# data_parallel_hybrid_lb.
# Rate control (_control): the API server's app.state.engine_client (AsyncLLM) has
# engine_core with call_utility_async(method, *args); EngineCoreProc._handle_client_request
# runs a UTILITY request as getattr(engine_core, method)(*args) in the engine's busy loop;
# call_utility_all_async(method, *args) gives one answer per data-parallel rank, in the
# order of the client's core_engines (_aborted, _ended: each rank's book answers alone).
# EngineCoreProc._convert_msgspec_args asserts a call has no more arguments than the
# method's signature lists: our utilities take one (``*args`` counts as one).
# AsyncLLM.add_request(request_id, prompt, params, ...) (API server): every generating
# endpoint calls it with the SamplingParams whose extra_args hold the body's vllm_xargs
# (or an EngineCoreRequest as prompt, whose sampling_params are its own).
# The API server gives each request an id of its own plus "-" and 8 random characters
# (InputProcessor.assign_request_id), the id the scheduler's Request has; a request with
# n > 1 becomes n engine requests "{i}_" + that id (ParentRequest.get_child_info). Its own
# ids (X: the X-Request-Id header): chat and Messages "chatcmpl-X", completions "cmpl-X-{p}"
# per prompt p, Responses the body's request_id + "_{turn}" (gateway.relay names them).
# SchedulerConfig: scheduler_cls, async_scheduling. The worker's rpc_broadcast_mq has a
# _spin_condition whose busy_loop_s is the spin time after each message.
SPIN_CONDITION = ("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition")


def hook_problems() -> list[str]:
    """What is missing among the methods that ``_hooks`` wraps (empty: all good)."""
    import importlib
    import inspect

    problems: list[str] = []
    for module_name, cls_name, method in HOOKED_METHODS:
        cls = getattr(importlib.import_module(module_name), cls_name, None)
        if cls is None or not callable(getattr(cls, method, None)):
            problems.append(f"{module_name}.{cls_name}.{method}() is missing")
    module_name, cls_name = SPIN_CONDITION
    spin = getattr(importlib.import_module(module_name), cls_name, None)
    if spin is None or "busy_loop_s" not in inspect.signature(spin).parameters:
        problems.append(f"{module_name}.{cls_name} no longer takes busy_loop_s")
    return problems


_NO_WATCHDOG = object()
_watch_dog_module: object | None = None


def _watch_dog() -> object:
    """vLLM's watchdog module, imported once (``_NO_WATCHDOG`` on 0.32, which has none)."""
    global _watch_dog_module
    if _watch_dog_module is None:
        try:
            import vllm.utils.watch_dog as module  # noqa: PLC0415 (absent in 0.32)
        except ImportError:
            _watch_dog_module = _NO_WATCHDOG
        else:
            _watch_dog_module = module
    return _watch_dog_module


@contextlib.contextmanager
def watchdog_paused() -> Iterator[None]:
    """Pause vLLM's stack-dump watchdog (0.33 and later) around a wait for work.

    vLLM 0.33's engine loop feeds a watchdog at each step and disables it while it blocks
    on its input queue (``--watchdog-config``, off unless ``dump_dir`` is set): a wait
    longer than its timeout would otherwise be reported as a stuck engine, with a dump of
    every thread. The idle wait (``_hooks``) is such a wait. vLLM 0.32 has no watchdog.
    Cost: one call and a flag write per idle wait, none per step.
    """
    module = _watch_dog()
    if module is _NO_WATCHDOG:
        yield
        return
    with module.get_watch_dog().disable():  # type: ignore[attr-defined]
        yield


def _supported_series() -> str:
    return " and ".join(f"{series}x" for series in SUPPORTED_VLLM_SERIES)


def internals_problems(scheduler: object | None = None, request: object | None = None) -> list[str]:
    """What is missing or changed in this vLLM, as readable lines (empty: all good)."""
    problems: list[str] = []
    if not vllm.__version__.startswith(SUPPORTED_VLLM_SERIES):
        problems.append(
            f"vLLM {vllm.__version__} is installed; tokenpace supports {_supported_series()}"
        )
    for name in SCHEDULER_METHODS:
        if not callable(getattr(Scheduler, name, None)):
            problems.append(f"vllm Scheduler has no method {name}()")
    if scheduler is not None:
        for name in SCHEDULER_ATTRIBUTES:
            if not hasattr(scheduler, name):
                problems.append(f"vllm Scheduler has no attribute {name!r}")
    if request is not None:
        for name in REQUEST_ATTRIBUTES:
            if not hasattr(request, name):
                problems.append(f"vllm Request has no attribute {name!r}")
    if not hasattr(SchedulingPolicy, "PRIORITY") or not hasattr(SchedulingPolicy, "FCFS"):
        problems.append("vllm SchedulingPolicy lacks FCFS/PRIORITY")
    return problems


__all__ = [
    "AsyncScheduler",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "SchedulingPolicy",
    "hook_problems",
    "internals_problems",
    "watchdog_paused",
]
