"""``pytest -p tests._repeat`` runs each selected test ``TOKENPACE_REPEAT`` times.

For measuring the distribution of timing-derived values: the repeats share the
module's servers, as the tests of one CI run do. Not loaded by ``make test``.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def _tokenpace_repeat(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    count = int(os.environ.get("TOKENPACE_REPEAT", "1"))
    if count > 1:
        metafunc.fixturenames.append("_tokenpace_repeat")
        metafunc.parametrize("_tokenpace_repeat", range(count), indirect=True,
                             ids=[f"run{i}" for i in range(count)])
