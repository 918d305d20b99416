"""`tokenpace bench hostile` runs two cheap attacks against real gateway processes in front
of the fake engine (no vLLM start), writes its JSON and plot, and its baseline serves the
victim without an error (so the battery cannot rot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.gateway._engine import EngineServer


def test_bench_hostile_two_attacks(engine: EngineServer, tmp_path: Path) -> None:
    out, png = tmp_path / "hostile.json", tmp_path / "hostile.png"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenpace.cli", "bench", "hostile", "--quick",
         "--engine-url", engine.url, "--attacks", "huge_model_names,slowloris",
         "--duration", "2", "--baseline", "1.5", "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert png.stat().st_size > 10_000
    result = json.loads(out.read_text())
    assert result["benchmark"] == "hostile"
    assert [p["name"] for p in result["phases"]] == ["baseline", "huge_model_names", "slowloris"]
    alone = result["phases"][0]["victim"]["alone"]
    # 2 s at 8 requests/s: the victim alone is served every time, each request with a row.
    assert alone["sent"] >= 10 and alone["ok"] == alone["sent"] and alone["errors"] == {}
    for phase in result["phases"]:
        assert phase["gateway"]["rss_peak_mb"] > 0
        assert phase["ledger"]["victim_answered_ok"] > 0
        assert phase["ledger"]["victim_ok_without_row"] == 0
        assert phase["ledger"]["rows"]["victim"] >= phase["ledger"]["victim_answered_ok"]
    names, loris = result["phases"][1], result["phases"][2]
    for phase in (names, loris):
        victim = phase["victim"]
        assert victim["baseline"]["sent"] > 0 and victim["attack"]["sent"] > 0
        assert victim["p99_ratio"] > 0 and victim["p99_ratio_to_baseline_phase"] > 0
    # Two connections send 3 huge-name requests each, each counted once (answered, failed
    # or in flight at the stop); the first goes out at once.
    assert 1 <= sum(names["attacker"]["outcomes"].values()) <= 6
    # 8 connections of each kind: each one's fate counted once.
    outcomes = loris["attacker"]["outcomes"]
    for kind in ("headers", "body"):
        assert sum(v for k, v in outcomes.items() if k.startswith(f"{kind}:")) == 8
