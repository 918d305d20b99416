"""Fixtures shared by every test layer, and the markers a test gets from what it uses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._engine_pool import EnginePool, ModuleEngines

# A test that uses one of these fixtures (directly or through another fixture) starts that
# server, and gets its marker here; a test that starts one itself carries the marker in its
# module (pytestmark) or on its function. The markers are declared in pyproject.toml.
SERVER_FIXTURES = {
    "redis_server": "redis",
    "postgres_server": "postgres",
    "pg_url": "postgres",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by the servers its fixtures start; every ``vllm`` test is ``slow``
    too (an engine takes tens of seconds to start). O(tests x fixtures)."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        for marker in sorted({SERVER_FIXTURES[n] for n in names if n in SERVER_FIXTURES}):
            item.add_marker(marker)
        if item.get_closest_marker("vllm") is not None:
            item.add_marker("slow")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's own tiny model, written once per test session."""
    from tokenpace.tiny_model import write_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    write_tiny_model(path)
    return path


_POOL = pytest.StashKey[EnginePool]()


@pytest.fixture(scope="session")
def engine_pool(request: pytest.FixtureRequest, tiny_model: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePool]:
    """The session's engine pool (``tests/_engine_pool.py``); modules use ``module_engines``."""
    modules = dict.fromkeys(item.module for item in request.session.items
                            if getattr(item, "module", None) is not None)
    pool = EnginePool(tiny_model, tmp_path_factory.mktemp, list(modules))
    request.session.stash[_POOL] = pool
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def module_engines(engine_pool: EnginePool, request: pytest.FixtureRequest) -> Iterator[ModuleEngines]:
    """The engines the module's ``ENGINES`` function launches, ready; stopped at its end.
    Started together with the next such module's (``tests/_engine_pool.py``)."""
    beside = request.node.get_closest_marker("no_timing") is not None
    try:
        yield engine_pool.take(request.module, beside_tests=beside)
    finally:
        engine_pool.release(request.module)


@pytest.fixture(autouse=True)
def _engine_starts_beside_untimed_tests_only(request: pytest.FixtureRequest) -> None:
    """A test marked ``no_timing`` lets the next module's engines start beside it; before
    any other test, wait for engines still starting (``tests/_engine_pool.py``)."""
    if request.node.get_closest_marker("no_timing") is not None:
        request.getfixturevalue("engine_pool").launch_following(request.module)
        return
    pool = request.session.stash.get(_POOL, None)
    if pool is not None:
        pool.settle()
