"""Reading a Batch API input file: ``parse_lines`` and ``count_lines``.

A batch runs only when every line of its file passed these checks, and the problems it
reports become the failed batch's ``errors`` list, which clients read through OpenAI's
SDK. So the tests pin each problem's code, param and line number (as an editor shows it),
and the exact shape of what a valid file turns into (the bodies the engines receive).
"""

from __future__ import annotations

import json
from typing import Any

import openai.types
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenpace.gateway.batch import ENDPOINTS, Line, Problem, count_lines, parse_lines
from tokenpace.gateway.batch._lines import (
    MAX_CUSTOM_ID,
    MAX_PROBLEMS,
    LineChecker,
    raw_lines,
)

CHAT = "/v1/chat/completions"


def request(custom_id: Any, *, url: Any = CHAT, method: Any = "POST",
            body: Any = None, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """One input line as a dict (``drop``: keys to leave out)."""
    item: dict[str, Any] = {"custom_id": custom_id, "method": method, "url": url,
                            "body": {"model": "tiny", "messages": [
                                {"role": "user", "content": "hi"}]} if body is None else body}
    for key in drop:
        item.pop(key)
    return item


def jsonl(*items: Any) -> bytes:
    """A file of one JSON value per line (``bytes`` items are written as they are)."""
    return b"\n".join(i if isinstance(i, bytes) else json.dumps(i).encode() for i in items)


def only_problem(content: bytes, endpoint: str = CHAT, max_lines: int = 100) -> Problem:
    """The one problem of a file that must have exactly one (a second would mean a check
    fired that should not have)."""
    _, problems = parse_lines(content, endpoint, max_lines)
    assert len(problems) == 1, problems
    return problems[0]


# -- a valid file ----------------------------------------------------------------------


def test_valid_file_gives_lines_numbered_as_an_editor_shows_them() -> None:
    """Blank lines (also whitespace-only and a trailing newline) are skipped but still
    counted, so a line number in an error points at the right line of the client's file."""
    content = (jsonl(request("a"), b"", b"   ", request("b"), b"\t", request("c")) + b"\n")
    lines, problems = parse_lines(content, CHAT, 100)
    assert problems == []
    assert [(line.number, line.custom_id) for line in lines] == [(1, "a"), (4, "b"), (6, "c")]
    assert all(isinstance(line, Line) and line.model == "tiny" for line in lines)
    assert count_lines(content) == 3


def test_crlf_line_endings_are_accepted() -> None:
    """Files written on Windows end their lines with CRLF; JSON allows the stray CR."""
    content = jsonl(request("a"), request("b")).replace(b"\n", b"\r\n") + b"\r\n"
    lines, problems = parse_lines(content, CHAT, 100)
    assert problems == []
    assert [line.custom_id for line in lines] == ["a", "b"]


def test_body_is_reencoded_without_streaming_fields() -> None:
    """Batch answers are stored whole: a line asking to stream must not reach the engine
    with ``stream`` (its answer would be SSE); every other field goes through unchanged."""
    body = {"model": "m-1", "messages": [{"role": "user", "content": "héllo"}],
            "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.5}
    lines, problems = parse_lines(jsonl(request("x", body=body)), CHAT, 10)
    assert problems == []
    [line] = lines
    assert line.model == "m-1"
    sent = json.loads(line.body)
    assert sent == {"model": "m-1", "messages": [{"role": "user", "content": "héllo"}],
                    "max_tokens": 7, "temperature": 0.5}
    assert b" " not in line.body  # compact: what is sent is what the estimate counts


def test_model_is_taken_from_each_body() -> None:
    """The feed queues a line under its own model, so mixed-model files keep each one."""
    content = jsonl(request("a", body={"model": "m-a"}), request("b", body={"model": "m-b"}))
    lines, _ = parse_lines(content, CHAT, 10)
    assert [line.model for line in lines] == ["m-a", "m-b"]


def test_every_endpoint_of_the_batch_api_is_accepted() -> None:
    """Each endpoint a batch may name takes lines whose url is that endpoint."""
    for endpoint in ENDPOINTS:
        lines, problems = parse_lines(jsonl(request("a", url=endpoint,
                                                    body={"model": "tiny", "input": "x"})),
                                      endpoint, 10)
        assert problems == [], endpoint
        assert len(lines) == 1


def test_count_lines_counts_non_blank_lines_only() -> None:
    """The upload limit counts requests, not newlines (and parses nothing)."""
    assert count_lines(b"") == 0
    assert count_lines(b"\n\n  \n") == 0
    assert count_lines(b"not json\n\n{}\n") == 2
    assert count_lines(b"x") == 1


# -- each problem ----------------------------------------------------------------------


def test_invalid_json_line() -> None:
    """A line that is not JSON is reported with its number; the good lines around it are
    still parsed (the batch fails anyway, but all problems show in one round)."""
    lines, problems = parse_lines(jsonl(request("a"), b"{not json", request("c")), CHAT, 10)
    assert [line.custom_id for line in lines] == ["a", "c"]
    [problem] = problems
    assert (problem.code, problem.line, problem.param) == ("invalid_json_line", 2, None)
    assert "line 2" in problem.message


def test_invalid_utf8_is_an_invalid_json_line() -> None:
    """Bytes that are not UTF-8 must be a problem, not an exception out of the runner."""
    problem = only_problem(b'{"custom_id": "\xff\xfe"}')
    assert (problem.code, problem.line) == ("invalid_json_line", 1)


def test_non_object_line() -> None:
    """A JSON array, string or number is valid JSON but not a request."""
    for raw in (b"[1, 2]", b'"text"', b"42", b"null"):
        problem = only_problem(raw)
        assert (problem.code, problem.line) == ("invalid_json_line", 1), raw
        assert "not a JSON object" in problem.message


def test_custom_id_missing_empty_or_not_a_string() -> None:
    for item in (request("x", drop=("custom_id",)), request(""), request(7), request(None)):
        problem = only_problem(jsonl(item))
        assert (problem.code, problem.param, problem.line) == (
            "missing_required_parameter", "custom_id", 1), item


def test_custom_id_too_long() -> None:
    """MAX_CUSTOM_ID characters pass; one more is an ``invalid_value``."""
    lines, problems = parse_lines(jsonl(request("i" * MAX_CUSTOM_ID)), CHAT, 10)
    assert problems == [] and len(lines) == 1
    problem = only_problem(jsonl(request("i" * (MAX_CUSTOM_ID + 1))))
    assert (problem.code, problem.param, problem.line) == ("invalid_value", "custom_id", 1)


def test_duplicate_custom_id_names_the_first_line() -> None:
    """The output file is keyed by custom_id, so a repeated one would be ambiguous; the
    message says where it was first used so the client can fix the right line."""
    lines, problems = parse_lines(jsonl(request("a"), b"", request("b"), request("a")),
                                  CHAT, 10)
    assert [line.custom_id for line in lines] == ["a", "b"]
    [problem] = problems
    assert (problem.code, problem.param, problem.line) == ("duplicate_custom_id", "custom_id", 4)
    assert "line 1" in problem.message


def test_method_must_be_post() -> None:
    for method in ("GET", "post", None):
        problem = only_problem(jsonl(request("a", method=method)))
        assert (problem.code, problem.param, problem.line) == ("invalid_value", "method", 1)
    problem = only_problem(jsonl(request("a", drop=("method",))))
    assert problem.param == "method"


def test_url_must_be_the_batch_endpoint() -> None:
    """Every line of a batch runs on the batch's one endpoint."""
    problem = only_problem(jsonl(request("a", url="/v1/completions")))
    assert (problem.code, problem.param, problem.line) == ("invalid_url", "url", 1)
    problem = only_problem(jsonl(request("a", drop=("url",))))
    assert (problem.code, problem.param) == ("invalid_url", "url")


def test_body_must_be_an_object() -> None:
    for body in ([], "text", 3):
        problem = only_problem(jsonl(request("a", body=body)))
        assert (problem.code, problem.param, problem.line) == ("invalid_value", "body", 1)
    problem = only_problem(jsonl(request("a", drop=("body",))))
    assert (problem.code, problem.param) == ("invalid_value", "body")


def test_body_must_name_a_model() -> None:
    for body in ({}, {"model": ""}, {"model": 3}, {"messages": []}):
        problem = only_problem(jsonl(request("a", body=body)))
        assert (problem.code, problem.param, problem.line) == (
            "missing_required_parameter", "body.model", 1), body


def test_more_than_max_lines() -> None:
    """The line limit counts requests (blank lines free), and stops reading at once: a
    file of a million lines is not parsed to report its problems."""
    content = jsonl(request("a"), b"", request("b"), request("c"), b"{bad", b"{bad")
    lines, problems = parse_lines(content, CHAT, 2)
    assert [line.custom_id for line in lines] == ["a", "b"]
    [problem] = problems
    assert (problem.code, problem.line) == ("too_many_requests", 4)
    lines, problems = parse_lines(jsonl(request("a"), request("b")), CHAT, 2)
    assert problems == [] and len(lines) == 2


def test_empty_file() -> None:
    for content in (b"", b"\n", b"  \n\n\t\n"):
        lines, problems = parse_lines(content, CHAT, 10)
        assert lines == []
        assert [(p.code, p.line, p.param) for p in problems] == [("empty_file", None, None)]


def test_a_file_of_bad_lines_is_not_reported_as_empty() -> None:
    """``empty_file`` is only for a file without requests, not one whose requests are all
    wrong: the client must see what is wrong with them."""
    _, problems = parse_lines(b"{bad\n", CHAT, 10)
    assert [p.code for p in problems] == ["invalid_json_line"]


def test_unknown_endpoint() -> None:
    """Only the endpoints of ENDPOINTS may run as a batch (no moderations here): the
    problem is about the batch's ``endpoint`` and no line is read."""
    lines, problems = parse_lines(jsonl(request("a", url="/v1/moderations")),
                                  "/v1/moderations", 10)
    assert lines == []
    [problem] = problems
    assert (problem.code, problem.param, problem.line) == ("invalid_value", "endpoint", None)
    assert "/v1/moderations" in problem.message


def test_embedding_lines_are_read_as_openai_writes_them() -> None:
    """``/v1/embeddings`` is a batch endpoint, as in OpenAI's Batch API: its lines are
    read and run as embeddings requests."""
    assert ENDPOINTS["/v1/embeddings"] == "embeddings"
    body = {"model": "m", "input": ["a", "b"]}
    lines, problems = parse_lines(jsonl(request("e", url="/v1/embeddings", body=body)),
                                  "/v1/embeddings", 10)
    assert problems == [] and [x.custom_id for x in lines] == ["e"]
    assert json.loads(lines[0].body) == body


def test_problems_are_capped_in_line_order() -> None:
    """A file of many bad lines reports the first MAX_PROBLEMS, in order: enough to fix
    it, without a batch object megabytes long."""
    count = MAX_PROBLEMS + 50
    content = b"\n".join(b"{bad" for _ in range(count))
    lines, problems = parse_lines(content, CHAT, 10 * count)
    assert lines == []
    assert len(problems) == MAX_PROBLEMS
    assert [p.line for p in problems] == list(range(1, MAX_PROBLEMS + 1))


def test_problem_to_json_is_openai_batch_error() -> None:
    """The errors list is read by OpenAI's SDK: each entry is a ``BatchError``."""
    problem = Problem("duplicate_custom_id", "line 3: ...", 3, "custom_id")
    data = problem.to_json()
    assert data == {"code": "duplicate_custom_id", "message": "line 3: ...",
                    "param": "custom_id", "line": 3}
    assert set(data) == set(openai.types.BatchError.model_fields)
    parsed = openai.types.BatchError.model_validate(data)
    assert (parsed.code, parsed.message, parsed.param, parsed.line) == (
        "duplicate_custom_id", "line 3: ...", "custom_id", 3)
    assert Problem("empty_file", "no requests").to_json() == {
        "code": "empty_file", "message": "no requests", "param": None, "line": None}


def test_text_no_store_keeps_fails_its_line() -> None:
    """A NUL or a lone surrogate in a custom_id or a model (as JSON escapes) fails the
    line at validation: no store can keep it, so the batch must never start with it."""
    for custom_id, body, param in (
            ("a\u0000b", None, "custom_id"), ("a\ud800", None, "custom_id"),
            ("ok-1", {"model": "m\u0000"}, "body.model"),
            ("ok-2", {"model": "\udfff"}, "body.model")):
        problem = only_problem(json.dumps(request(custom_id, body=body)).encode())
        assert (problem.code, problem.param, problem.line) == ("invalid_value", param, 1)
    # An escaped pair is one character (a valid emoji), not a lone surrogate.
    lines, problems = parse_lines(json.dumps(request("\ud83d\ude00")).encode(), CHAT, 5)
    assert problems == [] and lines[0].custom_id == "\U0001F600"


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=40))
def test_lines_cut_from_chunks_of_any_size_are_the_whole_files(content: bytes,
                                                               size: int) -> None:
    """``raw_lines`` over the file in chunks of any size gives the non-blank lines of
    the whole, each with its number and the offset just past it."""
    whole = [(n, raw) for n, raw in enumerate(content.split(b"\n"), start=1) if raw.strip()]
    chunks = [content[i:i + size] for i in range(0, len(content), size)]
    got = list(raw_lines(chunks))
    assert [(n, raw) for n, _, raw in got] == whole
    for n, end, raw in got:
        assert content[:end].endswith(raw + b"\n") or (end == len(content)
                                                        and content.endswith(raw))


def test_the_checker_keeps_digests_not_lines() -> None:
    """Duplicates are found across a file checked line by line, and what the checker
    keeps per line is a 16-byte digest and a number, whatever the custom_id's size."""
    checker = LineChecker(CHAT, 10)
    long_id = "x" * MAX_CUSTOM_ID
    assert checker.check(1, json.dumps(request(long_id)).encode()) is not None
    assert checker.check(3, json.dumps(request(long_id)).encode()) is None
    assert [(p.code, p.line) for p in checker.finish()] == [("duplicate_custom_id", 3)]
    assert all(len(key) == 16 for key in checker._seen)


# -- property ----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(st.characters(blacklist_categories=("Cs",),
                                      blacklist_characters="\x00"),
                        min_size=1, max_size=MAX_CUSTOM_ID // 8), min_size=1, max_size=25,
                unique=True),
       st.lists(st.sampled_from([b"", b" ", b"\t"]), max_size=25))
def test_any_distinct_custom_ids_come_back_in_order(ids: list[str], blanks: list[bytes]) -> None:
    """Whatever the ids (any unicode a store keeps, quotes, escaped newlines), a valid
    file returns them in file order with no problem, and the line numbers point at their
    lines."""
    rows: list[bytes] = []
    numbers: list[int] = []
    for index, custom_id in enumerate(ids):
        if index < len(blanks):
            rows.append(blanks[index])
        rows.append(json.dumps(request(custom_id)).encode())
        numbers.append(len(rows))
    lines, problems = parse_lines(b"\n".join(rows), CHAT, len(ids))
    assert problems == []
    assert [line.custom_id for line in lines] == ids
    assert [line.number for line in lines] == numbers
