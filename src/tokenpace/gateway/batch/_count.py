"""Counting an input file's requests while it streams in, without holding its lines.

A request is a non-blank line (``bytes.strip`` leaves something), as ``parse_lines``
counts them. The counter sees the upload chunk by chunk, so an upload over
``batch.max_lines`` is refused as soon as its line passes the bound, and no list of
lines is ever built: per chunk, one ``bytes.translate`` and one ``bytes.count``, both in C
(linear in the chunk, no Python work per line).
"""

from __future__ import annotations

_BLANKS = b" \t\r\x0b\x0c"
"""The bytes ``bytes.strip`` removes, the newline aside (it separates lines)."""

_TO_MARK = bytes(0x0A if b == 0x0A else 0x61 for b in range(256))
"""Every byte that is not a newline becomes ``a`` (after the blanks are deleted): a
request starts wherever ``a`` follows a newline, or opens the file."""


class LineCounter:
    """The number of non-blank lines in the bytes fed so far (``count``).

    ``feed`` may split the content anywhere, even inside a line: the count of a file
    fed in any chunks equals ``count_lines`` of the whole. Memory: one translated copy
    of the chunk being fed, nothing kept between chunks but two integers."""

    __slots__ = ("count", "_at_start")

    def __init__(self) -> None:
        self.count = 0
        self._at_start = True  # the last byte kept was a newline, or none was yet

    def feed(self, chunk: bytes | bytearray | memoryview) -> int:
        """Count the lines that start in ``chunk``; returns the total so far."""
        marks = bytes(chunk).translate(_TO_MARK, _BLANKS)
        if not marks:
            return self.count
        self.count += marks.count(b"\na") + (self._at_start and marks[0] == 0x61)
        self._at_start = marks[-1] == 0x0A
        return self.count
