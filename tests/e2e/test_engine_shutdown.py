"""A real engine shut down under load: `tokenpace serve` with
`--shutdown-timeout` gets SIGTERM (what a Kubernetes rollout or scale-down sends its
container's first process) while a paced stream runs on it, in a pool beside another engine.

What only a real vLLM shows: how it answers while it drains (its /health 200, new
completions refused with a 500 the gateway must read as "not taken"), that its stream in
flight finishes, and that it then goes away. What the gateway must do: send every request
that engine refused to the other engine (clients see only 200s), show the engine as
draining and not failed, let the stream finish with all its tokens and charge exactly
those, and take the engine out as down once it is gone.

The other engine of the pool is a fake one over real HTTP serving the same model name: its
part (taking the requests) needs no model, and a second real engine would double this
module's start-up.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._engine_pool import ModuleEngines
from tests._servers import Server, free_port, tokenpace_serve_argv
from tests.gateway._engine import EngineServer, FakeEngine
from tests.gateway.conftest import GatewayProcess

pytestmark = pytest.mark.vllm

KEY_PACED, KEY_BURST, ADMIN = "sk-paced", "sk-burst", "sk-admin"
PACED_TOKENS = 60  # at 20 tok/s: about 3 s on the engine


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    port = free_port()
    return [Server(tokenpace_serve_argv(tiny_model, port, "--trusted-gateway",
                                        "--allow-unauthenticated-trusted-gateway",
                                        "--shutdown-timeout", "30"),
                   port, home / "vllm.log")]


@pytest.fixture(scope="module")
def real(module_engines: ModuleEngines) -> Server:
    [srv] = module_engines.servers
    return srv


def health(gw: GatewayProcess) -> dict[str, dict[str, Any]]:
    return {e["url"]: e for e in gw.health()["engines"]}


def admin(gw: GatewayProcess, url: str, drain: bool) -> None:
    resp = httpx.post(f"{gw.url}/admin/engines/drain", json={"engine": url, "drain": drain},
                      headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert resp.status_code == 200, resp.text


def test_an_engine_given_sigterm_drains_and_no_request_fails(
        real: Server, tmp_path: Path) -> None:
    fake = EngineServer(FakeEngine(models=("tiny",), token_delay_s=0.05)).start()
    gw = GatewayProcess(tmp_path, {
        "engines": [{"url": real.base_url, "max_inflight": 2, "models": ["tiny"]},
                    {"url": fake.url, "max_inflight": 2, "models": ["tiny"]}],
        "ledger": f"sqlite:///{tmp_path / 'usage.db'}",
        "admin_api_keys": [ADMIN],
        "tenants": [{"id": "paced", "api_keys": [KEY_PACED], "output_tokens_per_second": 20},
                    {"id": "burst", "api_keys": [KEY_BURST]}],
    }).start()
    try:
        # The paced stream must run on the real engine: the fake one drained while it starts.
        admin(gw, fake.url, True)
        received: list[int] = []
        events: list[dict[str, Any]] = []

        def paced_stream() -> None:
            with httpx.stream("POST", f"{gw.url}/v1/completions", timeout=60,
                              headers={"authorization": f"Bearer {KEY_PACED}"},
                              json={"model": "tiny", "prompt": "Tell me about the sea",
                                    "max_tokens": PACED_TOKENS, "ignore_eos": True,
                                    "stream": True,
                                    "stream_options": {"include_usage": True}}) as resp:
                received.append(resp.status_code)
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))

        stream = threading.Thread(target=paced_stream)
        stream.start()
        deadline = time.monotonic() + 30
        # Running on the real engine: its slot there, and its first event arrived (the
        # slot alone is taken before the request reaches the engine).
        while health(gw)[real.base_url]["inflight"] != 1 or not events:
            assert time.monotonic() < deadline, health(gw)
            time.sleep(0.05)
        admin(gw, fake.url, False)
        os.kill(real.proc.pid, signal.SIGTERM)  # the API server's process, as Kubernetes does
        deadline = time.monotonic() + 30
        while "stopping engine client mode=drain" not in real.log_tail(400):  # draining
            assert time.monotonic() < deadline, real.log_tail()
            time.sleep(0.05)
        time.sleep(0.2)  # its executors close as the drain begins

        # A burst from another tenant: more than the fake engine's 2 slots at once, so some
        # are sent to the real one, which refuses them; they go to the fake one.
        statuses: list[int] = []
        lock = threading.Lock()

        def client(i: int) -> None:
            for j in range(3):
                resp = httpx.post(f"{gw.url}/v1/completions", timeout=60,
                                  headers={"authorization": f"Bearer {KEY_BURST}"},
                                  json={"model": "tiny", "prompt": f"burst {i} {j}",
                                        "max_tokens": 8})
                with lock:
                    statuses.append(resp.status_code)

        clients = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        assert statuses == [200] * 18, statuses
        real_health = health(gw)[real.base_url]
        if stream.is_alive():  # still draining: shown so, not as failed
            assert real_health["draining"] is True and real_health.get("shutting_down")
            assert real_health["healthy"] is True
        assert "is shutting down" in gw.log()
        assert len(fake.engine.requests) == 18

        stream.join(timeout=60)
        assert received == [200]
        assert not any("error" in e for e in events), events[-3:]
        usage = [e["usage"] for e in events if e.get("usage")]
        tokens = usage[-1]["completion_tokens"] if usage else None
        assert tokens == PACED_TOKENS  # finished on the draining engine

        # The drained engine exits; the gateway takes it out as down.
        real.proc.wait(timeout=60)
        deadline = time.monotonic() + 10  # probes at most every 2 s; 8 s of margin
        while health(gw)[real.base_url]["healthy"]:
            assert time.monotonic() < deadline, health(gw)
            time.sleep(0.05)
        rows = gw.rows(1 + 18)
        assert {r.finish_reason for r in rows} == {"length"}
        paced = [r for r in rows if r.tenant == "paced"]
        assert [r.completion_tokens for r in paced] == [PACED_TOKENS]
    finally:
        gw.stop()
        fake.stop()
