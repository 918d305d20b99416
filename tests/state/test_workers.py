"""``--workers``: the supervisor and the shared listening socket (real processes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tokenpace.gateway.server._workers import reuse_port_socket, worker_argv

# One write per line (shorter than PIPE_BUF, so atomic): the workers share one pipe.
WORKER = ("import os, sys, time; sys.stdout.write(f'{os.getpid()} {sys.argv[1:]}\\n'); "
          "sys.stdout.flush(); time.sleep(60)")


def test_two_workers_bind_one_port() -> None:
    first = reuse_port_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = reuse_port_socket("127.0.0.1", port)
    try:
        assert second.getsockname()[1] == port
    finally:
        first.close()
        second.close()


def test_worker_argv_drops_workers() -> None:
    argv = worker_argv(["--config", "g.yaml", "--workers", "3", "--port", "8000", "--workers=2"])
    assert argv[1:] == ["-m", "tokenpace.cli", "gateway", "--config", "g.yaml", "--port", "8000"]


def test_supervisor_restarts_a_killed_worker_and_stops_on_sigterm() -> None:
    code = ("import sys; from tokenpace.gateway.server._workers import supervise; "
            f"sys.exit(supervise([sys.executable, '-c', {WORKER!r}], 2))")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        lines = [parent.stdout.readline() for _ in range(2)]
        assert all("'--worker-of', '2'" in line for line in lines), lines
        pids = [line.split()[0] for line in lines]
        os.kill(int(pids[0]), signal.SIGKILL)
        line = parent.stdout.readline()  # the replacement worker announces itself
        new_pid = int(line.split()[0])
        assert str(new_pid) not in pids
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 0
        for pid in (int(pids[1]), new_pid):  # every worker got the SIGTERM
            deadline = time.monotonic() + 5
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(pid)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_workers_without_state_are_refused_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text('engines: [{url: "http://127.0.0.1:1"}]\n'
                      'tenants: [{id: t, api_keys: ["k"]}]\n'
                      f'ledger: "sqlite:///{tmp_path}/u.db"\n')
    done = subprocess.run([sys.executable, "-m", "tokenpace.cli", "gateway", "--config",
                           str(config), "--workers", "2"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "--workers 2 needs shared state" in done.stderr and "'state'" in done.stderr
