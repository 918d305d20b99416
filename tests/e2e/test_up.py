"""``tokenpace up`` on the tiny model: two engines serving two model names, each request
routed by its model (404 for another), the engines locked with generated keys, and an
engine whose API server is killed does not leave its engine core running."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests._engine_pool import ModuleEngines
from tests._servers import Server, free_port
from tests._servers import KV_CACHE_BYTES, group_members

pytestmark = [pytest.mark.vllm, pytest.mark.no_timing]


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    """``tokenpace up``: its gateway, which starts the two engines of ``home/gateway.yaml``."""
    engine_port, code_port, port = free_port(), free_port(), free_port()
    config = home / "gateway.yaml"
    config.write_text(yaml.safe_dump({
        "engines": [f"http://127.0.0.1:{engine_port}",  # learns "tiny" from /v1/models
                    {"url": f"http://127.0.0.1:{code_port}", "models": ["tiny-code"]}],
        "models": [{"name": "tiny-code", "cost": {"prompt": 1, "completion": 3}}],
        "ledger": f"sqlite:///{home / 'usage.db'}",
        "tenants": [{"id": "team-a", "api_keys": ["sk-a"]},
                    {"id": "team-b", "api_keys": ["sk-b"], "models": ["tiny-code"]}],
    }))
    return [Server([sys.executable, "-m", "tokenpace.cli", "up", str(tiny_model), "--config",
                    str(config), "--port", str(port), "--served-model-name", "tiny", "--",
                    "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager"],
                   port, home / "up.log")]


def test_up_serves_two_models_locks_its_engines_and_reaps_a_dead_engines_processes(
        module_engines: ModuleEngines) -> None:
    [up] = module_engines.servers
    config = yaml.safe_load((module_engines.home / "gateway.yaml").read_text())
    engine = config["engines"][0]
    engine_port = int(engine.rsplit(":", 1)[1])
    # Nobody but the gateway holds the key: direct calls are refused, the gateway's pass.
    assert httpx.post(f"{engine}/tokenize", json={"model": "tiny", "prompt": "hi"},
                      timeout=30).status_code == 401
    assert httpx.get(f"{engine}/metrics", timeout=30).status_code == 401

    def complete(key: str, model: str) -> httpx.Response:
        return httpx.post(f"{up.base_url}/v1/completions", timeout=120,
                          headers={"authorization": f"Bearer {key}"},
                          json={"model": model, "prompt": "hi", "max_tokens": 3})

    for key, model in (("sk-a", "tiny"), ("sk-a", "tiny-code"), ("sk-b", "tiny-code")):
        resp = complete(key, model)
        assert resp.status_code == 200, (key, model, resp.text)
        assert resp.json()["model"] == model  # the engine serving that name answered
    for key, model in (("sk-b", "tiny"), ("sk-a", "gpt-4o")):
        resp = complete(key, model)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    listed = httpx.get(f"{up.base_url}/v1/models", headers={"authorization": "Bearer sk-a"})
    assert sorted(m["id"] for m in listed.json()["data"]) == ["tiny", "tiny-code"]
    # The key is not on any command line (ps shows those to every local user).
    api_server = next(p for p in psutil.Process(up.proc.pid).children()
                      if f"{engine_port}" in " ".join(p.cmdline()))
    assert not any("api-key" in arg for arg in api_server.cmdline())

    group = os.getpgid(api_server.pid)
    assert len(group_members(group)) >= 2, "the API server and its engine core"
    os.kill(api_server.pid, signal.SIGKILL)  # the API server alone dies
    deadline = time.monotonic() + 40
    while group_members(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_members(group) == [], "engine-core processes outlived their API server"
    assert up.proc.poll() is None, "the gateway keeps running (it reports the engine down)"
    assert "stopping its remaining processes" in up.log_tail(200)
    assert complete("sk-a", "tiny-code").status_code == 200  # the other model still serves
