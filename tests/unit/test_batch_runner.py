"""The batch runner end to end in process: a real store (SQLite in a temporary file) and
a small ``BatchHost`` written here, whose answers each test decides line by line.

What the runner promises, and what each test checks on the files it writes: every line of
a batch ends in the output or the error file exactly once (retries, resumes and cancels
included), a 429 waits out its hold, a 5xx is retried a bounded number of times, a
cancel or an expiry stops starting lines, and no line starts without room or beyond the
runner's concurrency.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import openai.types
import pytest

import tokenpace.gateway.batch._runner as runner_module
from tokenpace.gateway.batch import (
    BatchRecord,
    BatchRunner,
    BatchStore,
    Line,
    LineAnswer,
    LineResult,
    new_id,
    result_line,
)
from tokenpace.gateway.batch._runner import ATTEMPTS

TENANT = "acme"
CHAT = "/v1/chat/completions"
MODEL = "tiny"


@pytest.fixture(autouse=True)
def fast_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scan the store every 50 ms (a cancel is seen within it) and let a 429's hold be as
    short as the test's retry-after."""
    monkeypatch.setattr(runner_module, "SCAN_S", 0.05)
    monkeypatch.setattr(runner_module, "RETRY_MIN_S", 0.05)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BatchStore]:
    opened = BatchStore("sqlite:///" + str(tmp_path / "usage.batches.db"))
    yield opened
    opened.close()


# -- answers -------------------------------------------------------------------------------


def chat_completion(custom_id: str, prompt: int = 10, cached: int = 2,
                    completion: int = 5) -> dict[str, Any]:
    return {"id": f"chatcmpl-{custom_id}", "object": "chat.completion", "created": 1,
            "model": MODEL, "choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": f"answer to {custom_id}"}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


def ok(line: Line) -> LineAnswer:
    return LineAnswer(200, json.dumps(chat_completion(line.custom_id)).encode(),
                      f"tpg-{line.custom_id}")


def failure(line: Line, status: int, code: str, message: str,
            retry_after_s: float | None = None) -> LineAnswer:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": code}}
    return LineAnswer(status, json.dumps(body).encode(), f"tpg-{line.custom_id}-{status}",
                      retry_after_s)


Script = Callable[[Line, int], LineAnswer | None]
"""A line and its attempt (1 for its first run) -> the gateway's answer."""


def all_ok(line: Line, attempt: int) -> LineAnswer:
    return ok(line)


class Host:
    """The gateway side of the runner, as plain code: answers per ``script``, records
    every run (which line, when, how many at once)."""

    def __init__(self, script: Script = all_ok, *, room: int = 100,
                 delay: float | Callable[[Line], float] = 0.0,
                 take_slot: bool = True, claim: bool = True) -> None:
        self.script = script
        self.room_now = room
        self.delay = delay
        self.take_slot = take_slot  # call on_slot at once (else the runner does it at the end)
        self.grant_claim = claim
        self.runs: list[int] = []  # line numbers, in the order they started
        self.starts: dict[int, list[float]] = {}
        self.ends: dict[int, list[float]] = {}
        self.active = 0
        self.most_active = 0
        self.claims: list[object] = []
        self.unclaimed: list[object] = []

    async def run_line(self, batch: BatchRecord, line: Line,
                       on_slot: Callable[[], None]) -> LineAnswer | None:
        assert batch.tenant == TENANT
        attempt = self.runs.count(line.number) + 1
        self.runs.append(line.number)
        self.starts.setdefault(line.number, []).append(time.monotonic())
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            if self.take_slot:
                on_slot()
            await asyncio.sleep(self.delay(line) if callable(self.delay) else self.delay)
            return self.script(line, attempt)
        finally:
            self.active -= 1
            self.ends.setdefault(line.number, []).append(time.monotonic())

    def room(self, model: str) -> int:
        assert model == MODEL
        return self.room_now

    def tenant_ok(self, tenant: str) -> bool:
        return True

    def weight(self, tenant: str) -> float | None:
        return 1.0

    async def claim(self, batch_id: str) -> object | None:
        if not self.grant_claim:
            return None
        claim = object()
        self.claims.append(claim)
        return claim

    async def unclaim(self, claim: object) -> None:
        self.unclaimed.append(claim)


# -- batches and their files ---------------------------------------------------------------


def request(custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {
        "model": MODEL, "messages": [{"role": "user", "content": custom_id}],
        "stream": True}}).encode()


def add_batch(store: BatchStore, rows: list[bytes], *, status: str = "validating",
              expires_in: int = 3600, **fields: Any) -> BatchRecord:
    """A batch of ``rows`` (input lines, as they are) for TENANT, added to the store."""
    upload = store.add_file(TENANT, "batch", "in.jsonl", b"\n".join(rows) + b"\n")
    now = int(time.time())
    record = BatchRecord(id=new_id("batch_"), tenant=TENANT, application="", endpoint=CHAT,
                         input_file_id=upload.id, completion_window="24h", status=status,
                         created_at=now, expires_at=now + expires_in, **fields)
    store.add_batch(record)
    return record


def ids(*names: str) -> list[bytes]:
    return [request(name) for name in names]


def file_lines(store: BatchStore, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = store.file_content(TENANT, file_id)
    assert content is not None and content.endswith(b"\n")
    return [json.loads(raw) for raw in content.decode().splitlines()]


def outputs(store: BatchStore, batch: BatchRecord) -> tuple[dict[str, dict[str, Any]],
                                                             dict[str, dict[str, Any]]]:
    """The output and error files' lines by custom_id, after checking that no custom_id
    is in them twice (within a file or across both)."""
    out = file_lines(store, batch.output_file_id)
    err = file_lines(store, batch.error_file_id)
    every = [line["custom_id"] for line in out + err]
    assert len(every) == len(set(every)), f"a custom_id written twice: {every}"
    return ({line["custom_id"]: line for line in out},
            {line["custom_id"]: line for line in err})


async def drive(store: BatchStore, host: Host, batch_id: str, *, concurrency: int = 4,
                timeout: float = 3.0, wall: Callable[[], float] = time.time,
                during: Callable[[BatchRunner], Awaitable[None]] | None = None,
                ) -> BatchRecord:
    """Run a runner until the batch is finished (bounded), then stop it as the gateway's
    shutdown does. ``during`` runs beside it (moves the batch, changes the host)."""
    runner = BatchRunner(store, host, concurrency=concurrency, max_lines=1000, wall=wall)
    task = asyncio.create_task(runner.run())
    try:
        if during is not None:
            await during(runner)
        deadline = time.monotonic() + timeout
        while True:
            batch = store.batch(batch_id)
            assert batch is not None
            if batch.finished:
                return batch
            assert time.monotonic() < deadline, f"the batch is still {batch.status}"
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(check: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


# -- completed -------------------------------------------------------------------------------


def test_completed_batch_writes_output_and_error_files(store: BatchStore) -> None:
    """200s go to the output file with the engine's answer, a 404 to the error file with
    the gateway's; the batch completes with its counts, usage and stamps, as OpenAI's
    SDK reads them. Each line ran once."""
    def script(line: Line, attempt: int) -> LineAnswer:
        if line.custom_id == "b":
            return failure(line, 404, "model_not_found", "The model 'nope' does not exist")
        return ok(line)

    batch = add_batch(store, [request("a"), request("b"), b"", request("c")])
    host = Host(script)
    ended = asyncio.run(drive(store, host, batch.id))

    assert ended.status == "completed"
    assert sorted(host.runs) == [1, 2, 4]
    out, err = outputs(store, ended)
    assert sorted(out) == ["a", "c"] and sorted(err) == ["b"]

    a = out["a"]
    assert a["id"] == "batch_req_a" and a["error"] is None
    assert a["response"]["status_code"] == 200 and a["response"]["request_id"] == "tpg-a"
    assert a["response"]["body"] == chat_completion("a")
    b = err["b"]
    assert b["response"]["status_code"] == 404
    assert b["response"]["body"]["error"]["code"] == "model_not_found"
    assert b["error"] == {"code": "model_not_found",
                          "message": "The model 'nope' does not exist"}
    # output lines are in input order
    assert [line["custom_id"] for line in file_lines(store, ended.output_file_id)] == ["a", "c"]

    assert (ended.total, ended.model) == (3, MODEL)
    assert {"in_progress_at", "finalizing_at", "completed_at"} <= set(ended.stamps)
    output_file = store.file(TENANT, ended.output_file_id or "")
    assert output_file is not None and output_file.purpose == "batch_output"

    usage = store.usage(batch.id)
    shown = openai.types.Batch.model_validate(ended.to_json(usage))
    assert shown.request_counts is not None
    assert (shown.request_counts.total, shown.request_counts.completed,
            shown.request_counts.failed) == (3, 2, 1)
    assert shown.usage is not None
    assert (shown.usage.input_tokens, shown.usage.output_tokens,
            shown.usage.input_tokens_details.cached_tokens,
            shown.usage.total_tokens) == (20, 10, 4, 30)
    # the claim is given back once the batch is done
    assert host.claims and host.unclaimed == host.claims


def test_lines_are_sent_without_streaming(store: BatchStore) -> None:
    """A line that asked to stream is sent whole (its answer is stored, not relayed)."""
    seen: list[dict[str, Any]] = []

    def script(line: Line, attempt: int) -> LineAnswer:
        seen.append(json.loads(line.body))
        return ok(line)

    batch = add_batch(store, ids("a"))
    assert asyncio.run(drive(store, Host(script), batch.id)).status == "completed"
    [body] = seen
    assert "stream" not in body and body["model"] == MODEL


# -- failed -------------------------------------------------------------------------------


def test_malformed_input_file_fails_the_batch(store: BatchStore) -> None:
    """A file with bad lines fails in ``validating`` with OpenAI's errors list and not
    one line run."""
    rows = [request("a"), b"{not json", json.dumps({"method": "POST", "url": CHAT,
                                                     "body": {"model": MODEL}}).encode()]
    batch = add_batch(store, rows)
    host = Host()
    ended = asyncio.run(drive(store, host, batch.id))
    assert ended.status == "failed"
    assert host.runs == []
    assert ended.errors is not None
    assert [(e["code"], e["line"], e["param"]) for e in ended.errors] == [
        ("invalid_json_line", 2, None), ("missing_required_parameter", 3, "custom_id")]
    assert "failed_at" in ended.stamps and "in_progress_at" not in ended.stamps
    assert ended.output_file_id is None and ended.error_file_id is None
    shown = openai.types.Batch.model_validate(ended.to_json(store.usage(batch.id)))
    assert shown.errors is not None and shown.errors.data is not None
    assert len(shown.errors.data) == 2


def test_missing_input_file_fails_the_batch(store: BatchStore) -> None:
    batch = add_batch(store, ids("a"))
    assert store.delete_file(TENANT, batch.input_file_id)
    ended = asyncio.run(drive(store, Host(), batch.id))
    assert ended.status == "failed"
    assert ended.errors is not None
    assert [(e["code"], e["param"]) for e in ended.errors] == [("file_not_found",
                                                                "input_file_id")]


# -- retries -------------------------------------------------------------------------------


def test_429_is_retried_after_the_hold(store: BatchStore) -> None:
    """A budget or limit refusal is not the line's answer: the line runs again once the
    retry-after passed, and the tenant's other lines wait too (they would be refused
    alike). The 429 is in neither file."""
    hold = 0.2

    def script(line: Line, attempt: int) -> LineAnswer:
        if line.custom_id == "a" and attempt == 1:
            return failure(line, 429, "budget_exceeded", "over budget", retry_after_s=hold)
        return ok(line)

    batch = add_batch(store, ids("a", "b"))
    host = Host(script)
    ended = asyncio.run(drive(store, host, batch.id, concurrency=1))
    assert ended.status == "completed"
    assert host.runs == [1, 1, 2]
    assert host.starts[1][1] - host.ends[1][0] >= hold - 0.01
    assert host.starts[2][0] - host.ends[1][0] >= hold - 0.01
    out, err = outputs(store, ended)
    assert sorted(out) == ["a", "b"] and err == {}
    assert out["a"]["response"]["status_code"] == 200


def test_5xx_is_retried_up_to_attempts_then_written(store: BatchStore) -> None:
    """An engine failure is retried: a line that recovers ends in the output file, one
    that fails ATTEMPTS times ends in the error file with its last answer."""
    def script(line: Line, attempt: int) -> LineAnswer:
        if line.custom_id == "down":
            return failure(line, 503, "service_unavailable", "no engine")
        if line.custom_id == "flaky" and attempt == 1:
            return failure(line, 502, "bad_gateway", "engine went away")
        return ok(line)

    batch = add_batch(store, ids("down", "flaky", "fine"))
    host = Host(script)
    ended = asyncio.run(drive(store, host, batch.id))
    assert ended.status == "completed"
    assert host.runs.count(1) == ATTEMPTS
    assert host.runs.count(2) == 2 and host.runs.count(3) == 1
    out, err = outputs(store, ended)
    assert sorted(out) == ["fine", "flaky"] and sorted(err) == ["down"]
    assert err["down"]["response"]["status_code"] == 503
    assert err["down"]["error"]["code"] == "service_unavailable"
    usage = store.usage(batch.id)
    assert (usage.requests_completed, usage.requests_failed) == (2, 1)


def test_a_line_whose_run_raises_ends_as_an_internal_error(store: BatchStore) -> None:
    """A bug in the gateway's path fails the line (500, retried like one), never the
    batch: the other lines still complete."""
    def script(line: Line, attempt: int) -> LineAnswer:
        if line.custom_id == "boom":
            raise RuntimeError("gateway bug")
        return ok(line)

    batch = add_batch(store, ids("boom", "fine"))
    host = Host(script)
    ended = asyncio.run(drive(store, host, batch.id))
    assert ended.status == "completed"
    assert host.runs.count(1) == ATTEMPTS
    out, err = outputs(store, ended)
    assert list(out) == ["fine"]
    assert err["boom"]["response"]["status_code"] == 500
    assert err["boom"]["error"]["code"] == "internal_error"
    assert err["boom"]["id"] == f"batch_req_{batch.id.removeprefix('batch_')}-1"


# -- cancel and expiry ---------------------------------------------------------------------


def test_cancel_stops_starting_lines(store: BatchStore) -> None:
    """Cancelled while lines are slow: the lines in flight end and are written, no other
    line starts, the unrun ones are not written (OpenAI's behaviour)."""
    names = [f"r{i}" for i in range(8)]
    batch = add_batch(store, ids(*names))
    host = Host(delay=0.15)

    async def cancel(runner: BatchRunner) -> None:
        await until(lambda: len(host.runs) >= 1)
        assert store.move(batch.id, "in_progress", "cancelling") is not None
        runner.wake()

    ended = asyncio.run(drive(store, host, batch.id, concurrency=2, during=cancel))
    assert ended.status == "cancelled"
    assert {"cancelling_at", "cancelled_at"} <= set(ended.stamps)
    assert "completed_at" not in ended.stamps
    out, err = outputs(store, ended)
    ran = {names[n - 1] for n in host.runs}
    assert 1 <= len(ran) < len(names)
    assert set(out) == ran and err == {}
    assert len(host.runs) == len(ran)  # no line ran twice


def test_cancel_before_the_batch_started(store: BatchStore) -> None:
    """``validating -> cancelling`` (cancelled before its runner saw it): cancelled, no
    line run, no file."""
    batch = add_batch(store, ids("a", "b"))
    assert store.move(batch.id, "validating", "cancelling") is not None
    host = Host()
    ended = asyncio.run(drive(store, host, batch.id))
    assert ended.status == "cancelled" and host.runs == []
    assert ended.output_file_id is None and ended.error_file_id is None


def test_expiry_writes_unrun_lines_as_batch_expired(store: BatchStore) -> None:
    """The completion window ends while the batch runs (the wall clock jumps past
    ``expires_at`` during line 2): the lines in flight end and are written, the others
    go to the error file as ``batch_expired`` with no response."""
    shift = [0.0]

    def wall() -> float:
        return time.time() + shift[0]

    def script(line: Line, attempt: int) -> LineAnswer:
        if line.number == 2:
            shift[0] = 7200.0
        return ok(line)

    names = [f"r{i}" for i in range(1, 7)]
    batch = add_batch(store, ids(*names))
    host = Host(script, delay=0.02)
    ended = asyncio.run(drive(store, host, batch.id, concurrency=1, wall=wall))
    assert ended.status == "expired"
    assert "expired_at" in ended.stamps
    out, err = outputs(store, ended)
    ran = {names[n - 1] for n in host.runs}
    assert {"r1", "r2"} <= ran and len(ran) < len(names)
    assert set(out) == ran
    assert set(err) == set(names) - ran
    hexid = batch.id.removeprefix("batch_")
    for custom_id, line in err.items():
        assert line["response"] is None
        assert line["error"]["code"] == "batch_expired"
        assert line["id"] == f"batch_req_{hexid}-{names.index(custom_id) + 1}"


def test_expired_batch_found_on_resume(store: BatchStore) -> None:
    """A gateway restarted after the window ended: the batch ends ``expired`` at once
    with the results it had and its unrun lines as ``batch_expired``; nothing runs."""
    batch = add_batch(store, ids("a", "b", "c"), status="in_progress", expires_in=-10,
                      total=3)
    done = LineResult(1, "a", True, result_line("tpg-a", "a", 200, {"x": 1}, None), 3, 0, 4)
    store.add_result(batch.id, done)
    host = Host()
    ended = asyncio.run(drive(store, host, batch.id))
    assert ended.status == "expired" and host.runs == []
    out, err = outputs(store, ended)
    assert list(out) == ["a"] and sorted(err) == ["b", "c"]
    assert file_lines(store, ended.output_file_id)[0] == json.loads(done.text)


def test_batch_expired_before_validation(store: BatchStore) -> None:
    """``expires_at`` already past when the runner first sees it: expired, nothing run."""
    batch = add_batch(store, ids("a"), expires_in=-10)
    host = Host()
    ended = asyncio.run(drive(store, host, batch.id))
    assert ended.status == "expired" and host.runs == []


# -- resume --------------------------------------------------------------------------------


def test_resume_runs_only_lines_without_a_result(store: BatchStore) -> None:
    """A batch resumed after a crash: lines with a stored result are not run again, the
    rest are, and the files hold each custom_id once with the stored results as they
    were written."""
    names = ["a", "b", "c", "d", "e"]
    batch = add_batch(store, ids(*names), status="in_progress", total=5,
                      stamps={"in_progress_at": int(time.time())})
    before_ok = LineResult(1, "a", True, result_line("tpg-old-a", "a", 200, {"old": 1}, None),
                           7, 1, 2)
    before_err = LineResult(3, "c", False, result_line("tpg-old-c", "c", 404, {"old": 3},
                                                        {"code": "x", "message": "y"}))
    store.add_result(batch.id, before_ok)
    store.add_result(batch.id, before_err)
    host = Host()
    ended = asyncio.run(drive(store, host, batch.id))
    assert ended.status == "completed"
    assert sorted(host.runs) == [2, 4, 5]
    out, err = outputs(store, ended)
    assert sorted(out) == ["a", "b", "d", "e"] and list(err) == ["c"]
    assert out["a"] == json.loads(before_ok.text) and err["c"] == json.loads(before_err.text)
    usage = store.usage(batch.id)
    assert (usage.requests_completed, usage.requests_failed) == (4, 1)
    assert usage.input_tokens == 7 + 3 * 10


def test_a_runner_stopped_mid_batch_is_resumed_by_the_next(store: BatchStore) -> None:
    """The gateway stops while lines are in flight (the runner task cancelled): nothing
    is written for them, the claims are given back, and the next runner on the same
    store finishes the batch with each custom_id once."""
    names = [f"r{i}" for i in range(6)]
    batch = add_batch(store, ids(*names))
    slow = Host(delay=lambda line: 0.01 if line.number <= 2 else 5.0)

    async def first_runner() -> None:
        runner = BatchRunner(store, slow, concurrency=2, max_lines=1000)
        task = asyncio.create_task(runner.run())
        await until(lambda: len(store.results(batch.id)) >= 2 and slow.active == 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(first_runner())
    assert sorted(slow.unclaimed, key=id) == sorted(slow.claims, key=id)
    assert store.done_lines(batch.id) == {1, 2}
    current = store.batch(batch.id)
    assert current is not None and current.status == "in_progress"

    fresh = Host()
    ended = asyncio.run(drive(store, fresh, batch.id))
    assert ended.status == "completed"
    assert sorted(fresh.runs) == [3, 4, 5, 6]
    out, err = outputs(store, ended)
    assert sorted(out) == sorted(names) and err == {}


def test_a_line_without_an_answer_is_not_lost(store: BatchStore) -> None:
    """``run_line`` answering None means "no answer, run it again where the batch
    resumes": the batch must not complete without that line."""
    def script(line: Line, attempt: int) -> LineAnswer | None:
        if line.custom_id == "b" and attempt == 1:
            return None
        return ok(line)

    batch = add_batch(store, ids("a", "b", "c"))
    host = Host(script)

    async def first_then_next() -> BatchRecord:
        try:
            return await drive(store, host, batch.id, timeout=0.5)
        except AssertionError:  # not finished: the next runner resumes it
            return await drive(store, Host(), batch.id)

    ended = asyncio.run(first_then_next())
    assert ended.status == "completed"
    out, err = outputs(store, ended)
    assert sorted(out) == ["a", "b", "c"] and err == {}


# -- room and concurrency ------------------------------------------------------------------


def test_no_room_no_line(store: BatchStore) -> None:
    """While the host says there is no room (live traffic uses the slots), the batch is
    validated but no line starts; once room appears it completes."""
    batch = add_batch(store, ids("a", "b", "c"))
    host = Host(room=0)

    async def open_up(runner: BatchRunner) -> None:
        await until(lambda: (b := store.batch(batch.id)) is not None
                    and b.status == "in_progress")
        await asyncio.sleep(0.25)
        assert host.runs == []
        assert runner.feed.waiting() == 1
        host.room_now = 1

    ended = asyncio.run(drive(store, host, batch.id, during=open_up))
    assert ended.status == "completed"
    assert sorted(host.runs) == [1, 2, 3]
    assert host.most_active == 1


def test_concurrency_bound(store: BatchStore) -> None:
    """At most ``concurrency`` lines run at once, whatever the room; and it is reached."""
    batch = add_batch(store, ids(*[f"r{i}" for i in range(12)]))
    host = Host(delay=0.05)
    ended = asyncio.run(drive(store, host, batch.id, concurrency=3))
    assert ended.status == "completed"
    assert host.most_active == 3
    assert sorted(host.runs) == list(range(1, 13))


def test_room_counts_lines_that_do_not_hold_a_slot_yet(store: BatchStore) -> None:
    """A line started but not yet holding its engine slot counts against the room: with
    2 free slots and a host that reports slots only at the end, 2 lines run at once."""
    batch = add_batch(store, ids(*[f"r{i}" for i in range(8)]))
    host = Host(room=2, delay=0.04, take_slot=False)
    ended = asyncio.run(drive(store, host, batch.id, concurrency=10))
    assert ended.status == "completed"
    assert host.most_active == 2


def test_an_unclaimed_batch_is_left_to_its_holder(store: BatchStore) -> None:
    """Another replica holds the batch's lease: this runner starts none of its lines."""
    batch = add_batch(store, ids("a"))
    host = Host(claim=False)

    async def watch() -> None:
        runner = BatchRunner(store, host, concurrency=2, max_lines=1000)
        task = asyncio.create_task(runner.run())
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(watch())
    assert host.runs == []
    current = store.batch(batch.id)
    assert current is not None and current.status == "validating"


def test_two_batches_both_complete(store: BatchStore) -> None:
    """Batches run side by side and each gets its own files."""
    first = add_batch(store, ids("a1", "a2", "a3"))
    second = add_batch(store, ids("b1", "b2"))
    host = Host(delay=0.01)

    async def both() -> tuple[BatchRecord, BatchRecord]:
        one = await drive(store, host, first.id)
        two = store.batch(second.id)
        assert two is not None
        if not two.finished:
            two = await drive(store, host, second.id)
        return one, two

    one, two = asyncio.run(both())
    assert one.status == two.status == "completed"
    assert sorted(outputs(store, one)[0]) == ["a1", "a2", "a3"]
    assert sorted(outputs(store, two)[0]) == ["b1", "b2"]


class SlowWrites(BatchStore):
    """The real store, each result's write taking ``delay`` s (a busy disk, a loaded
    machine): the runner must not finalize a batch while a result is still being written."""

    delay = 0.3

    def add_result(self, batch_id: str, result: LineResult) -> bool:
        time.sleep(self.delay)
        return super().add_result(batch_id, result)


@pytest.mark.parametrize("expires", [False, True])
def test_a_result_being_written_is_in_the_files(tmp_path: Path, expires: bool) -> None:
    """The lines end together and their results take 0.3 s to write; the runner wakes
    meanwhile (every 50 ms, at once when expired): every line is in the output, none lost
    between "in flight" and "written". With ``expires`` the batch's window ends while the
    lines run, which makes the runner look every 50 ms."""
    slow = SlowWrites("sqlite:///" + str(tmp_path / "slow.batches.db"))
    try:
        names = ["a", "b", "c"]
        # Whole seconds: the window ends 1-2 s after the batch starts, the lines run 2.5 s.
        batch = add_batch(slow, ids(*names), expires_in=2 if expires else 3600)
        ended = asyncio.run(drive(slow, Host(delay=2.5 if expires else 0.1), batch.id,
                                  timeout=10.0))
        out, err = outputs(slow, ended)
        assert sorted(out) == names and err == {}
        assert ended.status == ("expired" if expires else "completed")
    finally:
        slow.close()


# -- batches that cannot progress, bounded memory ----------------------------------------


def test_a_batch_whose_driving_keeps_failing_ends_failed_after_bounded_tries(
        store: BatchStore) -> None:
    """An in-progress batch whose input's stored parts are gone (its driving raises each
    time while the store answers): tried ``BATCH_ATTEMPTS`` times with back-off, not on
    every scan, then ``failed`` with the reason; no line ran."""
    batch = add_batch(store, ids("a", "b"), status="in_progress")
    with store._transaction():
        store._execute("DELETE FROM batch_file_parts WHERE file_id = ?",
                       (batch.input_file_id,))
    host = Host()
    ended = asyncio.run(drive(store, host, batch.id, timeout=5.0))
    assert ended.status == "failed" and host.runs == []
    assert ended.errors is not None
    assert [e["code"] for e in ended.errors] == ["batch_failed"]
    # One claim per try: the scans (every 50 ms here) did not each claim it again.
    assert len(host.claims) == runner_module.BATCH_ATTEMPTS


def test_a_running_batch_holds_one_window_of_its_input(
        store: BatchStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines are read a window at a time: with a window of 4 lines, the lines waiting in
    a batch never number more than a window, and every line still runs once."""
    monkeypatch.setattr(runner_module, "WINDOW_LINES", 4)
    batch = add_batch(store, ids(*(f"r{i}" for i in range(30))))
    host = Host(delay=0.005)
    most = 0

    async def watch(runner: BatchRunner) -> None:
        async def sample() -> None:
            nonlocal most
            while True:
                for job in list(runner._jobs.values()):
                    most = max(most, len(job.pending))
                await asyncio.sleep(0.001)

        asyncio.get_running_loop().create_task(sample())

    ended = asyncio.run(drive(store, host, batch.id, concurrency=2, during=watch))
    assert ended.status == "completed"
    assert sorted(host.runs) == list(range(1, 31))
    assert 0 < most <= 4 + 2, most  # a window, plus lines sent back to wait
