"""The Redis a benchmark measures against: a ``redis-server`` started for the run (or one
given by URL), and its CPU time.

``bench state`` and ``bench gateway --state redis`` need the same set-up, the one
docs/gateway/replicas.md recommends (an append-only file, fsync every second), and ``bench gateway``
also counts what the store costs beyond the gateway process: the server's own CPU time
(``INFO``'s ``used_cpu_*``: ``getrusage`` of the server, main and background threads) and
the commands it ran (``total_commands_processed``: every command, those a Lua script
calls included, so a script of three calls counts 4; not round trips), read alike from a
server the bench started and from one it was given.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SETUP = "started by the bench (appendonly, fsync everysec)"


def redis_server_binary(command: str, flag: str, url_flag: bool = True) -> str:
    """The path of ``redis-server``, or a CLI error that says what to do (``flag`` is the
    option that asked for Redis, e.g. ``--state redis``; ``url_flag``: the command also
    takes ``--redis URL``)."""
    binary = shutil.which("redis-server")
    if binary is None:
        instead = ", or pass --redis URL" if url_flag else ""
        raise SystemExit(f"{command}: error: {flag} needs redis-server, which is not installed "
                         f"(apt-get install redis-server){instead}")
    return binary


@dataclass(frozen=True)
class Usage:
    """A reading of the server's counters, or (``since``) the difference of two."""

    cpu_s: float
    commands: int

    def since(self, before: Usage) -> Usage:
        """What the server did between two readings, less the earlier reading's own
        ``INFO`` (Redis counts a command once it has run, so the later reading counts the
        earlier one, not itself)."""
        return Usage(self.cpu_s - before.cpu_s, self.commands - before.commands - 1)


class RedisServer:
    """A Redis for one benchmark run: started here (``start``) or given (``given``)."""

    def __init__(self, url: str, proc: subprocess.Popen[bytes] | None = None) -> None:
        self.url = url
        self.proc = proc
        self._client: Any = None

    @property
    def setup(self) -> str:
        return SETUP if self.proc is not None else "given (--redis URL)"

    @classmethod
    def start(cls, home: Path, command: str, flag: str, url_flag: bool = True) -> RedisServer:
        binary = redis_server_binary(command, flag, url_flag)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # The set-up docs/gateway/replicas.md recommends: an append-only file, fsync every second.
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                                 str(home), "--save", "", "--appendonly", "yes",
                                 "--appendfsync", "everysec", "--daemonize", "no"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return cls(f"redis://127.0.0.1:{port}/0", proc)
            except OSError:
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
        proc.kill()
        proc.wait(10)
        raise SystemExit(f"{command}: error: redis-server did not start")

    @classmethod
    def given(cls, url: str, command: str) -> RedisServer:
        """An existing Redis (``--redis URL``), checked now: a wrong URL is a CLI error
        before any server starts, not a gateway that fails to start later."""
        server = cls(url)
        try:
            server.usage()
        except Exception as exc:  # redis-py: ValueError for the URL, RedisError to connect
            server.stop()
            raise SystemExit(f"{command}: error: --redis: cannot use this Redis: {exc}") from None
        return server

    def usage(self) -> Usage:
        """The server's CPU time and commands since it started (``INFO``; one round trip,
        some tens of microseconds of the server's own CPU, outside any timed span)."""
        if self._client is None:
            import redis

            self._client = redis.Redis.from_url(self.url, socket_timeout=10)
        info = self._client.info()
        return Usage(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
                     int(info["total_commands_processed"]))

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
