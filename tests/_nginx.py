"""A real nginx (Debian's package) for end-to-end tests, on a free port, with the shipped
configuration of deploy/nginx/ (so the test runs what the docs tell users to run).

Missing ``nginx``: a skip that says how to install it, except in CI (``CI=true``), where
it is a failure (``make services`` installs it).
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

DEPLOY_NGINX = Path(__file__).resolve().parents[1] / "deploy" / "nginx"


def nginx_binary() -> str:
    path = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)
    if path is None:
        message = "nginx is not installed: apt-get install nginx (make services does)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


class Nginx:
    """One nginx master process in the foreground, its files all in ``directory``."""

    def __init__(self, directory: Path, http_block: str, port: int) -> None:
        self.binary = nginx_binary()
        self.dir = directory
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        directory.mkdir(parents=True, exist_ok=True)
        temp = {name: directory / name for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
        for path in temp.values():
            path.mkdir(exist_ok=True)
        self.config = directory / "nginx.conf"
        self.config.write_text(f"""
daemon off;
worker_processes 1;
pid {directory / "nginx.pid"};
error_log {directory / "error.log"} info;
{"user root;" if os.geteuid() == 0 else ""}
events {{ worker_connections 256; }}
http {{
    access_log {directory / "access.log"};
    client_body_temp_path {temp["body"]};
    proxy_temp_path {temp["proxy"]};
    fastcgi_temp_path {temp["fastcgi"]};
    uwsgi_temp_path {temp["uwsgi"]};
    scgi_temp_path {temp["scgi"]};
{http_block}
}}
""")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Nginx:
        check = subprocess.run([self.binary, "-t", "-q", "-c", str(self.config),
                                "-p", str(self.dir)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(self.config), "-p", str(self.dir)],
            stdout=(self.dir / "stdout.log").open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("nginx exited: " + self.log_tail())
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("nginx did not listen within 10 s: " + self.log_tail())

    def log_tail(self) -> str:
        path = self.dir / "error.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # nginx's graceful stop
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
