"""Warnings an engine logs once per process.

Each names a misconfiguration that every later request would repeat (a rate sent to an
engine that does not trust it, a request that bypassed the identity middleware, a request
on a data-parallel rank its user is not pinned to): the log says it once, with what to do,
and stays readable.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.tokenpace.engine")

_said: set[str] = set()


def warn_once(key: str, message: str, *args: object) -> None:
    """Log ``message % args`` as a warning unless the warning ``key`` was logged already
    in this process. Cost once said: one set lookup."""
    if key in _said:
        return
    _said.add(key)
    logger.warning(message, *args)
