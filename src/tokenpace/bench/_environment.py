"""What a benchmark ran on, recorded next to its numbers."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def environment() -> dict[str, Any]:
    """Versions, CPU model and core count."""
    from .. import __version__

    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = None
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"tokenpace": __version__, "vllm": vllm_version,
            "python": platform.python_version(), "cpu": cpu, "cpu_count": os.cpu_count()}


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
