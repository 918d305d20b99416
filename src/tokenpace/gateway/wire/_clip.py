"""Client strings made short enough to echo: in an error message, a log line, a ledger row.

A client controls the model name, parameter names, ids and every key of its body; echoing
one unbounded would let it size the gateway's answers and stored rows (a model name of
megabytes refused with a 404 that repeats it). ``clip`` keeps both ends of a long string,
which is what a person needs to recognise it.
"""

from __future__ import annotations

ECHO_CHARS = 200
"""The most characters of one client string an error message repeats (plus the marker)."""


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` if it has at most ``limit`` characters, else its first and last characters
    around a marker that says how many were left out. Cost: O(limit), whatever the
    length of ``text``."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}...[{len(text) - limit} characters]...{text[-tail:]}"
