"""Measured values behind timing-derived assertions, for failure messages and repeat runs.

Every timing assertion of the end-to-end tests goes through :func:`expect`: its failure
message names the server log and the measured series, so a reader can tell a defect from
noise, and with ``TOKENPACE_TIMING_LOG=PATH`` each value is appended to ``PATH`` as a JSON
line (``tools/timing_distribution.py`` runs the tests repeatedly and summarises them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 5)
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def expect(test: str, name: str, value: float, bound: float, *, upper: bool = True,
           logs: Iterable[Path] = (), **series: Any) -> None:
    """Assert ``value <= bound`` (``upper``) or ``value >= bound``, recording it either way."""
    entry = {"test": test, "name": name, "value": value, "bound": bound, "upper": upper,
             "load1": os.getloadavg()[0], **series}
    path = os.environ.get("TOKENPACE_TIMING_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(_rounded(entry)) + "\n")
    if (value <= bound) if upper else (value >= bound):
        return
    side = "<=" if upper else ">="
    where = ", ".join(str(p) for p in logs) or "(none)"
    raise AssertionError(
        f"{test}: {name} = {value:.4g}, expected {side} {bound:.4g}; "
        f"server log(s): {where}; measured: {json.dumps(_rounded(series))}"
    )
