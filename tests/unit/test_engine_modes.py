"""Start-up refusal of engine modes that pacing cannot account for."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from tokenpace.engine._modes import unsupported_modes


def config(**changes):
    base = dict(
        model_config=NS(is_multimodal_model=False, is_encoder_decoder=False, is_hybrid=False,
                        is_attention_free=False, is_diffusion=False),
        parallel_config=NS(data_parallel_size=1, pipeline_parallel_size=1),
        cache_config=NS(kv_offloading_size=None),
        scheduler_config=NS(scheduler_cls=None),
        speculative_config=None, kv_transfer_config=None, ec_transfer_config=None,
    )
    base.update(changes)
    return NS(**base)


def test_plain_decoder_is_supported():
    assert unsupported_modes(config()) == []
    # Data parallel: users are pinned to one rank by the API server, or (one server per
    # rank) by the load balancer in front.
    for lb in ({}, {"data_parallel_external_lb": True}):
        dp = NS(data_parallel_size=2, pipeline_parallel_size=1, data_parallel_hybrid_lb=False, **lb)
        assert unsupported_modes(config(parallel_config=dp)) == []
    ours = config(scheduler_config=NS(scheduler_cls="tokenpace.engine.PacedScheduler"))
    assert unsupported_modes(ours) == []
    # Speculative decoding: drafts are granted from the quota (pacing._drafts).
    assert unsupported_modes(config(speculative_config=object())) == []


@pytest.mark.parametrize(("changes", "named"), [
    ({"parallel_config": NS(data_parallel_size=2, pipeline_parallel_size=1,
                            data_parallel_hybrid_lb=True)}, "hybrid load balancing"),
    ({"parallel_config": NS(data_parallel_size=1, pipeline_parallel_size=2)}, "pipeline parallel"),
    ({"kv_transfer_config": object()}, "KV connectors"),
    ({"ec_transfer_config": object()}, "encoder-cache connectors"),
    ({"cache_config": NS(kv_offloading_size=4.0)}, "KV offload"),
    ({"scheduler_config": NS(scheduler_cls="my.Scheduler")}, "another custom scheduler"),
    ({"model_config": NS(is_multimodal_model=True)}, "multimodal"),
    ({"model_config": NS(is_encoder_decoder=True)}, "encoder-decoder"),
    ({"model_config": NS(is_hybrid=True)}, "hybrid"),
    ({"model_config": NS(is_attention_free=True)}, "attention-free"),
    ({"model_config": NS(is_diffusion=True)}, "diffusion"),
])
def test_each_mode_is_named(changes, named):
    found = unsupported_modes(config(**changes))
    assert len(found) == 1 and named in found[0]
