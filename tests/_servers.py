"""Real vLLM servers for end-to-end tests (the same helpers the benchmarks use)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenpace.bench._server import (
    Server,
    free_port,
    start_all,
    tokenpace_serve_argv,
    tree_cpu_seconds,
    vllm_server_argv,
)

__all__ = [
    "Server",
    "free_port",
    "paced_vllm_server_argv",
    "start_all",
    "tokenpace_serve_argv",
    "tree_cpu_seconds",
    "vllm_server_argv",
]


def paced_vllm_server_argv(model: Path, port: int, pacing: dict, *extra: str) -> list[str]:
    """Plain vLLM with a ``tokenpace`` section: the plugin entry point selects the scheduler."""
    return vllm_server_argv(
        model, port, "--additional-config", json.dumps({"tokenpace": pacing}), *extra,
    )
