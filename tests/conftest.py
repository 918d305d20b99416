"""Fixtures shared by every test layer, and the markers a test gets from what it uses."""

from __future__ import annotations

from pathlib import Path

import pytest

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
