"""The vLLM internals the adapter relies on exist in the installed vLLM."""

from __future__ import annotations

import pytest

from tests.sched._harness import make_sim
from tokenpace.engine import _vllm


def test_all_internals_present(tiny_model):
    sim = make_sim(tiny_model, pacing={"default_user_output_tokens_per_second": 10})
    sim.add("r0", "u")
    request = sim.scheduler.requests["r0"]
    assert _vllm.internals_problems(sim.scheduler, request) == []


def test_a_missing_internal_is_reported_by_name(monkeypatch):
    class Stripped:
        pass

    monkeypatch.setattr(_vllm.Scheduler, "_reserve_prefill_lookahead", None)
    problems = _vllm.internals_problems(Stripped(), Stripped())
    assert "vllm Scheduler has no method _reserve_prefill_lookahead()" in problems
    assert "vllm Scheduler has no attribute 'max_num_active_reqs'" in problems
    assert "vllm Request has no attribute 'next_decode_eligible_step'" in problems


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.3.3"])
def test_another_vllm_version_refuses_to_start(tiny_model, monkeypatch, version):
    monkeypatch.setattr(_vllm.vllm, "__version__", version)
    with pytest.raises(RuntimeError, match=rf"vLLM {version} is installed; tokenpace "
                                           r"supports 0.32.x and 0.33.x"):
        make_sim(tiny_model, pacing={"default_user_output_tokens_per_second": 10})


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.33.0", "0.33.1rc1"])
def test_both_supported_series_start(tiny_model, monkeypatch, version):
    monkeypatch.setattr(_vllm.vllm, "__version__", version)
    make_sim(tiny_model, pacing={"default_user_output_tokens_per_second": 10})
