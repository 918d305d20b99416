"""`tokenpace bench scheduler --quick` runs and writes the documented JSON."""

from __future__ import annotations

import json

from tokenpace.cli import main


def test_quick_bench_writes_cases(tiny_model, tmp_path):
    out, png = tmp_path / "sched.json", tmp_path / "sched.png"
    assert main(["bench", "scheduler", "--quick", "--model", str(tiny_model),
                 "--json", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000
    data = json.loads(out.read_text())
    import vllm

    assert data["vllm"] == vllm.__version__ and data["cpu"]
    assert [(c["running"], c["throttled_fraction"]) for c in data["cases"]] == [(64, 0.0), (64, 1.0)]
    for case in data["cases"]:
        assert case["stock_us_per_step"] > 0 and case["paced_us_per_step"] > 0


def test_quick_bench_with_async_scheduling_and_drafts(tiny_model, tmp_path):
    out = tmp_path / "sched-async.json"
    assert main(["bench", "scheduler", "--quick", "--model", str(tiny_model),
                 "--spec-tokens", "2", "--async-scheduling", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["async_scheduling"] is True and data["spec_tokens"] == 2
    for case in data["cases"]:
        assert case["stock_us_per_step"] > 0 and case["paced_us_per_step"] > 0
