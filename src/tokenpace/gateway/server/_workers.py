"""``tokenpace gateway --workers N``: N gateway processes serving one port.

One Python process serves on one core; ``--workers N`` runs N of them. Each worker binds
the same address with ``SO_REUSEPORT``, so the kernel spreads new connections over them;
they share budgets, slots and fair-queue counters through the configured ``state`` store
(refused without one: see ``_state.check_workers``). The parent only supervises: it
passes SIGHUP (reload) and SIGTERM/SIGINT on to every worker and starts a worker again
when one dies unexpectedly, so a crashed worker's connections are lost but the port keeps
serving (its slots come back when its leases expire).
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

logger = logging.getLogger("tokenpace.gateway")

WORKER_FLAG = "--worker-of"
"""Internal flag a worker is started with (``--worker-of N``): bind with SO_REUSEPORT."""

RESTART_DELAY_S = 1.0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other workers may bind too (Linux, BSD, macOS)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def supervise(worker_argv: Sequence[str], workers: int) -> int:
    """Run ``workers`` copies of ``worker_argv`` until SIGTERM/SIGINT; restart crashed ones."""
    procs: list[subprocess.Popen[bytes] | None] = [None] * workers
    stopping = False

    def start(i: int) -> None:
        procs[i] = subprocess.Popen([*worker_argv, WORKER_FLAG, str(workers)])

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        if signum in (signal.SIGTERM, signal.SIGINT):
            stopping = True
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    for i in range(workers):
        start(i)
    while not stopping:
        time.sleep(0.2)
        for i, proc in enumerate(procs):
            if proc is not None and proc.poll() is not None and not stopping:
                logger.error("gateway worker %d (pid %d) exited with %s; starting it again",
                             i, proc.pid, proc.returncode)
                time.sleep(RESTART_DELAY_S)
                start(i)
    codes = []
    for proc in procs:
        if proc is None:
            continue
        try:
            codes.append(proc.wait(timeout=40))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return 0 if all(code in (0, -signal.SIGTERM, -signal.SIGINT) for code in codes) else 1


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The command line of one worker: this command without ``--workers``."""
    out: list[str] = [sys.executable, "-m", "tokenpace.cli", "gateway"]
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--workers":
            skip = True
            continue
        if arg.startswith("--workers="):
            continue
        out.append(arg)
    return out
