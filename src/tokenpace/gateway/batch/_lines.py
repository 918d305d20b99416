"""An input file of the Batch API read into its lines, or the reasons it cannot be run.

Pure: bytes in, lines and problems out; no I/O. A file is read whole at validation (and
again when a restarted gateway resumes its batch), so a batch either starts with every
line checked or fails in ``validating`` with OpenAI's ``errors`` list, never half-way.

What is checked here is the file's shape, the same for every tenant: one JSON object per
line with a unique ``custom_id``, ``method: POST``, the batch's ``url`` and an object
``body`` naming a ``model``. What a line asks for (its model, its caps, its budget) is
decided when it runs, by the same admission as a live request: such a line ends in the
error file, the batch goes on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ENDPOINTS: dict[str, str] = {"/v1/chat/completions": "chat",
                             "/v1/completions": "completion",
                             "/v1/responses": "responses"}
"""The endpoints a batch may name, and the gateway route (``wire.Kind``) each runs on."""

MAX_CUSTOM_ID = 512
"""Characters in a ``custom_id``: it is copied into every output line and the ledger's
logs; OpenAI gives no bound, a generous one keeps a file of ids from being the payload."""

MAX_PROBLEMS = 100
"""Problems reported for one file (the first ones, in line order): enough to fix a file
in a few rounds without making the batch object itself megabytes long."""

_IGNORED_BODY_FIELDS = ("stream", "stream_options")
"""Batch answers are stored whole, never streamed: these are dropped from a line's body."""


@dataclass(frozen=True)
class Line:
    """One request of a batch: its 1-based line number in the input file, the client's
    ``custom_id``, the model it names and the body to send (JSON, streaming fields
    dropped)."""

    number: int
    custom_id: str
    model: str
    body: bytes


@dataclass(frozen=True)
class Problem:
    """Why a file cannot be run, as one entry of OpenAI's ``errors.data`` list."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message, "param": self.param,
                "line": self.line}


def count_lines(content: bytes) -> int:
    """Non-blank lines of ``content`` (the upload's line limit; no JSON parsed)."""
    return sum(1 for raw in content.split(b"\n") if raw.strip())


def parse_lines(content: bytes, endpoint: str, max_lines: int) -> tuple[list[Line], list[Problem]]:
    """The lines of an input file for a batch on ``endpoint``, and its problems (the
    batch may run only when there are none). Blank lines are skipped; line numbers count
    every line of the file, as an editor shows them."""
    lines: list[Line] = []
    problems: list[Problem] = []
    seen: dict[str, int] = {}

    def problem(code: str, message: str, number: int | None, param: str | None = None) -> None:
        if len(problems) < MAX_PROBLEMS:
            problems.append(Problem(code, message, number, param))

    if endpoint not in ENDPOINTS:
        problem("invalid_value", f"endpoint {endpoint!r} is not one a batch may run; "
                f"expected one of {', '.join(ENDPOINTS)}", None, "endpoint")
        return [], problems
    count = 0
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        count += 1
        if count > max_lines:
            problem("too_many_requests", f"the file has more than {max_lines} requests "
                    "(batch.max_lines)", number)
            break
        try:
            item = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            problem("invalid_json_line", f"line {number} is not valid JSON: {exc}", number)
            continue
        if not isinstance(item, dict):
            problem("invalid_json_line", f"line {number} is not a JSON object", number)
            continue
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            problem("missing_required_parameter", f"line {number}: custom_id must be a "
                    "non-empty string", number, "custom_id")
            continue
        if len(custom_id) > MAX_CUSTOM_ID:
            problem("invalid_value", f"line {number}: custom_id is longer than "
                    f"{MAX_CUSTOM_ID} characters", number, "custom_id")
            continue
        if custom_id in seen:
            problem("duplicate_custom_id", f"line {number}: custom_id {custom_id!r} was "
                    f"already used on line {seen[custom_id]}", number, "custom_id")
            continue
        seen[custom_id] = number
        method = item.get("method")
        if method != "POST":
            problem("invalid_value", f"line {number}: method must be 'POST', got "
                    f"{method!r}", number, "method")
            continue
        url = item.get("url")
        if url != endpoint:
            problem("invalid_url", f"line {number}: url {url!r} differs from the batch's "
                    f"endpoint {endpoint!r}", number, "url")
            continue
        body = item.get("body")
        if not isinstance(body, dict):
            problem("invalid_value", f"line {number}: body must be a JSON object", number,
                    "body")
            continue
        model = body.get("model")
        if not isinstance(model, str) or not model:
            problem("missing_required_parameter", f"line {number}: body.model must be a "
                    "non-empty string", number, "body.model")
            continue
        for name in _IGNORED_BODY_FIELDS:
            body.pop(name, None)
        lines.append(Line(number, custom_id, model,
                          json.dumps(body, separators=(",", ":")).encode()))
    if not lines and not problems:
        problem("empty_file", "the input file has no requests", None)
    return lines, problems
