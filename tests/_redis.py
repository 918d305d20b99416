"""A real, throwaway ``redis-server`` for tests: own port, own directory, killable.

It persists every write (``appendfsync always``) so that a test can SIGKILL it and start
it again on the same port and directory with its data, as a production Redis with an
append-only file would come back. Missing ``redis-server``: a skip that says how to
install it, except in CI (``CI=true``), where it is a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def require_redis_client() -> None:
    """At the top of a test module that imports the Redis store: skip the module (or fail,
    in CI) when redis-py is missing, rather than an import error at collection."""
    try:
        import redis  # noqa: F401
    except ImportError:
        message = "the redis client is not installed: pip install 'tokenpace[gateway]'"
        if os.environ.get("CI", "").lower() == "true":
            raise ImportError(message) from None
        pytest.skip(message, allow_module_level=True)


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        message = ("redis-server is not installed: apt-get install redis-server "
                   "(Debian/Ubuntu) or brew install redis")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    try:
        import redis  # noqa: F401
    except ImportError:
        message = "the redis client is not installed: pip install 'tokenpace[gateway]'"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process; ``kill()`` is SIGKILL, ``start()`` brings it back."""

    def __init__(self, directory: Path, password: str | None = None, tls: bool = False) -> None:
        self.binary = redis_server_binary()
        self.password = password
        self.tls = tls
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self._listen = ["--port", str(self.port)]
        if tls:
            # A self-signed certificate for 127.0.0.1; the client trusts it as its CA.
            cert, key = self.dir / "cert.pem", self.dir / "key.pem"
            if shutil.which("openssl") is None:
                pytest.skip("openssl is needed to make a certificate for the TLS test")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                            "-keyout", str(key), "-out", str(cert), "-days", "1",
                            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                           check=True, capture_output=True)
            self._listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file",
                            str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
                            str(cert), "--tls-auth-clients", "no"]
            self.url = f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={cert}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, *self._listen, "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", "--appendonly", "yes", "--appendfsync", "always",
             "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning",
             *(["--requirepass", self.password] if self.password else [])],
            stdout=(self.dir / "redis.log").open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.dir / 'redis.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    if self.tls:
                        return self  # listening; the TLS handshake is the client's test
                    sock.sendall(b"PING\r\n")
                    # With a password PING answers -NOAUTH: the server is up either way.
                    if sock.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer within 10 s")

    def kill(self) -> None:
        """SIGKILL, as a crash would end it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
