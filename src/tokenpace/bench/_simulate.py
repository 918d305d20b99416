"""Drive vLLM's real scheduler and KV cache manager with synthetic model output.

Everything but the model runner is real: `VllmConfig` over the project's tiny model,
vLLM's `Scheduler` / `AsyncScheduler` (or tokenpace's subclasses), the real KV cache
manager. The model runner is replaced by "sample token 7 for every request that reached
its sampling position", and the limiter's clock by a fake one advanced per step.

Used by the scheduler tests and by `tokenpace bench scheduler`.
"""

from __future__ import annotations

import random
import time
import zlib
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from tokenpace.engine import PacedAsyncScheduler, PacedScheduler

BLOCK_SIZE = 16
SAMPLED_TOKEN = 7
NS = 1_000_000_000

init_none_hash(sha256)
_HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)


class FakeClock:
    def __init__(self) -> None:
        self.now_ns = 10 * NS

    def __call__(self) -> int:
        return self.now_ns


@dataclass
class Sim:
    """One scheduler plus the bookkeeping that tests assert on."""

    scheduler: Any
    clock: FakeClock
    step_ns: int
    is_async: bool
    users: dict[str, str] = field(default_factory=dict)  # request id -> user
    loras: dict[str, int] = field(default_factory=dict)  # request id -> LoRA adapter id
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # delivered
    finished: dict[str, str] = field(default_factory=dict)  # request id -> reason
    dispatched: list[tuple[int, int, str, str]] = field(default_factory=list)
    """(step, t_ns, user, request id) of every dispatched sampling step (= kept charges)."""
    preempted: list[str] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    step_index: int = 0
    scheduler_cpu_ns: int = 0
    """Process CPU time spent inside schedule() and update_from_output()."""
    accept: float = 0.0
    """Speculative decoding: each draft in turn is accepted with this probability, until
    the first rejection (as a target model verifies drafts)."""
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    delivered: list[tuple[int, str, str, int]] = field(default_factory=list)
    """(dispatch t_ns, user, request id, tokens) of every step's delivered tokens."""
    undelivered: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Per user: dispatched sampling steps that delivered nothing (their request ended
    or was aborted while they ran). Their sure token stays charged: charged tokens are
    the delivered ones plus these."""
    drafts_scheduled: int = 0
    drafts_accepted: int = 0
    in_flight: int = 0
    """Steps whose results come back later: 1 under async scheduling, ``pp - 1`` under
    pipeline parallel (vLLM's batch queue), 0 otherwise."""
    _inflight: deque[tuple[Any, set[str], int]] = field(default_factory=deque)

    def add(self, rid: str, user: str | None, *, prompt_len: int = 8, max_tokens: int = 50,
            priority: int = 0, arrival: float | None = None,
            xargs: dict[str, Any] | None = None,
            images: tuple[tuple[int, int], ...] = (),
            lora: int | None = None) -> None:
        """Add a request; ``xargs`` are further ``vllm_xargs`` (e.g. a gateway's rate);
        ``images``: (offset, length) of each encoder input's placeholder in the prompt
        (the scheduler budgets and caches them; see ``Sim.set_encoder_budget``);
        ``lora``: the id (>= 1) of the LoRA adapter the request runs with (needs
        ``make_sim(max_loras=...)``; only the scheduler sees it, nothing is loaded)."""
        extra = {"output_rate_user": user} if user is not None else {}
        extra.update(xargs or {})
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None)
        seed = zlib.crc32(rid.encode())
        prompt = [(seed + i) % 400 + 3 for i in range(prompt_len)]
        features = [
            MultiModalFeatureSpec(data=MultiModalKwargsItem.dummy(),
                                  mm_position=PlaceholderRange(offset=offset, length=length),
                                  identifier=f"{rid}-image{j}", modality="image")
            for j, (offset, length) in enumerate(images)
        ]
        adapter = LoRARequest(lora_name=f"adapter{lora}", lora_int_id=lora,
                              lora_path=f"/nonexistent/adapter{lora}") if lora is not None else None
        req = Request(rid, prompt, params, None,
                      arrival_time=arrival if arrival is not None else float(len(self.users)),
                      priority=priority, block_hasher=_HASHER, mm_features=features or None,
                      lora_request=adapter)
        self.users[rid] = user or "__anonymous__"
        if lora is not None:
            self.loras[rid] = lora
        self.scheduler.add_request(req)

    def set_encoder_budget(self, compute_tokens: int, cache_tokens: int) -> None:
        """The encoder budget and cache a multimodal model's processor would give the
        scheduler (the tiny model is text-only, so vLLM gives it none): at most
        ``compute_tokens`` of encoder inputs per step, ``cache_tokens`` kept."""
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

        self.scheduler.max_num_encoder_input_tokens = compute_tokens
        self.scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=cache_tokens)

    def abort(self, rid: str) -> None:
        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.finished[rid] = "abort"

    def step(self, abort_in_flight: Sequence[str] = ()) -> Any:
        """One engine step; async keeps one step in flight like vLLM's engine loop.
        ``abort_in_flight``: requests aborted after this step is scheduled and before
        the results of the step in flight are applied (vLLM's engine takes the aborts
        that arrived while a step ran there)."""
        self.step_index += 1
        t0 = time.process_time_ns()
        out = self.scheduler.schedule()
        self.scheduler_cpu_ns += time.process_time_ns() - t0
        self.outputs.append(out)
        sampled = {
            rid for rid in out.num_scheduled_tokens
            if not self.scheduler.requests[rid].is_prefill_chunk
        }
        self.preempted.extend(out.preempted_req_ids or ())
        for rid in sampled:
            self.dispatched.append((self.step_index, self.clock.now_ns, self.users[rid], rid))
        if self.in_flight:
            self._inflight.append((out, sampled, self.clock.now_ns))
            for rid in abort_in_flight:
                self.abort(rid)
            if len(self._inflight) > self.in_flight:
                self._update(*self._inflight.popleft())
        else:
            for rid in abort_in_flight:
                self.abort(rid)
            self._update(out, sampled, self.clock.now_ns)
            if self.scheduler.num_spec_tokens:
                self._propose(sampled)
        self.clock.now_ns += self.step_ns
        return out

    def drain(self) -> None:
        while self._inflight:
            self._update(*self._inflight.popleft())

    def _propose(self, sampled: set[str]) -> None:
        """Sync speculative decoding: the drafter proposes ``k`` drafts for each request
        that sampled (vLLM's engine does this after ``update_from_output``)."""
        ids = [rid for rid in sampled if rid in self.scheduler.requests]
        k = self.scheduler.num_spec_tokens
        self.scheduler.update_draft_token_ids(
            DraftTokenIds(req_ids=ids, draft_token_ids=[[SAMPLED_TOKEN] * k for _ in ids]))

    def _sample(self, out: Any, rid: str) -> list[int]:
        """One sure token, plus the accepted prefix of the request's scheduled drafts."""
        drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
        accepted = 0
        while accepted < drafts and self.rng.random() < self.accept:
            accepted += 1
        self.drafts_scheduled += drafts
        self.drafts_accepted += accepted
        return [SAMPLED_TOKEN] * (1 + accepted)

    def _update(self, out: Any, sampled: set[str], t_ns: int) -> None:
        ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[self._sample(out, rid) if rid in sampled else [] for rid in ids],
        )
        t0 = time.process_time_ns()
        outputs = self.scheduler.update_from_output(out, mro)
        self.scheduler_cpu_ns += time.process_time_ns() - t0
        got: set[str] = set()
        for eco in outputs.values():
            for o in eco.outputs:
                self.tokens[o.request_id] += len(o.new_token_ids)
                if o.new_token_ids:
                    got.add(o.request_id)
                    self.delivered.append(
                        (t_ns, self.users[o.request_id], o.request_id, len(o.new_token_ids)))
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)
        for rid in sampled - got:
            self.undelivered[self.users[rid]] += 1

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds * NS / self.step_ns)):
            self.step()

    def delivered_times(self, user: str) -> list[int]:
        """The dispatch instant of each token delivered to ``user``, in order."""
        return [t for t, u, _, n in self.delivered if u == user for _ in range(n)]

    def user_times(self, user: str) -> list[int]:
        return [t for _, t, u, _ in self.dispatched if u == user]

    def per_request(self, user: str) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for _, _, u, rid in self.dispatched:
            if u == user:
                counts[rid] += 1
        return counts


def make_sim(
    model: Path,
    *,
    is_async: bool = False,
    pacing: dict[str, Any] | None = None,
    paced_class: bool = True,
    max_num_seqs: int = 16,
    max_num_active_seqs: int | None = None,
    max_num_batched_tokens: int = 512,
    num_blocks: int = 1000,
    policy: str = "fcfs",
    step_ns: int = 10_000_000,
    max_model_len: int = 2048,
    prefill_schedule_interval: int = 1,
    spec_tokens: int = 0,
    accept: float = 0.7,
    pipeline_parallel: int = 1,
    kv_transfer: dict[str, Any] | None = None,
    max_loras: int | None = None,
    max_lora_rank: int = 8,
) -> Sim:
    """``max_loras``: enable LoRA (vLLM's ``LoRAConfig``), at most that many distinct
    adapters in one step; None: no LoRA."""
    model_config = ModelConfig(model=str(model), max_model_len=max_model_len, seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_num_active_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=is_async,
        policy=policy,
        prefill_schedule_interval=prefill_schedule_interval,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto")
    cache_config.num_gpu_blocks = num_blocks
    additional = {"tokenpace": pacing} if pacing is not None else {}
    # n-gram drafting: a proposer that lives in the worker, so the scheduler sees only
    # the drafts this simulation hands it (``Sim._propose``); vLLM takes async scheduling
    # with its GPU flavour only (the scheduler then uses placeholder drafts).
    speculative = SpeculativeConfig(
        method="ngram_gpu" if is_async else "ngram", num_speculative_tokens=spec_tokens,
        prompt_lookup_max=3, prompt_lookup_min=1) if spec_tokens else None
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        speculative_config=speculative,
        parallel_config=ParallelConfig(pipeline_parallel_size=pipeline_parallel),
        kv_transfer_config=KVTransferConfig(**kv_transfer) if kv_transfer else None,
        lora_config=LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank)
        if max_loras is not None else None,
        additional_config=additional,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64,
                                  dtype=torch.float32),
            )
        ],
    )
    if paced_class:
        cls = PacedAsyncScheduler if is_async else PacedScheduler
    else:
        cls = AsyncScheduler if is_async else Scheduler
    scheduler = cls(
        vllm_config, kv_cache_config, StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE, log_stats=True,
    )
    clock = FakeClock()
    planner = getattr(scheduler, "planner", None)
    if planner is not None:
        planner.limiter.clock_ns = clock
    return Sim(scheduler=scheduler, clock=clock, step_ns=step_ns, is_async=is_async,
               accept=accept, in_flight=1 if is_async else pipeline_parallel - 1)


def max_in_window(times: list[int], window_ns: int) -> int:
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] > window_ns:
            lo += 1
        best = max(best, hi - lo + 1)
    return best
