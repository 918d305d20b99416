"""vLLM's own scheduler tests, run with vLLM's stock classes and with tokenpace's paced ones.

The peer measure of design.md section 6: ``tests/v1/core`` from the source distribution of
the installed vLLM (fetched at test time into ``.upstream-cache/``, never committed) runs
twice (``run_upstream.py``): stock, then with ``PacedScheduler`` / ``PacedAsyncScheduler``
substituted and pacing on at a rate no test reaches. Every test that passes stock must
pass paced, except those in ``allowlist.txt`` (each with its reason); an allow-listed test
that passes paced fails this test too, so that the list only shrinks.

The whole comparison takes about 2 minutes of 2 cores (two pytest runs of ~1 minute each),
plus a one-time download of the sdist (45 MB). Without network access the test skips,
except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_upstream  # noqa: E402

ALLOWLIST = HERE / "allowlist.txt"


def load_allowlist(path: Path = ALLOWLIST) -> dict[str, str]:
    """Node id -> reason, from ``<node id>  # <reason>`` lines."""
    entries: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        nodeid, _, reason = line.partition("  # ")
        nodeid = nodeid.strip()
        assert reason.strip(), f"{path}: {nodeid} has no reason"
        assert nodeid not in entries, f"{path}: {nodeid} is listed twice"
        entries[nodeid] = reason.strip()
    return entries


def test_allowlist_parses() -> None:
    entries = load_allowlist()
    assert all("::" in nodeid and nodeid.startswith("tests/v1/core/") for nodeid in entries)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_vllm_scheduler_suite_passes_paced(tmp_path: Path, capsys) -> None:
    pytest.importorskip("vllm")
    try:
        run_upstream.sdist_path(run_upstream.vllm_version())
    except Exception as exc:  # no network, no index: nothing to compare
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"cannot fetch vLLM's source distribution: {exc}")
        pytest.skip(f"cannot fetch vLLM's source distribution: {exc}")

    result = run_upstream.run(tmp_path, [], timeout=1500)
    out = os.environ.get("TOKENPACE_UPSTREAM_JSON")
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    with capsys.disabled():  # the counts belong in CI's log
        print("\n" + run_upstream.table(result))

    summary = result["summary"]
    assert summary["stock_pass_builds_scheduler"] > 100, (
        "too few tests built a scheduler: the suite did not really run\n"
        + result["log_tail"]["stock"])
    assert summary["paced_pass_with_pacing_on"] > 100, (
        "too few tests ran with pacing on: the substitution did not happen\n"
        + result["log_tail"]["paced"])

    allowed = load_allowlist()
    unexpected = [t for t in result["tests"]
                  if t["stock"] == "passed" and t["verdict"] != "passes paced"
                  and t["nodeid"] not in allowed]
    fixed = [t["nodeid"] for t in result["tests"]
             if t["nodeid"] in allowed and t["verdict"] == "passes paced"]
    problems = [
        f"{t['nodeid']}: {t['verdict']}: "
        f"{t.get('refused') or t.get('error') or ''}"[:400] for t in unexpected
    ] + [f"{nodeid}: passes paced now: remove it from {ALLOWLIST.name}" for nodeid in fixed]
    assert not problems, "\n".join(problems)
