"""Start and stop server processes (vLLM, stock or paced): `tokenpace up`, benchmarks, tests.

It lives outside ``bench`` because ``tokenpace up`` runs engines with it in production.

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
from collections.abc import Mapping, Sequence
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

    def __init__(self, argv: Sequence[str], port: int, log_path: Path,
                 env: Mapping[str, str] | None = None) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
                   **(env or {}))
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
        """Stop the whole process group, also when its leader is already gone.

        vLLM's engine-core and worker processes share the API server's group; when the API
        server alone was killed (or crashed) they keep running and keep their memory, so
        the group is signalled whatever the leader's state.
        """
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        if not _group_gone(self.proc.pid, timeout_s=30.0):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
            _group_gone(self.proc.pid, timeout_s=10.0)
        self._log.close()

    def exited(self) -> bool:
        """True once the server's own process (the group leader) has ended."""
        return self.proc.poll() is not None

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server and all its processes, alive now."""
        return tree_cpu_seconds(self.proc.pid)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of group ``pgid``, read from /proc (Linux).

    Zombies are left out: an orphaned member that died waits for whoever adopted it to
    reap it, which a container's init may never do, and it holds no memory.
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


def _group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def start_all(servers: Sequence[Server]) -> None:
    """Wait for servers that were started together (their start-ups overlap)."""
    try:
        for srv in servers:
            srv.wait_ready()
    except BaseException:
        for srv in servers:
            srv.stop()
        raise


def print_log_tails(servers: Sequence[Server], lines: int = 20) -> None:
    """The last ``lines`` of each server's log, to stderr: for a run that failed, what the
    servers said about it (their files may live in a directory removed afterwards)."""
    for srv in servers:
        try:
            tail = srv.log_tail(lines)
        except OSError as exc:
            tail = f"(unreadable: {exc})"
        print(f"--- {srv.log_path.name}, last {lines} lines ---\n{tail}", file=sys.stderr)


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


PROMPT_TOKENS_DETAILS = "--enable-prompt-tokens-details"
"""The vLLM flag that makes an engine report cached prompt tokens in its usage
(``prompt_tokens_details.cached_tokens``; Messages: ``cache_read_input_tokens``), which the
gateway prices at ``cost.cached_prompt``. Without it the count is absent and the gateway
charges the whole prompt at ``cost.prompt``."""


def with_prompt_tokens_details(flags: Sequence[str]) -> list[str]:
    """``flags`` (vLLM flags for an engine behind the gateway) with
    ``--enable-prompt-tokens-details`` added, unless the operator already said either way
    (``--enable-prompt-tokens-details``, ``--no-enable-prompt-tokens-details``, with
    underscores or ``=value``, as vLLM's parser accepts them)."""
    said = {flag.split("=", 1)[0].replace("_", "-") for flag in flags if flag.startswith("--")}
    if said & {PROMPT_TOKENS_DETAILS, "--no-" + PROMPT_TOKENS_DETAILS[2:]}:
        return list(flags)
    return [*flags, PROMPT_TOKENS_DETAILS]


def vllm_server_argv(model: Path, port: int, *extra: str) -> list[str]:
    """Plain vLLM's OpenAI server on the CPU (the tiny model's usual flags, its float32 as
    ``tokenpace serve`` picks it, so that both run the same kernels on any host)."""
    from .tiny_model import serving_flags

    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager",
        *serving_flags(model),
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
