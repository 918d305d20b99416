"""The ledger through faults, with real processes: the gateway (a subprocess) over the fake
engine, its ledger on a real PostgreSQL server that is stopped and started again, the
gateway SIGKILLed and restarted while the database is down, client values no database
row may hold. Every request the gateway answered has exactly one row, with what the
engine streamed; a full journal refuses new requests with 503 until the database is back."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._postgres import PostgresServer
from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_B, GatewayProcess, base_config

_names = itertools.count()


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.remove()


def _gateway(tmp_path: Path, engine: EngineServer, url: str, **keys: Any) -> GatewayProcess:
    config = base_config(engine.url, tmp_path / "unused.db")
    config.update(ledger=url, ledger_journal=str(tmp_path / "journal"), **keys)
    return GatewayProcess(tmp_path, config).start()


def _chat(gw: GatewayProcess, model: str = "fake", max_tokens: int = 5) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {KEY_B}"},
                      json={"model": model, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": "Hi"}]})


def test_an_outage_and_a_sigkill_lose_no_row_and_bad_values_stop_nothing(
        tmp_path: Path, engine: EngineServer, postgres: PostgresServer) -> None:
    url = postgres.database(f"faults_{os.getpid()}_{next(_names)}")
    gw = _gateway(tmp_path, engine, url)
    answered: list[str] = []
    try:
        for _ in range(5):
            answered.append(_chat(gw).headers["x-request-id"])
        postgres.stop()  # the outage
        for i in range(20):
            resp = _chat(gw, max_tokens=1 + i % 7)
            assert resp.status_code == 200, resp.text
            answered.append(resp.headers["x-request-id"])
        # Values no Postgres text column takes, and one that would make an 4 MiB row.
        refused = [_chat(gw, model="\u0000"), _chat(gw, model="m" * (4 << 20))]
        # The NUL name is looked up and not found; the long one is refused before its
        # lookup (max_model_name_chars). Both still get their row.
        assert [r.status_code for r in refused] == [404, 400]
        assert gw.server is not None
        os.kill(gw.server.proc.pid, signal.SIGKILL)  # killed with everything unwritten
        gw.server.proc.wait(10)
        gw.stop()
        gw.start()  # it starts while the database is still down
        for _ in range(5):
            resp = _chat(gw)
            assert resp.status_code == 200, resp.text
            answered.append(resp.headers["x-request-id"])
        postgres.start()
        rows = gw.rows(len(answered) + len(refused), timeout_s=30)
    finally:
        gw.stop()
    ids = [r.request_id for r in rows]
    assert len(ids) == len(set(ids)), "a request id twice"
    served = {r.request_id: r for r in rows if r.served}
    assert sorted(served) == sorted(answered)
    streamed = {seen.headers.get("x-request-id"): seen.streamed
                for seen in engine.engine.requests}
    assert all(served[i].completion_tokens == streamed[i] for i in answered)
    unserved = [r for r in rows if not r.served]
    assert len(unserved) == 2 and all(r.model == "" for r in unserved), unserved
    assert sum(r.finish_reason == "rejected:model_not_found" for r in unserved) == 1
    assert max(len(r.request_id) + len(r.model) for r in rows) < 1024
    assert not list((tmp_path / "journal").glob("dead-letter.jsonl"))


def test_a_full_journal_refuses_new_requests_until_the_database_is_back(
        tmp_path: Path, engine: EngineServer, postgres: PostgresServer) -> None:
    url = postgres.database(f"faults_{os.getpid()}_{next(_names)}")
    gw = _gateway(tmp_path, engine, url, ledger_journal_max_bytes=64 * 1024,
                  on_ledger_full="refuse")
    answered: list[str] = []
    try:
        postgres.stop()
        statuses = []
        for _ in range(200):
            resp = _chat(gw)
            statuses.append(resp.status_code)
            if resp.status_code == 200:
                answered.append(resp.headers["x-request-id"])
            else:
                assert resp.status_code == 503, resp.text
                assert resp.json()["error"]["code"] == "ledger_full"
                assert resp.headers["retry-after"]
        assert answered and statuses.count(503) > 0
        assert statuses.index(503) == len(answered)  # served until the bound, then refused
        postgres.start()
        deadline = time.monotonic() + 30
        while (resp := _chat(gw)).status_code != 200:
            assert time.monotonic() < deadline, resp.text
            time.sleep(0.2)
        answered.append(resp.headers["x-request-id"])
        # The refusals have rows too: wait for the served ones, not for a count of rows.
        deadline = time.monotonic() + 30
        while True:
            rows = gw.rows(0, timeout_s=0)
            if (sorted(r.request_id for r in rows if r.served) == sorted(answered)
                    or time.monotonic() > deadline):
                break
            time.sleep(0.2)
    finally:
        gw.stop()
    assert sorted(r.request_id for r in rows if r.served) == sorted(answered)
