"""Counting the garbage collector's runs inside a block of code: a step that must allocate
no object per request shows it by setting off no collection."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def collections_during() -> Iterator[list[int]]:
    """After a full collection, the generations of the collections that start inside the
    block (appended to the yielded list as they happen)."""
    generations: list[int] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            generations.append(info["generation"])

    gc.collect()
    gc.callbacks.append(note)
    try:
        yield generations
    finally:
        gc.callbacks.remove(note)
