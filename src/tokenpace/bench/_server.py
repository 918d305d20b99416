"""Start and stop real vLLM servers (stock or paced) for benchmarks and end-to-end tests.

Each server runs in its own process group so that its engine core and workers die with
it, and logs to a file that is shown when start-up fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 300.0
KV_CACHE_BYTES = 256 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """A server process in its own process group, so the engine core dies with it."""

    def __init__(self, argv: Sequence[str], port: int, log_path: Path) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
        self.proc = subprocess.Popen(
            list(argv), stdout=self._log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        self._log.close()

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server and all its processes, alive now."""
        return tree_cpu_seconds(self.proc.pid)


def start_all(servers: Sequence[Server]) -> None:
    """Wait for servers that were started together (their start-ups overlap)."""
    try:
        for srv in servers:
            srv.wait_ready()
    except BaseException:
        for srv in servers:
            srv.stop()
        raise


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants, alive now."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def vllm_server_argv(model: Path, port: int, *extra: str) -> list[str]:
    """Plain vLLM's OpenAI server on the CPU (the tiny model's usual flags)."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager",
        *extra,
    ]


def tokenpace_serve_argv(model: Path, port: int, *flags: str) -> list[str]:
    """`tokenpace serve MODEL ...` on the CPU, with the tiny model's usual vLLM flags."""
    return [
        sys.executable, "-m", "tokenpace.cli", "serve", str(model),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager",
        *flags,
    ]
