"""An engine's reserved slots through a real gateway process: one tenant that fills an
engine with requests that do not end leaves its last slots to the next tenant, whose
request reaches the engine while every one of the first tenant's is still running."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway._engine import EngineServer, FakeEngine
from tests.gateway.conftest import ADMIN_KEY, KEY_A, KEY_B


def _chat(url: str, key: str, text: str) -> int:
    resp = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      headers={"authorization": f"Bearer {key}"},
                      json={"model": "fake", "max_tokens": 4,
                            "messages": [{"role": "user", "content": text}]})
    return resp.status_code


def _arrived(fake: FakeEngine, text: str) -> int:
    return sum(1 for s in fake.requests if str(s.body.get("messages")).count(text))


def _wait(what: str, ok: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.parametrize(("capacity_from", "reserved", "first_tenant_runs"), [
    ("config", None, 14), ("health", None, 14), ("config", 0, 20)])
def test_a_tenant_that_fills_an_engine_leaves_its_reserve_to_the_next(
        make_gateway: Any, tmp_path: Path, capacity_from: str, reserved: int | None,
        first_tenant_runs: int) -> None:
    """16 slots (the engine entry's ``max_num_seqs``, or what the engine's ``/health``
    reports, as ``tokenpace serve`` does), 4 more may wait in the engine. The engine holds
    every request it gets until the test lets them go (none ends meanwhile). Team A sends
    24: with the default reserve (2 of 16) 14 reach the engine and 10 wait in the gateway;
    team B's request then reaches it at once. With ``reserved_slots: 0`` A takes all 20
    and B's request waits in the gateway until one of A's ends (the parked-slots attack:
    the other tenant waits for A's longest requests, seconds to minutes)."""
    gate = threading.Event()
    fake = FakeEngine(token_delay_s=0.0, gate=gate,
                      max_num_seqs=16 if capacity_from == "health" else None)
    engine = EngineServer(fake).start()
    try:
        entry: dict[str, Any] = {"url": engine.url, "models": ["fake"]}
        if capacity_from == "config":
            entry["max_num_seqs"] = 16
        if reserved is not None:
            entry["reserved_slots"] = reserved
        gw = make_gateway({
            "engines": [entry], "ledger": f"sqlite:///{tmp_path / 'usage.db'}",
            "tenants": [{"id": "team-a", "api_keys": [KEY_A]},
                        {"id": "team-b", "api_keys": [KEY_B]}],
            "admin_api_keys": [ADMIN_KEY],  # /health's details; /metrics stays open
        })
        def described() -> dict[str, Any]:
            health = httpx.get(f"{gw.url}/health",
                               headers={"authorization": f"Bearer {ADMIN_KEY}"})
            [engine_entry] = health.json()["engines"]
            return engine_entry

        # The engine's health check at start-up brings a reported capacity.
        _wait("the gateway knows the engine's capacity", lambda: described()["capacity"] == 16)
        assert described()["reserved_slots"] == (2 if reserved is None else reserved)
        with ThreadPoolExecutor(32) as pool:
            a = [pool.submit(_chat, gw.url, KEY_A, "from-a") for _ in range(24)]
            _wait("team A's requests reached the engine or queued in the gateway",
                  lambda: gw.metric("tokenpace_gateway_queued_requests", tenant="team-a")
                  == 24 - first_tenant_runs)
            assert _arrived(fake, "from-a") == first_tenant_runs
            b = pool.submit(_chat, gw.url, KEY_B, "from-b")
            if reserved is None:
                _wait("team B's request reached the engine while all of A's ran",
                      lambda: _arrived(fake, "from-b") == 1)
                assert _arrived(fake, "from-a") == 14 and not any(s.finished for s in fake.requests)
            else:
                assert gw.wait_metric("tokenpace_gateway_queued_requests", 1,
                                      tenant="team-b") == 1
                assert _arrived(fake, "from-b") == 0
            gate.set()
            assert [f.result() for f in a] == [200] * 24 and b.result() == 200
    finally:
        gate.set()
        engine.stop()
