"""Files and batches as the gateway stores them, and as OpenAI's API shows them.

A batch's status follows OpenAI's machine; :data:`MOVES` is every step it may take and
:func:`check_move` the one guard, so that two replicas (or a cancel racing a finish)
cannot walk a batch backwards: the store applies a move only from the status it read.

    validating --> in_progress --> finalizing --> completed
        |              |   \\
        |              |    +--> expired       (the completion window ran out)
        +--> failed    +--> cancelling --> cancelled
        +--> cancelling (a batch cancelled before it started)

``failed`` is also where a batch that cannot progress ends, from any unfinished status
(the runner gave up after bounded tries, or its output is larger than the gateway keeps).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
"""Statuses with work left for a runner."""

FINISHED = ("failed", "completed", "expired", "cancelled")

MOVES: dict[str, tuple[str, ...]] = {
    "validating": ("in_progress", "failed", "cancelling", "expired"),
    "in_progress": ("finalizing", "cancelling", "expired", "failed"),
    "finalizing": ("completed", "failed"),
    "cancelling": ("cancelled", "failed"),
}

STAMPS = {"in_progress": "in_progress_at", "failed": "failed_at",
          "finalizing": "finalizing_at", "completed": "completed_at",
          "expired": "expired_at", "cancelling": "cancelling_at",
          "cancelled": "cancelled_at"}
"""The timestamp field each status sets when a batch enters it."""


class BadMove(ValueError):
    """A status change the machine does not allow (a finished batch is never changed)."""


class StoreLimit(Exception):
    """A bound on what a tenant keeps refused a write, checked in the write's own
    transaction: ``key`` names the configuration key (``batch.max_files``,
    ``batch.max_stored_bytes``, ``batch.max_batches``), ``limit`` its value and ``used``
    what the tenant already had."""

    def __init__(self, key: str, limit: int, used: int) -> None:
        super().__init__(f"{key} ({limit}) reached: {used} in use")
        self.key, self.limit, self.used = key, limit, used


def check_move(old: str, new: str) -> None:
    if new not in MOVES.get(old, ()):
        raise BadMove(f"a batch cannot go from {old!r} to {new!r}")


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: int

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "status_details": None,
                "expires_at": None}


@dataclass(frozen=True)
class Usage:
    """A batch's token use so far: the sums of its lines' usage as the engines reported."""

    requests_completed: int = 0
    requests_failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class BatchRecord:
    id: str
    tenant: str
    application: str  # "": the tenant's own key created it
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    total: int = 0
    metadata: dict[str, str] | None = None
    errors: list[dict[str, object]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    stamps: dict[str, int] = field(default_factory=dict)  # "in_progress_at" -> unix time
    model: str | None = None  # the lines' model when they all name one

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def to_json(self, usage: Usage) -> dict[str, object]:
        """The batch as OpenAI's ``Batch`` object; ``usage`` the lines' sums so far."""
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": None if not self.errors else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window, "status": self.status,
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "expires_at": self.expires_at,
            **{stamp: self.stamps.get(stamp) for stamp in STAMPS.values()},
            "request_counts": {"total": self.total, "completed": usage.requests_completed,
                               "failed": usage.requests_failed},
            "metadata": self.metadata, "model": self.model,
            "usage": {"input_tokens": usage.input_tokens,
                      "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                      "output_tokens": usage.output_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage.input_tokens + usage.output_tokens},
        }


@dataclass(frozen=True)
class LineResult:
    """How one line ended: the output (``ok``) or error file's line, and its usage."""

    number: int
    custom_id: str
    ok: bool
    text: str  # the output or error file's JSON line, without its newline
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


def result_line(request_id: str, custom_id: str, status: int | None,
                body: object | None, error: dict[str, str] | None) -> str:
    """One line of an output or error file in OpenAI's format: ``response`` is the
    engine's (or the gateway's) HTTP answer, None for a line that never ran; ``error``
    says why a line failed without an answer of its own (expired, cancelled)."""
    response = None if status is None else {"status_code": status, "request_id": request_id,
                                            "body": body}
    return json.dumps({"id": f"batch_req_{request_id.removeprefix('tpg-')}",
                       "custom_id": custom_id, "response": response, "error": error},
                      separators=(",", ":"))
