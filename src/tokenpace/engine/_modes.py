"""Engine modes that pacing refuses at start-up, each with its reason.

Pacing charges a token when a step that samples is dispatched and refunds it at the end
of ``schedule()`` if the step was not dispatched after all; everything else about a
request (its blocks, its encoder inputs, its connector's transfers, its state-space
cache) is vLLM's business. That accounting holds in every mode below that is *not*
refused (docs/engine/modes.md, "Engine modes", has a section per mode with its bound):

- speculative decoding: a step's drafts are granted from the quota, cut to it, and the
  rejected ones given back (``pacing._drafts``);
- KV connectors and KV offload, the decode side of disaggregated prefill included: a
  request waiting for remote or offloaded KV is a waiting request (charged only by the
  admission step that reaches its sampling position); an asynchronous load schedules
  nothing and is refunded; a throttled request stays in ``running`` with its blocks;
- multimodal, encoder-decoder, hybrid and attention-free models: the encoder budget, the
  encoder cache and Mamba's block-aligned split only shorten prefill chunks, which the
  refund point sees (a chunk that stops short of the sampling position is refunded);
- pipeline parallel: several batches in flight, each charged at its own dispatch; a
  request whose step is in flight has nothing to schedule and is not charged again;
- data parallel with one API server (users pinned to ranks) or one server per rank
  behind a sticky router.
"""

from __future__ import annotations

import importlib
from typing import Any


def unsupported_modes(vllm_config: Any, scheduler: Any = None) -> list[str]:
    """One line per refused mode in ``vllm_config``, each saying why and what to do
    instead (empty: pacing can run). ``scheduler`` is accepted for callers that have one
    (nothing it creates is refused any more)."""
    del scheduler
    found: list[str] = []
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if getattr(parallel, "data_parallel_size", 1) > 1 and getattr(
        parallel, "data_parallel_hybrid_lb", False
    ):
        found.append(
            "data parallel with hybrid load balancing (--data-parallel-hybrid-lb: each "
            "node's API server would pin users among its own ranks only, so a user could "
            "meet one limiter per node; use one API server for all ranks, or one server "
            "per rank behind tokenpace gateway's sticky routing)"
        )
    if bool(getattr(model, "is_diffusion", False)):
        found.append(
            "diffusion language models (a step writes a whole block of tokens with no "
            "token it is sure to keep, so there is no per-token step to charge and delay; "
            "pace such a model's users at the gateway (tokenpace gateway's budgets) "
            "instead)"
        )
    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if scheduler_cls is not None and not _is_ours(scheduler_cls):
        found.append(
            f"another custom scheduler class ({scheduler_cls!r}): pacing is a subclass "
            "of vLLM's Scheduler and AsyncScheduler; to combine it with yours, define "
            "class Mine(PacedScheduler, YourScheduler) (or PacedAsyncScheduler with async "
            "scheduling) where YourScheduler subclasses vLLM's scheduler and calls "
            "super().schedule(), and pass --scheduler-cls with its dotted name"
        )
    return found


def _is_ours(scheduler_cls: Any) -> bool:
    """Whether the class is tokenpace's, or derives from it (a combination as the
    refusal above describes). A name that does not import is judged by its name."""
    cls = scheduler_cls
    if isinstance(scheduler_cls, str):
        if scheduler_cls.startswith("tokenpace."):
            return True
        module, _, name = scheduler_cls.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return False
    return any(base.__module__.startswith("tokenpace.") for base in getattr(cls, "__mro__", ()))
