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


@pytest.mark.parametrize("changes", [
    {"speculative_config": object()},
    {"parallel_config": NS(data_parallel_size=1, pipeline_parallel_size=2)},
    {"kv_transfer_config": object()},
    {"ec_transfer_config": object()},
    {"cache_config": NS(kv_offloading_size=4.0)},
    {"model_config": NS(is_multimodal_model=True)},
    {"model_config": NS(is_encoder_decoder=True)},
    {"model_config": NS(is_hybrid=True)},
    {"model_config": NS(is_attention_free=True)},
], ids=["spec", "pp", "kv-connector", "ec-connector", "kv-offload", "multimodal",
        "encoder-decoder", "hybrid", "attention-free"])
def test_production_modes_are_paced(changes):
    """Each is paced with a stated bound (docs/engine/modes.md, "Engine modes")."""
    assert unsupported_modes(config(**changes)) == []


@pytest.mark.parametrize(("changes", "named", "instead"), [
    ({"parallel_config": NS(data_parallel_size=2, pipeline_parallel_size=1,
                            data_parallel_hybrid_lb=True)}, "hybrid load balancing",
     "one API server for all ranks"),
    ({"scheduler_config": NS(scheduler_cls="my.Scheduler")}, "another custom scheduler",
     "class Mine(PacedScheduler, YourScheduler)"),
    ({"model_config": NS(is_diffusion=True)}, "diffusion", "at the gateway"),
])
def test_each_refused_mode_says_why_and_what_to_do(changes, named, instead):
    found = unsupported_modes(config(**changes))
    assert len(found) == 1 and named in found[0] and instead in found[0]


class _Combined:
    """A user's combination of the paced class with its own (only the MRO matters)."""


def test_a_class_derived_from_the_paced_one_is_ours():
    from tokenpace.engine._modes import _is_ours

    fake_base = type("PacedScheduler", (), {"__module__": "tokenpace.engine._scheduler"})
    combined = type("Mine", (fake_base,), {"__module__": "acme.sched"})
    assert _is_ours(combined)
    assert not _is_ours(_Combined)
    assert _is_ours("tokenpace.engine.PacedScheduler")
    assert not _is_ours("acme.missing.Scheduler")
