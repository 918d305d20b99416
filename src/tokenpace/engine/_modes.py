"""Engine modes that pacing refuses at start-up, and why.

Two kinds: modes that break the accounting (several tokens per step, several schedulers
that would each grant a user its quota) and modes whose skip/preempt/refund paths were
never checked. Data parallel is supported where each user can be pinned to one rank (see
``_hooks``, part 4).
"""

from __future__ import annotations

from typing import Any


def unsupported_modes(vllm_config: Any, scheduler: Any = None) -> list[str]:
    """One line per unsupported mode in ``vllm_config`` (empty: pacing can run).

    ``scheduler``, when given, is checked for connectors it created from other settings.
    """
    found: list[str] = []
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    if getattr(parallel, "data_parallel_size", 1) > 1 and getattr(
        parallel, "data_parallel_hybrid_lb", False
    ):
        found.append(
            "data parallel with hybrid load balancing (--data-parallel-hybrid-lb: each "
            "node's API server would pin users among its own ranks only, so a user could "
            "meet one limiter per node; use one API server for all ranks, or one server "
            "per rank behind tokenpace gateway's sticky routing)"
        )
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        found.append("pipeline parallel > 1")
    for attr, name in (
        ("is_multimodal_model", "multimodal models"),
        ("is_encoder_decoder", "encoder-decoder models"),
        ("is_hybrid", "hybrid (attention + state-space) models"),
        ("is_attention_free", "attention-free models"),
        ("is_diffusion", "diffusion models"),
    ):
        if bool(getattr(model, attr, False)):
            found.append(name)
    if vllm_config.kv_transfer_config is not None:
        found.append("KV connectors (--kv-transfer-config)")
    if getattr(vllm_config, "ec_transfer_config", None) is not None:
        found.append("encoder-cache connectors (--ec-transfer-config)")
    if scheduler is not None and getattr(scheduler, "aux_output_connector", None) is not None:
        found.append("aux output connectors")
    if getattr(cache, "kv_offloading_size", None) is not None:
        found.append("KV offload (--kv-offloading-size)")
    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if scheduler_cls is not None and not _is_ours(scheduler_cls):
        found.append(f"another custom scheduler class ({scheduler_cls!r})")
    return found


def _is_ours(scheduler_cls: Any) -> bool:
    name = scheduler_cls if isinstance(scheduler_cls, str) else (
        f"{scheduler_cls.__module__}.{scheduler_cls.__qualname__}"
    )
    return name.startswith("tokenpace.")
