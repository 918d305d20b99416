"""Test modules' vLLM engines, each started beside another one instead of alone.

A tiny-model engine takes about 30 s to start, nearly all of it three processes (API
server, engine core, worker) importing vLLM and torch one after the other: one core of a
2-core machine, the other idle. So the pool starts a module's engines together with those
of the next module that has some (in the session's order): two start-ups share the two
cores, and the next module finds its engines ready. Each module keeps engines of its own
(no state is shared between modules); only their start-ups overlap.

A module opts in with a module-level function that launches its engines, without waiting
for them, and takes them with the ``module_engines`` fixture (``tests/conftest.py``)::

    def ENGINES(tiny_model: Path, home: Path) -> list[Server]:
        port = free_port()
        return [Server(tokenpace_serve_argv(tiny_model, port, ...), port, home / "vllm.log")]

    @pytest.fixture(scope="module")
    def engine(module_engines: ModuleEngines) -> Server:
        [srv] = module_engines.servers
        return srv

``home`` is the module's own temporary directory (event logs, key files). The engines are
ready when the fixture returns and stopped at the module's end.

Nothing starts beside a test: when a module's engines are launched with the next module's,
its fixture waits for both; and before every test the pool waits for engines still
starting (``settle``), except before a test marked ``no_timing`` (it asserts no time bound
that a start-up beside it could break: it is only slowed). Such a test launches the next
module's engines (``launch_following``), and a module whose ``pytestmark`` has
``no_timing`` does when it takes its own, so that they start beside its tests.

Costs: besides the running module's engines, those of the next module are alive (idle:
about 0.01 core each, and their memory), and those launched for a module that then never
asked for them (its tests skipped), until the session ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

from tests._servers import Server

@dataclass
class ModuleEngines:
    """A module's engines, ready, in the order its ``ENGINES`` returned them, and its directory."""

    servers: list[Server]
    home: Path


@dataclass
class _Launch:
    home: Path
    servers: list[Server] = field(default_factory=list)
    error: BaseException | None = None
    waited: bool = False


class EnginePool:
    """The session's engine launches, one entry per module (see the module docstring)."""

    def __init__(self, tiny_model: Path, mktemp: Callable[[str], Path],
                 modules: Sequence[ModuleType]) -> None:
        self._model = tiny_model
        self._mktemp = mktemp
        self._order = [m.__name__ for m in modules]
        self._modules = {m.__name__: m for m in modules}
        self._launches: dict[str, _Launch] = {}

    def take(self, module: ModuleType, beside_tests: bool) -> ModuleEngines:
        """``module``'s engines, ready (launching them, and the next module's, if not yet).
        ``beside_tests``: the module's tests may run while the next module's engines start.
        Raises what launching or starting ``module``'s engines raised."""
        name = module.__name__
        launched_before = name in self._launches
        own = self._launch(name)
        following = self._following(name)
        if following is not None and (beside_tests or not launched_before):
            self._launch(following)
        self._wait(own)
        if own.error is not None:
            raise own.error
        if not beside_tests:
            self.settle()
        return ModuleEngines(list(own.servers), own.home)

    def launch_following(self, module: ModuleType) -> None:
        """Launch the engines of the next module after ``module`` that has some, unless
        launched already (a test marked ``no_timing`` of ``module`` runs now)."""
        following = self._following(module.__name__)
        if following is not None:
            self._launch(following)

    def settle(self) -> None:
        """Wait until no launched engine is still starting (failures are kept for the
        module that asks for those engines)."""
        for launch in list(self._launches.values()):
            self._wait(launch)

    def release(self, module: ModuleType) -> None:
        """Stop ``module``'s engines (its last test has run)."""
        launch = self._launches.get(module.__name__)
        if launch is not None:
            _stop(launch.servers)
            launch.servers = []

    def close(self) -> None:
        for launch in self._launches.values():
            _stop(launch.servers)
            launch.servers = []

    def _following(self, name: str) -> str | None:
        if name not in self._order:
            return None
        later = self._order[self._order.index(name) + 1:]
        return next((n for n in later if callable(getattr(self._modules[n], "ENGINES", None))),
                    None)

    def _launch(self, name: str) -> _Launch:
        launch = self._launches.get(name)
        if launch is not None:
            return launch
        module = self._modules.get(name)
        if module is None:  # a module the session did not collect with ENGINES
            raise KeyError(f"{name} has no ENGINES function")
        launch = _Launch(self._mktemp(name.rsplit(".", 1)[-1]))
        self._launches[name] = launch
        try:
            launch.servers = list(module.ENGINES(self._model, launch.home))
        except _RAISED_LATER as exc:  # a skip too: it is the module's, not the caller's
            launch.error, launch.waited = exc, True
        return launch

    @staticmethod
    def _wait(launch: _Launch) -> None:
        if launch.waited:
            return
        launch.waited = True
        try:
            for server in launch.servers:
                server.wait_ready()
        except _RAISED_LATER as exc:
            launch.error = exc
            _stop(launch.servers)
            launch.servers = []


_RAISED_LATER = (Exception, pytest.skip.Exception, pytest.fail.Exception)
"""What launching or starting a module's engines may raise: kept, and raised by its ``take``."""


def _stop(servers: list[Server]) -> None:
    for server in servers:
        server.stop()
