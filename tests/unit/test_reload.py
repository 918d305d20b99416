"""Limits-file reload: edits apply, broken edits keep the last good limits."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenpace.pacing import RELOAD_CHECK_NS, LimitsFileWatcher


class Clock:
    def __init__(self) -> None:
        self.ns = 10**12

    def __call__(self) -> int:
        return self.ns


def _write(path: Path, text: str, bump_ns: int) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump_ns))  # distinct mtime


def test_edit_applies_after_the_check_interval(tmp_path: Path) -> None:
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"a": 10}))
    clock = Clock()
    watcher = LimitsFileWatcher(path, 5.0, clock)
    assert watcher.poll() is None  # unchanged since start
    _write(path, json.dumps({"a": 40, "b": 2}), 1)
    clock.ns += 1
    assert watcher.poll() is None  # not yet time to look
    clock.ns += RELOAD_CHECK_NS
    result = watcher.poll()
    assert result is not None and result.error is None and result.limits is not None
    assert result.limits.rate("a") == 40 and result.limits.rate("b") == 2
    assert result.limits.rate("anyone") == 5.0
    clock.ns += RELOAD_CHECK_NS
    assert watcher.poll() is None  # reported once


def test_broken_or_missing_file_reports_once_and_recovers(tmp_path: Path) -> None:
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"a": 10}))
    clock = Clock()
    watcher = LimitsFileWatcher(path, 5.0, clock)
    _write(path, '{"a": 40, "oops"', 1)
    clock.ns += RELOAD_CHECK_NS
    result = watcher.poll()
    assert result is not None and result.limits is None
    assert result.error is not None and "keeping the last good limits" in result.error
    clock.ns += RELOAD_CHECK_NS
    assert watcher.poll() is None
    path.unlink()
    clock.ns += RELOAD_CHECK_NS
    missing = watcher.poll()
    assert missing is not None and missing.error is not None and "missing" in missing.error
    _write(path, json.dumps({"a": 0.5}), 2)
    clock.ns += RELOAD_CHECK_NS
    fixed = watcher.poll()
    assert fixed is not None and fixed.limits is not None and fixed.limits.rate("a") == 0.5


def test_bad_rate_in_an_edit_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "limits.json"
    path.write_text("{}")
    clock = Clock()
    watcher = LimitsFileWatcher(path, 5.0, clock)
    _write(path, json.dumps({"a": -3}), 1)
    clock.ns += RELOAD_CHECK_NS
    result = watcher.poll()
    assert result is not None and result.error is not None and "'a'" in result.error
