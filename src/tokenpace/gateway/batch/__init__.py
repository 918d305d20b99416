"""The Batch API's files, batches and their runner: offline work in the gateway's idle
capacity (docs/gateway/batch.md).

``_lines`` reads an input file (pure), ``_objects`` holds the records and the status
machine, ``_store`` keeps them durably beside the ledger, ``_feed`` decides which line
starts next and when (pure, weighted VTC between tenants), ``_runner`` drives each batch
and its lines. The HTTP routes and the gateway side of the runner (``BatchHost``) are in
``server``: a line runs through the same request path as a live one.
"""

from ._count import LineCounter
from ._feed import BatchFeed, Ticket
from ._lines import ENDPOINTS, Line, Problem, count_lines, parse_lines
from ._objects import (
    FINISHED,
    MOVES,
    UNFINISHED,
    BadMove,
    BatchRecord,
    FileRecord,
    LineResult,
    StoreLimit,
    Usage,
    check_move,
    result_line,
)
from ._runner import BatchHost, BatchRunner, LineAnswer
from ._store import BatchStore, batch_store_url, new_id

__all__ = [
    "ENDPOINTS",
    "FINISHED",
    "MOVES",
    "UNFINISHED",
    "BadMove",
    "BatchFeed",
    "BatchHost",
    "BatchRecord",
    "BatchRunner",
    "BatchStore",
    "FileRecord",
    "Line",
    "LineAnswer",
    "LineCounter",
    "LineResult",
    "Problem",
    "StoreLimit",
    "Ticket",
    "Usage",
    "batch_store_url",
    "check_move",
    "count_lines",
    "new_id",
    "parse_lines",
    "result_line",
]
