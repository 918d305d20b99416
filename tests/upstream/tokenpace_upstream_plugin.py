"""pytest plugin for running vLLM's own scheduler tests, stock or with tokenpace's classes.

Loaded with ``-p tokenpace_upstream_plugin`` (this folder on ``PYTHONPATH``) by
``run_upstream.py``, in a tree extracted from vLLM's source distribution. Its module name is
not under ``tests`` because that package name belongs to vLLM's test tree there.

``TOKENPACE_UPSTREAM_PACED=1``: before any test module is imported, the names
``vllm.v1.core.sched.scheduler.Scheduler`` and ``vllm.v1.core.sched.async_scheduler.
AsyncScheduler`` (what the tests import, directly or through ``tests/v1/core/utils.py``)
become subclasses of ``tokenpace.engine.PacedScheduler`` / ``PacedAsyncScheduler`` that put
a ``tokenpace`` section into ``vllm_config.additional_config`` before construction, with a
rate no test reaches, so that pacing is really on (``planner`` is not None).

``TOKENPACE_UPSTREAM_REPORT=PATH``: one JSON line per test: its outcome, the first line of
its error, whether the error is tokenpace's refusal of a mode, and how many schedulers (and
paced schedulers with pacing on) the test built.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

PACED = os.environ.get("TOKENPACE_UPSTREAM_PACED") == "1"
RATE = float(os.environ.get("TOKENPACE_UPSTREAM_RATE", "1000000"))
REFUSAL = "tokenpace output pacing does not support "

# Counts of the test now running (reset at each test's setup).
_built = {"schedulers": 0, "paced": 0, "pacing_on": 0}


def _pacing_section() -> dict[str, Any]:
    return {"default_user_output_tokens_per_second": RATE}


def _install() -> None:
    import vllm.v1.core.sched.async_scheduler as async_module
    import vllm.v1.core.sched.scheduler as sync_module

    stock_init = sync_module.Scheduler.__init__

    def counting_init(self, *args, **kwargs):  # every scheduler built, stock or not
        _built["schedulers"] += 1
        stock_init(self, *args, **kwargs)

    sync_module.Scheduler.__init__ = counting_init
    if not PACED:
        return

    from tokenpace.engine import PacedAsyncScheduler, PacedScheduler

    def with_pacing(base: type) -> type:
        def __init__(self, vllm_config, *args, **kwargs):
            additional = dict(vllm_config.additional_config or {})
            additional["tokenpace"] = _pacing_section()
            vllm_config.additional_config = additional
            _built["paced"] += 1
            base.__init__(self, vllm_config, *args, **kwargs)
            if getattr(self, "planner", None) is not None:
                _built["pacing_on"] += 1

        name = f"Upstream{base.__name__}"
        return type(name, (base,), {"__init__": __init__, "__module__": __name__,
                                    "__qualname__": name})

    sync_module.Scheduler = with_pacing(PacedScheduler)
    async_module.AsyncScheduler = with_pacing(PacedAsyncScheduler)


def pytest_configure(config: pytest.Config) -> None:
    _install()


def _first_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return crash.message.strip().splitlines()[0] if crash.message.strip() else ""
    text = str(report.longrepr or "").strip()
    return text.splitlines()[-1] if text else ""


_results: dict[str, dict[str, Any]] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for key in _built:
        _built[key] = 0


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _results.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed",
                                                "error": "", "refused": "",
                                                "duration": 0.0})
    entry["duration"] += report.duration
    if report.when == "call" and hasattr(report, "wasxfail"):
        entry["outcome"] = "xfailed" if report.skipped else "xpassed"
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        entry["error"] = _first_line(report)
    elif report.failed and entry["outcome"] in ("passed", "skipped"):
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry["error"] = _first_line(report)
        text = str(report.longrepr or "")
        at = text.find(REFUSAL)
        if at >= 0:
            entry["refused"] = text[at + len(REFUSAL):].splitlines()[0]
    if report.when == "teardown":
        entry.update({f"built_{key}": value for key, value in _built.items()})


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("TOKENPACE_UPSTREAM_REPORT")
    if not path:
        return
    with open(path, "w", encoding="utf-8") as out:
        for entry in _results.values():
            out.write(json.dumps(entry) + "\n")
