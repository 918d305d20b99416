"""`tokenpace bench tenants --quick` runs (gateways in front of the canned fast upstream,
no engine) and reports its figures; the structural ones hold: the page of
/metrics follows the active tenants, not the configured ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_tenants_quick(tmp_path: Path) -> None:
    out, png = tmp_path / "tenants.json", tmp_path / "tenants.png"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenpace.cli", "bench", "tenants", "--quick",
         "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert png.stat().st_size > 10_000
    result = json.loads(out.read_text())
    assert result["benchmark"] == "tenants"
    small, large = result["arms"]
    assert (small["configured"], large["configured"]) == (100, 2000)
    # The same 100 tenants send in both arms: the same series, whatever is configured.
    assert small["metrics"]["lines"] == large["metrics"]["lines"] > 0
    for arm in result["arms"]:
        assert arm["startup_s"]["median"] > 0 and arm["cpu_ms_per_request"]["median"] > 0
        assert len(arm["extra_wait_ms"]["metrics"]) == len(arm["extra_wait_ms"]["reload"]) == 2
    assert large["cpu_ratio_to_first"]["median"] > 0
