"""An input file of the Batch API read into its lines, or the reasons it cannot be run.

Pure: bytes in, lines and problems out; no I/O. A file is read in chunks
(:func:`raw_lines`), so reading it costs one chunk and one line of memory whatever its
size: at validation every line is checked (:class:`LineChecker`) and the batch either
starts with every line checked or fails in ``validating`` with OpenAI's ``errors`` list,
never half-way; while it runs its lines are read again a window at a time, from the byte
offset where the previous window ended.

What is checked here is the file's shape, the same for every tenant: one JSON object per
line with a unique ``custom_id``, ``method: POST``, the batch's ``url`` and an object
``body`` naming a ``model``; the ``custom_id`` and the model must be text every batch
store keeps (no NUL, no lone surrogate). What a line asks for (its model, its caps, its
budget) is decided when it runs, by the same admission as a live request: such a line
ends in the error file, the batch goes on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..wire import clip

ENDPOINTS: dict[str, str] = {"/v1/chat/completions": "chat",
                             "/v1/completions": "completion",
                             "/v1/responses": "responses",
                             "/v1/embeddings": "embeddings"}
"""The endpoints a batch may name (OpenAI's Batch API's, but ``/v1/moderations``), and
the gateway route (``wire.Kind``) each runs on."""

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


_Report = Callable[[str, str, int | None, str | None], None]
"""Where :func:`read_line` reports a problem: (code, message, line, param)."""


def count_lines(content: bytes) -> int:
    """Non-blank lines of ``content`` (the upload's line limit; no JSON parsed)."""
    return sum(1 for raw in content.split(b"\n") if raw.strip())


def storable(text: str) -> bool:
    """Whether ``text`` can be kept by every batch store: no NUL (Postgres' ``text``
    refuses it) and encodable as UTF-8 (no lone surrogate, which neither SQLite nor
    Postgres takes). O(len(text))."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def raw_lines(chunks: Iterable[bytes], number: int = 1,
              offset: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """``(line number, byte offset just past the line, line)`` of each non-blank line of
    the bytes ``chunks`` give one after another, the first of them being the file from
    byte ``offset``, whose line is number ``number`` (line numbers count every line, as
    an editor shows them). Memory: one chunk and the line being cut, never the file."""
    buffer = bytearray()
    base = offset  # the file offset of buffer[0]
    for chunk in chunks:
        buffer += chunk
        start = 0
        while True:
            end = buffer.find(b"\n", start)
            if end < 0:
                break
            raw = bytes(buffer[start:end])
            if raw.strip():
                yield number, base + end + 1, raw
            number += 1
            start = end + 1
        del buffer[:start]
        base += start
    if buffer.strip():
        yield number, base + len(buffer), bytes(buffer)


class LineChecker:
    """Checks the lines of one file one at a time, in order: :meth:`check` gives each
    valid line, and ``problems`` collects the others (the first ``MAX_PROBLEMS``).
    Memory: a 16-byte digest and a line number per ``custom_id`` seen (duplicates are
    found by digest), not the lines themselves."""

    def __init__(self, endpoint: str, max_lines: int) -> None:
        self.endpoint = endpoint
        self.max_lines = max_lines
        self.problems: list[Problem] = []
        self.count = 0  # non-blank lines seen
        self.valid = 0  # lines that passed
        self.full = False  # more than max_lines: stop reading
        self._seen: dict[bytes, int] = {}
        if endpoint not in ENDPOINTS:
            self.problem("invalid_value", f"endpoint {endpoint!r} is not one a batch may "
                         f"run; expected one of {', '.join(ENDPOINTS)}", None, "endpoint")
            self.full = True

    def problem(self, code: str, message: str, number: int | None,
                param: str | None = None) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(Problem(code, message, number, param))

    def check(self, number: int, raw: bytes) -> Line | None:
        """The line ``number`` (non-blank), or None when it has a problem (recorded)."""
        self.count += 1
        if self.count > self.max_lines:
            self.problem("too_many_requests", f"the file has more than {self.max_lines} "
                         "requests (batch.max_lines)", number)
            self.full = True
            return None
        line = read_line(number, raw, self.endpoint, self.problem)
        if line is None:
            return None
        digest = hashlib.blake2b(line.custom_id.encode(), digest_size=16).digest()
        first = self._seen.get(digest)
        if first is not None:
            self.problem("duplicate_custom_id", f"line {number}: custom_id "
                         f"{line.custom_id!r} was already used on line {first}", number,
                         "custom_id")
            return None
        self._seen[digest] = number
        self.valid += 1
        return line

    def finish(self) -> list[Problem]:
        """The file's problems once every line was checked (an empty file is one)."""
        if not self.valid and not self.problems:
            self.problem("empty_file", "the input file has no requests", None)
        return self.problems


def parse_lines(content: bytes, endpoint: str, max_lines: int) -> tuple[list[Line], list[Problem]]:
    """The lines of an input file for a batch on ``endpoint``, and its problems (the
    batch may run only when there are none). Blank lines are skipped; line numbers count
    every line of the file, as an editor shows them. Holds every line: for a whole file
    in memory; the runner reads files with :func:`raw_lines` and :class:`LineChecker`."""
    checker = LineChecker(endpoint, max_lines)
    lines: list[Line] = []
    if not checker.full:
        for number, _, raw in raw_lines((content,)):
            line = checker.check(number, raw)
            if line is not None:
                lines.append(line)
            if checker.full:
                break
    return lines, checker.finish()


def read_line(number: int, raw: bytes, endpoint: str, problem: _Report) -> Line | None:
    """One non-blank line as a :class:`Line`, or None after reporting its problem to
    ``problem(code, message, line, param)``. O(len(raw))."""
    try:
        item = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        problem("invalid_json_line", f"line {number} is not valid JSON: {exc}", number,
                None)
        return None
    if not isinstance(item, dict):
        problem("invalid_json_line", f"line {number} is not a JSON object", number, None)
        return None
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        problem("missing_required_parameter", f"line {number}: custom_id must be a "
                "non-empty string", number, "custom_id")
        return None
    if len(custom_id) > MAX_CUSTOM_ID:
        problem("invalid_value", f"line {number}: custom_id is longer than "
                f"{MAX_CUSTOM_ID} characters", number, "custom_id")
        return None
    if not storable(custom_id):
        problem("invalid_value", f"line {number}: custom_id holds a NUL character or a "
                "lone surrogate", number, "custom_id")
        return None
    method = item.get("method")
    if method != "POST":
        problem("invalid_value", f"line {number}: method must be 'POST', got "
                f"{clip(repr(method))}", number, "method")
        return None
    url = item.get("url")
    if url != endpoint:
        problem("invalid_url", f"line {number}: url {clip(repr(url))} differs from the "
                f"batch's endpoint {endpoint!r}", number, "url")
        return None
    body = item.get("body")
    if not isinstance(body, dict):
        problem("invalid_value", f"line {number}: body must be a JSON object", number,
                "body")
        return None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        problem("missing_required_parameter", f"line {number}: body.model must be a "
                "non-empty string", number, "body.model")
        return None
    if not storable(model):
        problem("invalid_value", f"line {number}: body.model holds a NUL character or a "
                "lone surrogate", number, "body.model")
        return None
    for name in _IGNORED_BODY_FIELDS:
        body.pop(name, None)
    return Line(number, custom_id, model, json.dumps(body, separators=(",", ":")).encode())
