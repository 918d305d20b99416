"""Real servers for end-to-end tests: re-exports tokenpace._process (also used by `up`, bench)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenpace._process import (
    KV_CACHE_BYTES,
    Server,
    free_port,
    group_members,
    start_all,
    tokenpace_serve_argv,
    tree_cpu_seconds,
    vllm_server_argv,
)

__all__ = [
    "KV_CACHE_BYTES",
    "Server",
    "free_port",
    "group_members",
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
