"""Bench commands run in the background, two at a time, for the quick-bench tests.

Most of a quick bench's wall time is its engines' start-up: per engine a chain of three
processes (API server, engine core, worker), each importing vLLM and torch on one core,
so a bench alone leaves the second core of a 2-core machine mostly idle. ``BenchRuns``
runs the module's bench commands as soon as the module's first test asks for one, at most
``slots`` at a time, in the order they were added; each test waits for its own. A bench
added as ``exclusive`` (one whose assertions bound timings seen at the client) runs with
nothing beside it.

Each command's output goes to ``NAME.stdout`` and ``NAME.stderr`` in its own directory.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

TIMEOUT_S = 900.0
"""A command still running after this long is killed (and its test fails)."""


@dataclass
class Done:
    """A finished command: its exit status (None: killed at ``TIMEOUT_S``) and output."""

    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float


@dataclass
class _Job:
    name: str
    argv: list[str]
    out: Path
    exclusive: bool
    finished: threading.Event = field(default_factory=threading.Event)
    done: Done | None = None


class BenchRuns:
    """The module's bench commands (see the module docstring); ``result`` waits for one."""

    def __init__(self, slots: int = 2) -> None:
        self._slots = slots
        self._jobs: dict[str, _Job] = {}
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def add(self, name: str, argv: list[str], out: Path, exclusive: bool = False) -> None:
        if self._thread is not None:
            raise RuntimeError("add every command before the first result()")
        self._jobs[name] = _Job(name, argv, out, exclusive)

    def result(self, name: str) -> Done:
        """Wait for ``name``'s command (starting them all on the first call)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._schedule, name="bench-runs",
                                            daemon=True)
            self._thread.start()
        job = self._jobs[name]
        job.finished.wait()
        assert job.done is not None
        return job.done

    def close(self) -> None:
        """Start nothing more and kill what still runs (nothing, once every test of the
        module has had its result; something when the session stops early)."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(60)

    def _schedule(self) -> None:
        queue = list(self._jobs.values())
        running: list[tuple[_Job, subprocess.Popen[bytes], float]] = []
        try:
            while (queue or running) and not self._closing.is_set():
                for entry in list(running):
                    if self._finish(*entry):
                        running.remove(entry)
                alone = any(job.exclusive for job, _, _ in running)
                if queue and not alone and (not running or (
                        not queue[0].exclusive and len(running) < self._slots)):
                    job = queue.pop(0)
                    running.append((job, *self._start(job)))
                    continue
                time.sleep(0.2)
        finally:
            for _, proc, _ in running:
                _stop(proc)
            for job in self._jobs.values():
                if job.done is None:
                    job.done = Done(None, "", "stopped: the test module ended first", 0.0)
                job.finished.set()

    @staticmethod
    def _start(job: _Job) -> tuple[subprocess.Popen[bytes], float]:
        job.out.mkdir(parents=True, exist_ok=True)
        with open(job.out / f"{job.name}.stdout", "wb") as stdout, \
                open(job.out / f"{job.name}.stderr", "wb") as stderr:
            proc = subprocess.Popen(job.argv, stdout=stdout, stderr=stderr)
        return proc, time.monotonic()

    @staticmethod
    def _finish(job: _Job, proc: subprocess.Popen[bytes], started: float) -> bool:
        """Record ``job`` if its command ended (or kill it past ``TIMEOUT_S``)."""
        wall = time.monotonic() - started
        if proc.poll() is None:
            if wall < TIMEOUT_S:
                return False
            _stop(proc)
        returncode = proc.returncode if wall < TIMEOUT_S else None
        read = lambda kind: (job.out / f"{job.name}.{kind}").read_text(errors="replace")  # noqa: E731
        job.done = Done(returncode, read("stdout"), read("stderr"), round(wall, 1))
        job.finished.set()
        return True


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT first, so that the bench's ``finally`` stops its servers (they run in
    process groups of their own); SIGKILL after 30 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
