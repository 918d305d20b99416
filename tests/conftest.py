"""Fixtures shared by every test layer."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's own tiny model, written once per test session."""
    from tokenpace.tiny_model import write_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    write_tiny_model(path)
    return path
