"""Batch records, their status machine, and how they look through OpenAI's API.

The machine is the one guard that keeps two replicas (or a cancel racing a finish) from
walking a batch backwards, so every pair of statuses is checked, not a sample. The JSON
shapes are validated with OpenAI's own SDK models: that is what clients parse them with.
"""

from __future__ import annotations

import itertools
import json

import openai.types
import pytest

from tokenpace.gateway.batch import (
    FINISHED,
    MOVES,
    UNFINISHED,
    BadMove,
    BatchRecord,
    FileRecord,
    Usage,
    check_move,
    result_line,
)
from tokenpace.gateway.batch._objects import STAMPS

STATUSES = UNFINISHED + FINISHED


def batch(**changes: object) -> BatchRecord:
    fields: dict[str, object] = dict(
        id="batch_0123abcd", tenant="acme", application="", endpoint="/v1/chat/completions",
        input_file_id="file-in", completion_window="24h", status="in_progress",
        created_at=1_795_000_000, expires_at=1_795_086_400, total=5)
    fields.update(changes)
    return BatchRecord(**fields)  # type: ignore[arg-type]


# -- the status machine ------------------------------------------------------------------


def test_statuses_are_openais() -> None:
    """Exactly OpenAI's eight statuses, each either unfinished or finished."""
    literal = openai.types.Batch.model_fields["status"].annotation
    assert set(STATUSES) == set(literal.__args__)  # type: ignore[union-attr]
    assert not set(UNFINISHED) & set(FINISHED)
    assert set(MOVES) == set(UNFINISHED)


@pytest.mark.parametrize(("old", "new"), list(itertools.product(STATUSES, STATUSES)))
def test_check_move_allows_exactly_moves(old: str, new: str) -> None:
    """Every pair of statuses: allowed iff MOVES lists it; nothing leaves a finished
    status and nothing stays in place (a move to itself would re-stamp nothing useful)."""
    allowed = new in MOVES.get(old, ())
    if old in FINISHED or old == new:
        assert not allowed
    if allowed:
        check_move(old, new)
    else:
        with pytest.raises(BadMove, match=f"{old!r} to {new!r}"):
            check_move(old, new)


def test_moves_follow_openais_machine() -> None:
    """The documented graph, spelled out: a change to MOVES must be deliberate. A batch
    that cannot progress may end ``failed`` from any unfinished status."""
    assert MOVES == {
        "validating": ("in_progress", "failed", "cancelling", "expired"),
        "in_progress": ("finalizing", "cancelling", "expired", "failed"),
        "finalizing": ("completed", "failed"),
        "cancelling": ("cancelled", "failed"),
    }
    # every status a batch can enter has the stamp OpenAI shows for it
    entered = {new for news in MOVES.values() for new in news}
    assert entered == set(STATUSES) - {"validating"}
    assert set(STAMPS) == entered


def test_bad_move_is_a_value_error() -> None:
    """Callers that map ValueError to a 400 catch it without knowing the batch module."""
    assert issubclass(BadMove, ValueError)
    with pytest.raises(ValueError):
        check_move("unknown", "in_progress")


def test_finished_property() -> None:
    for status in STATUSES:
        assert batch(status=status).finished is (status in FINISHED)


# -- JSON shapes -----------------------------------------------------------------------


def test_batch_to_json_is_openais_batch() -> None:
    """Every field of ``Batch`` is present (none left to the SDK's default), no field is
    unknown to it, and the values land where the SDK reads them."""
    stamps = {"in_progress_at": 1_795_000_010, "finalizing_at": 1_795_000_500,
              "completed_at": 1_795_000_501}
    errors = [{"code": "invalid_json_line", "message": "line 2 is not valid JSON",
               "param": None, "line": 2}]
    record = batch(status="completed", stamps=stamps, metadata={"job": "nightly"},
                   errors=errors, output_file_id="file-out", error_file_id="file-err",
                   model="tiny", total=7)
    data = record.to_json(Usage(requests_completed=5, requests_failed=2, input_tokens=100,
                                cached_tokens=30, output_tokens=40))
    assert set(data) == set(openai.types.Batch.model_fields)
    json.dumps(data)  # plain JSON: the route returns it as it is

    parsed = openai.types.Batch.model_validate(data)
    assert parsed.id == "batch_0123abcd" and parsed.object == "batch"
    assert parsed.status == "completed" and parsed.endpoint == "/v1/chat/completions"
    assert parsed.input_file_id == "file-in" and parsed.completion_window == "24h"
    assert (parsed.output_file_id, parsed.error_file_id) == ("file-out", "file-err")
    assert (parsed.created_at, parsed.expires_at) == (1_795_000_000, 1_795_086_400)
    assert (parsed.in_progress_at, parsed.finalizing_at, parsed.completed_at) == (
        1_795_000_010, 1_795_000_500, 1_795_000_501)
    assert parsed.failed_at is None and parsed.cancelled_at is None
    assert parsed.cancelling_at is None and parsed.expired_at is None
    assert parsed.metadata == {"job": "nightly"} and parsed.model == "tiny"

    assert parsed.request_counts is not None
    assert (parsed.request_counts.total, parsed.request_counts.completed,
            parsed.request_counts.failed) == (7, 5, 2)
    assert parsed.usage is not None
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens,
            parsed.usage.total_tokens) == (100, 40, 140)
    assert parsed.usage.input_tokens_details.cached_tokens == 30
    assert parsed.usage.output_tokens_details.reasoning_tokens == 0

    assert parsed.errors is not None and parsed.errors.object == "list"
    assert parsed.errors.data is not None
    [error] = parsed.errors.data
    assert (error.code, error.line, error.param) == ("invalid_json_line", 2, None)


def test_batch_to_json_without_errors_or_usage() -> None:
    """A fresh batch: ``errors`` is null (not an empty list object), every stamp null,
    usage all zeros (it is a required object in the SDK once present)."""
    data = batch(status="validating", total=0).to_json(Usage())
    assert data["errors"] is None
    assert all(data[stamp] is None for stamp in STAMPS.values())
    parsed = openai.types.Batch.model_validate(data)
    assert parsed.errors is None and parsed.output_file_id is None and parsed.model is None
    assert parsed.request_counts is not None and parsed.request_counts.total == 0
    assert parsed.usage is not None and parsed.usage.total_tokens == 0
    # an empty list of errors is shown as no errors
    assert batch(errors=[]).to_json(Usage())["errors"] is None


def test_file_to_json_is_openais_file_object() -> None:
    record = FileRecord("file-abc", "acme", "batch", "input.jsonl", 1234, 1_795_000_000)
    data = record.to_json()
    assert set(data) == set(openai.types.FileObject.model_fields)
    parsed = openai.types.FileObject.model_validate(data)
    assert (parsed.id, parsed.object, parsed.bytes, parsed.created_at) == (
        "file-abc", "file", 1234, 1_795_000_000)
    assert (parsed.filename, parsed.purpose, parsed.status) == ("input.jsonl", "batch",
                                                                "processed")
    assert parsed.expires_at is None
    output = FileRecord("file-out", "acme", "batch_output", "batch_x_output.jsonl", 9, 1)
    assert openai.types.FileObject.model_validate(output.to_json()).purpose == "batch_output"


# -- output and error file lines -----------------------------------------------------------


def test_result_line_of_an_answer() -> None:
    """OpenAI's output line: ``batch_req_`` + the request id without the gateway's
    ``tpg-`` prefix, the engine's answer under ``response``, one line of compact JSON."""
    body = {"id": "chatcmpl-1", "object": "chat.completion", "choices": []}
    text = result_line("tpg-9f3a", "row-1", 200, body, None)
    assert "\n" not in text
    assert json.loads(text) == {
        "id": "batch_req_9f3a", "custom_id": "row-1",
        "response": {"status_code": 200, "request_id": "tpg-9f3a", "body": body},
        "error": None}


def test_result_line_of_an_error_answer() -> None:
    """A line the gateway refused keeps its HTTP answer and names the error."""
    body = {"error": {"message": "no such model", "type": "invalid_request_error",
                      "code": "model_not_found"}}
    text = result_line("tpg-77", "row-2", 404, body,
                       {"code": "model_not_found", "message": "no such model"})
    data = json.loads(text)
    assert data["response"] == {"status_code": 404, "request_id": "tpg-77", "body": body}
    assert data["error"] == {"code": "model_not_found", "message": "no such model"}


def test_result_line_of_a_line_that_never_ran() -> None:
    """Expired lines have no answer: ``response`` is null, ``error`` says why. A request
    id without the prefix is used as it is."""
    data = json.loads(result_line("abc-3", "row-3", None, None,
                                  {"code": "batch_expired", "message": "not run"}))
    assert data == {"id": "batch_req_abc-3", "custom_id": "row-3", "response": None,
                    "error": {"code": "batch_expired", "message": "not run"}}


def test_result_line_keeps_unusual_custom_ids() -> None:
    """custom_ids are the client's: quotes, newlines and non-ASCII come back intact."""
    custom_id = 'a "quoted"\nid é ✓'
    assert json.loads(result_line("tpg-1", custom_id, 200, {}, None))["custom_id"] == custom_id
