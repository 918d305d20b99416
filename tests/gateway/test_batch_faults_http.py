"""Batches that cannot progress, a batch store that fails, a clean shutdown mid-batch:
real gateway processes in front of the in-process fake engine (which records every
request it received), a real SQLite or Postgres batch store.

What each test holds the gateway to: a batch ends (``failed`` with OpenAI's ``errors``
when it cannot run) instead of being picked up again forever; the engine receives each
line at most once whatever the store does (a result that could not be written is kept
and written again, the line is not re-run and re-charged); the Postgres store comes back
after an outage; SIGTERM mid-batch lets the lines in flight finish and store their
results, so after the restart no line runs twice and no ledger row is a cut line's.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests._postgres import PostgresServer
from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_B, GatewayProcess
from tests.gateway.test_batch_http import (
    batch_config,
    client,
    held_engine,  # noqa: F401  (a fixture)
    jsonl,
    lines_of,
    seen_lines,
    submit,
    wait_for,
    wait_status,
)

_names = itertools.count()


@pytest.fixture
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.remove()


def line(custom_id: str, model: str = "fake") -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST",
                       "url": "/v1/chat/completions",
                       "body": {"model": model, "max_tokens": 3,
                                "messages": [{"role": "user", "content": custom_id}]}}
                      ).encode() + b"\n"


def test_text_no_store_keeps_fails_the_batch_at_validation(engine: EngineServer,
                                                           tmp_path: Path) -> None:
    """A lone surrogate in a custom_id (SQLite cannot encode it), a NUL in a model and in
    a custom_id (Postgres cannot keep it): the batch ends failed at validation, each bad
    line named, and no line of it reaches the engine."""
    gw = GatewayProcess(tmp_path, batch_config(engine, tmp_path)).start()
    try:
        api = client(gw, KEY_B)
        content = (jsonl(2) + line("bad-\ud800") + line("bad-model", model="m\u0000")
                   + line("nul-\u0000-id"))
        batch = wait_status(api, submit(api, content).id, timeout_s=15)
        assert batch.status == "failed", batch
        assert [(e.code, e.param, e.line) for e in batch.errors.data] == [
            ("invalid_value", "custom_id", 3), ("invalid_value", "body.model", 4),
            ("invalid_value", "custom_id", 5)]
        time.sleep(1.5)  # a scan or more: the batch is not picked up again
        assert api.batches.retrieve(batch.id).status == "failed"
        assert engine.engine.requests == []
    finally:
        gw.stop()


def test_an_output_over_the_bound_fails_the_batch_once(engine: EngineServer,
                                                      tmp_path: Path) -> None:
    """``batch.max_output_bytes``: a batch whose output file would pass it ends failed
    with ``output_too_large``, once, each line sent to the engine once."""
    gw = GatewayProcess(tmp_path, batch_config(engine, tmp_path,
                                               max_output_bytes=2048)).start()
    try:
        api = client(gw, KEY_B)
        batch = wait_status(api, submit(api, jsonl(8)).id)  # ~500 bytes per output line
        assert batch.status == "failed", batch
        assert [e.code for e in batch.errors.data] == ["output_too_large"]
        assert "batch.max_output_bytes" in batch.errors.data[0].message
        assert batch.output_file_id is None
        time.sleep(1.5)
        assert api.batches.retrieve(batch.id).status == "failed"
        assert sorted(seen_lines(engine.engine).values()) == [1] * 8
    finally:
        gw.stop()


def test_a_postgres_store_outage_mid_batch_reruns_nothing_and_the_batch_completes(
        held_engine: EngineServer, tmp_path: Path, postgres: PostgresServer) -> None:
    """Lines at the engine when the store's database stops: their results cannot be
    written; they are kept and written once it is back, the store reconnects, and the
    batch completes with every line sent to the engine exactly once."""
    fake = held_engine.engine
    url = postgres.database(f"batch_faults_{os.getpid()}_{next(_names)}")
    gw = GatewayProcess(tmp_path, batch_config(held_engine, tmp_path, store=url)).start()
    try:
        api = client(gw, KEY_B)
        batch = submit(api, jsonl(12))
        wait_for(lambda: fake.active == 3, what="three lines at the engine")
        postgres.stop()
        fake.gate.set()  # the three lines end while their results cannot be written
        wait_for(lambda: fake.active == 0, what="the three lines answered")
        time.sleep(0.5)
        # A line may start as one ends, before that one's write has failed (3 more at
        # most); once a write failed, no line starts until it is written.
        sent = seen_lines(fake)
        time.sleep(1.5)  # writes are tried again and fail
        assert seen_lines(fake) == sent and set(sent.values()) == {1}, sent
        assert 3 <= sum(sent.values()) <= 6
        postgres.start()
        done = wait_status(api, batch.id, timeout_s=40)
        assert done.status == "completed" and done.request_counts.completed == 12
        output = lines_of(api, done.output_file_id)
        assert sorted(x["custom_id"] for x in output) == sorted(f"req-{i}" for i in range(12))
        assert sorted(seen_lines(fake).values()) == [1] * 12, seen_lines(fake)
    finally:
        fake.gate.set()
        gw.stop()


def _closed(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_sigterm_mid_batch_lets_lines_in_flight_finish_and_none_runs_twice(
        held_engine: EngineServer, tmp_path: Path) -> None:
    """SIGTERM with three lines held at the engine, released once the gateway has begun
    its shutdown (its port closed): within ``batch.shutdown_wait`` (10 s by default) they
    finish and their results are stored; after the restart the batch completes, every
    line sent once, one ledger row each, none a cut line's (``cancelled``)."""
    fake = held_engine.engine
    gw = GatewayProcess(tmp_path, batch_config(held_engine, tmp_path)).start()
    api = client(gw, KEY_B)
    batch = submit(api, jsonl(6))
    wait_for(lambda: fake.active == 3, what="three lines at the engine")
    assert gw.server is not None
    proc = gw.server.proc
    os.kill(proc.pid, signal.SIGTERM)
    wait_for(lambda: _closed(gw.port), what="the gateway's port closed")
    time.sleep(0.5)  # its shutdown is under way
    fake.gate.set()
    proc.wait(30)
    gw.stop()
    assert sum(seen_lines(fake).values()) == 3
    gw.start()
    try:
        api = client(gw, KEY_B)
        done = wait_status(api, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 6
        assert sorted(seen_lines(fake).values()) == [1] * 6, seen_lines(fake)
        rows = [r for r in gw.rows(6) if r.batch_id == batch.id]
        assert len(rows) == 6, [(r.request_id, r.finish_reason) for r in rows]
        assert {r.finish_reason for r in rows} == {"length"}
        assert all(r.completion_tokens == 3 for r in rows)
    finally:
        gw.stop()
    httpx.Client().close()
