"""Stopping a server stops its whole process group, also after its leader died alone."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from tests._servers import Server, group_members

# The leader starts a child that stays in its process group (as vLLM's engine core does),
# prints the child's pid, then waits.
_LEADER = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def _child_pid(log: Path) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = log.read_text().strip()
        if text:
            return int(text)
        time.sleep(0.05)
    raise AssertionError("the leader did not report its child")


def test_stop_kills_the_group_left_behind_by_a_killed_leader(tmp_path: Path) -> None:
    server = Server([sys.executable, "-c", _LEADER], 0, tmp_path / "log")
    child = _child_pid(tmp_path / "log")
    pgid = server.proc.pid
    assert child in group_members(pgid)
    os.kill(server.proc.pid, signal.SIGKILL)  # the API server alone dies
    server.proc.wait(timeout=10)
    assert server.exited()
    assert child in group_members(pgid), "the orphaned child survives its leader"
    server.stop()
    assert group_members(pgid) == []


def test_stop_of_a_running_server_leaves_no_process(tmp_path: Path) -> None:
    server = Server([sys.executable, "-c", _LEADER], 0, tmp_path / "log")
    _child_pid(tmp_path / "log")
    pgid = server.proc.pid
    server.stop()
    assert server.exited() and group_members(pgid) == []
