"""A real, throwaway PostgreSQL server: own port, own directory, stoppable.

The cluster is created with ``initdb`` in a temporary directory and listens on a free
loopback port with trust authentication; ``stop()`` and ``start()`` take it down and bring
it back on the same port with its data (a database outage). Postgres refuses to run as
root, so as root the server runs as ``nobody`` (through ``setpriv`` or ``runuser``).

``tokenpace bench metering`` and the ledger tests use it. A machine that cannot run one
(no server binaries, no psycopg, root without a way to drop privileges) raises
:class:`PostgresUnavailable` from the constructor, naming what is missing (``missing()``
says so without starting anything); a server that does not come up raises
``RuntimeError`` with its log.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .._process import free_port

psycopg: Any
try:
    import psycopg
except ImportError:
    psycopg = None

START_TIMEOUT_S = 60.0


class PostgresUnavailable(RuntimeError):
    """This machine cannot run a throwaway Postgres; the message says what is missing."""


def _binary(name: str) -> str | None:
    """A Postgres server binary: on PATH, in /usr/local/bin, or in Debian's versioned dir."""
    candidates = [Path("/usr/local/bin") / name, *Path("/usr/lib/postgresql").glob(f"*/bin/{name}")]
    return shutil.which(name) or next((str(p) for p in candidates if p.is_file()), None)


def _as_unprivileged() -> tuple[list[str], int, int]:
    """The command prefix that drops root, with the uid and gid it runs as (an empty prefix
    when not root); :class:`PostgresUnavailable` when root cannot drop its privileges."""
    if os.geteuid() != 0:
        return [], os.geteuid(), os.getegid()
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        raise PostgresUnavailable(
            "running as root and there is no 'nobody' user to run Postgres as") from None
    uid, gid = nobody.pw_uid, nobody.pw_gid
    if shutil.which("setpriv"):
        # setpriv execs the command itself, so the Popen pid is the server's own pid.
        return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"], uid, gid
    if shutil.which("runuser"):
        return ["runuser", "-u", "nobody", "--"], uid, gid
    raise PostgresUnavailable(
        "running as root and neither setpriv nor runuser is available to drop privileges")


def _requirements() -> tuple[str, str, list[str], int, int]:
    """initdb, postgres, the prefix that drops root and its uid and gid; or
    :class:`PostgresUnavailable` naming what is missing."""
    if psycopg is None:
        raise PostgresUnavailable("psycopg 3 is not installed (pip install 'psycopg[binary]>=3.1')")
    initdb, postgres = _binary("initdb"), _binary("postgres")
    if initdb is None or postgres is None:
        raise PostgresUnavailable(
            "Postgres server binaries (initdb, postgres) are not installed "
            "(apt-get install postgresql; make test does it as root)")
    return (initdb, postgres, *_as_unprivileged())


def missing() -> str | None:
    """Why no throwaway Postgres can run here (what is missing), or None; starts nothing."""
    try:
        _requirements()
    except PostgresUnavailable as exc:
        return str(exc)
    return None


class PostgresServer:
    """One throwaway cluster; ``url`` is its admin URL (database ``postgres``).

    The constructor runs ``initdb`` (a few seconds) and starts nothing; ``start`` waits
    until the server accepts connections. ``remove`` stops it and deletes its directory.
    """

    def __init__(self) -> None:
        initdb, self._postgres, self._prefix, uid, gid = _requirements()
        self.base = Path(tempfile.mkdtemp(prefix="tokenpace-pg-"))
        os.chown(self.base, uid, gid)
        self.data, self.log = self.base / "data", self.base / "server.log"
        self._env = {**os.environ, "HOME": str(self.base), "LC_ALL": "C"}
        done = subprocess.run(
            [*self._prefix, initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust",
             "--no-sync", "-E", "UTF8", "--locale=C"],
            cwd=self.base, env=self._env, capture_output=True, text=True, timeout=120,
        )
        if done.returncode != 0:
            shutil.rmtree(self.base, ignore_errors=True)
            raise RuntimeError(f"initdb failed:\n{done.stdout}\n{done.stderr}")
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PostgresServer:
        """Start the server (on the same port and data every time) and wait until it
        accepts connections; ``RuntimeError`` with its log if it exits or stays silent
        for :data:`START_TIMEOUT_S`."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*self._prefix, self._postgres, "-D", str(self.data), "-p", str(self.port),
                 "-k", str(self.base), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                 "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                 "-c", "shared_buffers=16MB", "-c", "max_connections=20"],
                cwd=self.base, env=self._env, stdout=out, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}:\n"
                                   f"{self.log.read_text()}")
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"postgres did not accept connections:\n{self.log.read_text()}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """A fast shutdown (ends sessions, no wait); the data stays for ``start``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def database(self, name: str) -> str:
        """Create database ``name`` (a plain identifier); its URL."""
        with psycopg.connect(self.url, autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)
