"""The Batch API over real HTTP with the openai SDK: a real gateway process (SQLite ledger
and batch store) in front of the in-process fake engine, whose gate holds the requests it
received for as long as a test needs, whatever the machine's load.

What only the whole gateway can show: files and batches as the SDK reads them, each
tenant seeing only its own, refusals with OpenAI's error bodies, lines charged in the
batch lane at the batch cost with a ledger row each, lines dispatched only into the slots
live traffic leaves free, cancel and expiry with partial output, and a gateway killed
with SIGKILL mid-batch that resumes it with every ``custom_id`` in the output once.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_A, KEY_B, GatewayProcess, base_config

FINISHED = ("completed", "failed", "expired", "cancelled")


def batch_config(engine: EngineServer, home: Path, **batch: Any) -> dict[str, Any]:
    config = base_config(engine.url, home / "usage.db")
    config["engines"][0]["max_inflight"] = 4
    config["batch"] = {"headroom": 1, **batch}
    return config


def client(gw: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=30)


def jsonl(n: int, model: str = "fake", start: int = 0, **body: Any) -> bytes:
    return "".join(json.dumps({
        "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": f"line {i}"}],
                 "max_tokens": 3, **body}}) + "\n" for i in range(start, start + n)).encode()


def submit(api: openai.OpenAI, content: bytes, **extra: Any) -> Any:
    upload = api.files.create(file=("input.jsonl", content), purpose="batch")
    return api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                              completion_window="24h", **extra)


def wait_status(api: openai.OpenAI, batch_id: str, statuses: tuple[str, ...] = FINISHED,
                timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = api.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status} after {timeout_s} s"
        time.sleep(0.05)


def wait_for(predicate: Any, timeout_s: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def lines_of(api: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in api.files.content(file_id).text.splitlines()]


def seen_lines(engine: Any) -> Counter[str]:
    """How many times the engine received each line (by its prompt "line i")."""
    return Counter(r.body["messages"][0]["content"] for r in list(engine.requests)
                   if "messages" in r.body)


@pytest.fixture
def held_engine() -> Any:
    """The fake engine with its gate closed: requests reach it and wait there."""
    server = EngineServer()
    server.engine.gate = threading.Event()
    server.start()
    yield server
    server.engine.gate.set()
    server.stop()


def test_a_batch_runs_through_the_sdk_as_its_tenants_requests(
        engine: EngineServer, tmp_path: Path) -> None:
    """Output and error files hold each custom_id once, a line the gateway refuses (an
    unknown model) goes to the error file with the gateway's answer, the batch's usage is
    its lines', and each line has a ledger row in the batch lane at the batch cost."""
    config = batch_config(engine, tmp_path, cost=0.5)
    gw = GatewayProcess(tmp_path, config).start()
    try:
        api = client(gw, KEY_B)
        content = jsonl(12) + jsonl(1, model="no-such-model", start=12) \
            + jsonl(1, start=13, stream=True, stream_options={"include_usage": True})
        batch = submit(api, content, metadata={"job": "nightly"})
        assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
        done = wait_status(api, batch.id)
        assert done.status == "completed"
        assert done.request_counts.total == 14
        assert (done.request_counts.completed, done.request_counts.failed) == (13, 1)
        for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
            assert getattr(done, stamp) is not None
        output, errors = lines_of(api, done.output_file_id), lines_of(api, done.error_file_id)
        assert sorted(x["custom_id"] for x in output) == sorted(
            f"req-{i}" for i in range(14) if i != 12)
        assert [x["custom_id"] for x in errors] == ["req-12"]
        assert errors[0]["response"]["status_code"] == 404
        assert errors[0]["error"]["code"] == "model_not_found"
        for x in output:
            assert x["response"]["status_code"] == 200 and x["error"] is None
            assert x["response"]["body"]["object"] == "chat.completion"  # never streamed
            assert x["id"].startswith("batch_req_")
        assert done.usage.output_tokens == sum(
            x["response"]["body"]["usage"]["completion_tokens"] for x in output)
        assert done.usage.input_tokens == sum(
            x["response"]["body"]["usage"]["prompt_tokens"] for x in output)
        rows = [r for r in gw.rows(14) if r.batch_id == batch.id]
        assert len(rows) == 14
        assert {r.lane for r in rows} == {"batch"} and {r.tenant for r in rows} == {"team-b"}
        by_id = {r.request_id: r for r in rows}
        for x in output:
            row = by_id[x["response"]["request_id"]]
            # cost: prompt 1.0, completion 2.0, times batch.cost 0.5
            assert row.cost == pytest.approx(0.5 * (row.prompt_tokens
                                                    + 2 * row.completion_tokens))
        assert by_id[errors[0]["response"]["request_id"]].finish_reason \
            == "rejected:model_not_found"
        # The files: the input, and the two the batch wrote (purpose batch_output).
        files = {f.id: f for f in api.files.list()}
        assert files[done.output_file_id].purpose == "batch_output"
        assert files[batch.input_file_id].purpose == "batch"
    finally:
        gw.stop()


def test_a_tenant_sees_only_its_own_files_and_batches(engine: EngineServer,
                                                      tmp_path: Path) -> None:
    gw = GatewayProcess(tmp_path, batch_config(engine, tmp_path)).start()
    try:
        owner, other = client(gw, KEY_B), client(gw, KEY_A)
        batch = submit(owner, jsonl(2))
        wait_status(owner, batch.id)
        for call in (lambda: other.files.retrieve(batch.input_file_id),
                     lambda: other.files.content(batch.input_file_id),
                     lambda: other.files.delete(batch.input_file_id),
                     lambda: other.batches.retrieve(batch.id),
                     lambda: other.batches.cancel(batch.id),
                     lambda: other.batches.create(input_file_id=batch.input_file_id,
                                                  endpoint="/v1/chat/completions",
                                                  completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                call()
        assert list(other.files.list()) == [] and list(other.batches.list()) == []
        assert [b.id for b in owner.batches.list()] == [batch.id]
        assert owner.files.retrieve(batch.input_file_id).id == batch.input_file_id
        unauthenticated = httpx.get(f"{gw.url}/v1/batches")
        assert unauthenticated.status_code == 401
        assert unauthenticated.json()["error"]["code"] == "invalid_api_key"
    finally:
        gw.stop()


def test_bad_input_is_refused_with_openai_errors(engine: EngineServer, tmp_path: Path) -> None:
    """Refused at once (400/404/413/429 with OpenAI's body), or failed in validating with
    the ``errors`` list naming each bad line; nothing else is lost."""
    config = batch_config(engine, tmp_path, max_file_bytes=4096, max_lines=5, max_batches=1)
    gw = GatewayProcess(tmp_path, config).start()
    try:
        api = client(gw, KEY_B)
        with pytest.raises(openai.BadRequestError) as info:
            api.files.create(file=("x.jsonl", jsonl(1)), purpose="fine-tune")
        assert info.value.code == "invalid_value" and "purpose" in info.value.message
        too_big = api.files.with_raw_response  # the SDK raises on 413 as APIStatusError
        with pytest.raises(openai.APIStatusError) as big:
            too_big.create(file=("x.jsonl", b"x" * 5000), purpose="batch")
        assert big.value.status_code == 413 and big.value.code == "file_too_large"
        with pytest.raises(openai.BadRequestError) as many:
            api.files.create(file=("x.jsonl", jsonl(6)), purpose="batch")
        assert many.value.code == "too_many_requests"
        no_file = httpx.post(f"{gw.url}/v1/files", data={"purpose": "batch"},
                             headers={"authorization": f"Bearer {KEY_B}"})
        assert no_file.status_code == 400
        assert no_file.json()["error"]["param"] == "file"
        upload = api.files.create(file=("ok.jsonl", jsonl(2)), purpose="batch")
        for kwargs, param in (({"endpoint": "/v1/moderations"}, "endpoint"),
                              ({"completion_window": "1h"}, "completion_window"),
                              ({"metadata": {"k": "v" * 600}}, "metadata")):
            args = {"input_file_id": upload.id, "endpoint": "/v1/chat/completions",
                    "completion_window": "24h", **kwargs}
            with pytest.raises(openai.BadRequestError) as bad:
                api.batches.create(**args)
            assert bad.value.param == param
        with pytest.raises(openai.NotFoundError):
            api.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                               completion_window="24h")
        # A malformed file fails in validating, every bad line named.
        bad_lines = (jsonl(1) + b"{not json\n" + jsonl(1)  # duplicate custom_id req-0
                     + json.dumps({"custom_id": "u", "method": "POST",
                                   "url": "/v1/completions", "body": {"model": "fake"}}).encode())
        failed = submit(api, bad_lines)
        failed = wait_status(api, failed.id)
        assert failed.status == "failed" and failed.failed_at is not None
        assert [(e.code, e.line) for e in failed.errors.data] == [
            ("invalid_json_line", 2), ("duplicate_custom_id", 3), ("invalid_url", 4)]
        assert engine.engine.requests == []  # no line of it ran
        # max_batches (1): a second unfinished batch waits its turn.
        engine.engine.gate = threading.Event()
        try:
            running = submit(api, jsonl(3))
            with pytest.raises(openai.RateLimitError) as limit:
                submit(api, jsonl(1))
            assert limit.value.code == "too_many_batches"
            with pytest.raises(openai.BadRequestError) as in_use:
                api.files.delete(running.input_file_id)
            assert in_use.value.code == "file_in_use"
        finally:
            engine.engine.gate.set()
        done = wait_status(api, running.id)
        assert done.status == "completed"
        with pytest.raises(openai.BadRequestError) as late:
            api.batches.cancel(done.id)
        assert late.value.code == "invalid_state"
        assert api.files.delete(running.input_file_id).deleted is True
        with pytest.raises(openai.NotFoundError):
            api.files.retrieve(running.input_file_id)
    finally:
        gw.stop()


def test_lines_take_only_the_slots_live_traffic_leaves_free(held_engine: EngineServer,
                                                           tmp_path: Path) -> None:
    """max_inflight 4, headroom 1: the batch holds 3 slots at most, a live request goes
    to the engine at once beside them; while live requests wait, no line starts."""
    gw = GatewayProcess(tmp_path, batch_config(held_engine, tmp_path)).start()
    fake = held_engine.engine
    try:
        api = client(gw, KEY_B)
        batch = submit(api, jsonl(8))
        wait_for(lambda: fake.active == 3, what="three lines at the engine")
        time.sleep(0.3)  # several pump rounds: still three
        assert fake.active == 3
        live = threading.Thread(target=lambda: client(gw, KEY_A).chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "live"}], max_tokens=2))
        live.start()
        wait_for(lambda: fake.active == 4, what="the live request beside the lines")
        # Slots full: a second live request waits in the gateway's queue, and while it
        # waits no batch line may take a slot that frees.
        live2 = threading.Thread(target=lambda: client(gw, KEY_A).chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "live two"}], max_tokens=2))
        live2.start()
        wait_for(lambda: gw.metric("tokenpace_gateway_queued_requests", tenant="team-a") == 1,
                 what="the second live request queued")
        fake.gate.set()
        live.join(10)
        live2.join(10)
        done = wait_status(api, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 8
        order = [r.body["messages"][0]["content"] for r in fake.requests]
        # The queued live request went before every line that had not started.
        assert order.index("live two") < 5, order
    finally:
        fake.gate.set()
        gw.stop()


def test_cancel_keeps_what_ran_and_expiry_writes_the_rest_as_expired(
        held_engine: EngineServer, tmp_path: Path) -> None:
    fake = held_engine.engine
    config = batch_config(held_engine, tmp_path, expire_after="3s")
    gw = GatewayProcess(tmp_path, config).start()
    try:
        api = client(gw, KEY_B)
        batch = submit(api, jsonl(6))
        wait_for(lambda: fake.active == 3, what="three lines at the engine")
        cancelling = api.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        time.sleep(0.2)
        fake.gate.set()
        cancelled = wait_status(api, batch.id)
        assert cancelled.status == "cancelled"
        assert len(lines_of(api, cancelled.output_file_id)) == 3  # those in flight
        assert cancelled.error_file_id is None  # lines that never ran are not written
        assert cancelled.request_counts.completed == 3
        # Expiry: 3 s after creation the batch stops starting lines.
        fake.gate.clear()
        expiring = submit(api, jsonl(5, start=10))
        wait_for(lambda: fake.active == 3, what="three lines at the engine")
        time.sleep(3.5)
        fake.gate.set()
        expired = wait_status(api, expiring.id)
        assert expired.status == "expired" and expired.expired_at is not None
        out, err = lines_of(api, expired.output_file_id), lines_of(api, expired.error_file_id)
        assert len(out) == 3, (out, err, expired)
        assert sorted(x["custom_id"] for x in out + err) == [f"req-{i}" for i in range(10, 15)]
        assert {x["error"]["code"] for x in err} == {"batch_expired"}
        assert all(x["response"] is None for x in err)
        lines = {outcome: gw.metric("tokenpace_gateway_batch_lines_total", tenant="team-b",
                                    outcome=outcome) for outcome in ("output", "expired")}
        assert lines == {"output": 6.0, "expired": 2.0}
    finally:
        fake.gate.set()
        gw.stop()


def test_a_gateway_killed_mid_batch_resumes_it(held_engine: EngineServer,
                                               tmp_path: Path) -> None:
    """SIGKILL with lines at the engine and some already written: after the restart the
    written lines are not sent again, the others are, and the output holds every
    custom_id exactly once."""
    fake = held_engine.engine
    gw = GatewayProcess(tmp_path, batch_config(held_engine, tmp_path)).start()
    store = tmp_path / "usage.batches.db"
    api = client(gw, KEY_B)
    batch = submit(api, jsonl(10))

    def written() -> set[int]:
        import sqlite3
        with sqlite3.connect(store) as conn:
            return {n for (n,) in conn.execute(
                "SELECT line FROM batch_results WHERE batch_id = ?", (batch.id,))}

    fake.gate.set()
    wait_for(lambda: len(written()) >= 2, what="two lines written")
    fake.gate.clear()
    wait_for(lambda: fake.active >= 1, what="lines held at the engine")
    before = written()
    assert gw.server is not None
    os.kill(gw.server.proc.pid, signal.SIGKILL)
    gw.server.proc.wait(10)
    gw.stop()
    at_kill = written()
    sent_at_kill = sum(seen_lines(fake).values())  # written, and in flight at the kill
    assert before <= at_kill and len(at_kill) < 10
    fake.gate.set()
    gw.start()
    try:
        done = wait_status(api, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 10
        output = lines_of(api, done.output_file_id)
        assert sorted(x["custom_id"] for x in output) == sorted(f"req-{i}" for i in range(10))
        seen = seen_lines(held_engine.engine)
        for line in at_kill:  # file line numbers are 1-based
            assert seen[f"line {line - 1}"] == 1, (line, seen)
        # Only the lines in flight at the kill ran twice (how many were depends on the
        # machine's pace between the gate closing and the kill): each unwritten line once.
        assert sum(seen.values()) <= sent_at_kill + 10 - len(at_kill), (seen, sent_at_kill)
    finally:
        gw.stop()


@pytest.mark.redis
def test_two_replicas_on_redis_run_a_batch_once_and_take_it_over(
        held_engine: EngineServer, tmp_path: Path) -> None:
    """Replicas sharing Redis (state) and one batch store: the replica holding a batch's
    lease runs it alone; killed with SIGKILL, the other takes the batch over once the
    lease expires (state.lease 2 s) and finishes it, each custom_id once in the output."""
    from tests._redis import RedisServer, require_redis_client

    require_redis_client()
    redis = RedisServer(tmp_path / "redis").start()
    fake = held_engine.engine
    replicas: list[GatewayProcess] = []
    try:
        for name in ("a", "b"):
            home = tmp_path / name
            home.mkdir()
            config = batch_config(held_engine, home,
                                  store=f"sqlite:///{tmp_path / 'shared.batches.db'}")
            config["state"] = {"url": redis.url, "timeout": "0.5s", "lease": "2s"}
            replicas.append(GatewayProcess(home, config))
        first, second = replicas
        first.start()
        api_first = client(first, KEY_B)
        batch = submit(api_first, jsonl(10))
        wait_for(lambda: fake.active == 3, what="three lines at the engine")
        second.start()
        api_second = client(second, KEY_B)
        assert api_second.batches.retrieve(batch.id).status == "in_progress"
        time.sleep(2.5)  # two scans of the second replica: it does not run the batch
        assert len(fake.requests) == 3 and fake.active == 3
        assert first.server is not None
        os.kill(first.server.proc.pid, signal.SIGKILL)
        first.server.proc.wait(10)
        first.stop()
        fake.gate.set()
        done = wait_status(api_second, batch.id, timeout_s=30)
        assert done.status == "completed" and done.request_counts.completed == 10
        output = lines_of(api_second, done.output_file_id)
        assert sorted(x["custom_id"] for x in output) == sorted(f"req-{i}" for i in range(10))
        assert sum(seen_lines(fake).values()) <= 10 + 3
    finally:
        fake.gate.set()
        for gw in replicas:
            gw.stop()
        redis.stop()
