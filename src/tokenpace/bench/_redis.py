"""A ``redis-server`` started for one benchmark run (the benchmarks that share state)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def start_redis(home: Path, command: str, instead: str = "") -> tuple[subprocess.Popen[bytes], str]:
    """Start ``redis-server`` on a free port with its files in ``home``; returns the process
    and its URL (database 0). ``command`` names the benchmark in the error messages,
    ``instead`` what the user may do instead of installing it."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(f"{command}: error: redis-server is not installed "
                         f"(apt-get install redis-server){instead}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # The set-up docs/gateway.md recommends: an append-only file, fsync every second.
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(home),
                             "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                             "--daemonize", "no"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"{command}: error: redis-server did not start")


def stop_redis(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
