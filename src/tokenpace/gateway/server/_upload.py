"""A Batch API upload (``POST /v1/files``, multipart/form-data) read as it streams in,
within its bounds, and the gate that bounds the uploads read at once.

Every bound is checked on the stream, before the next chunk is read: the request's bytes
(``batch.max_file_bytes`` plus ``UPLOAD_SLACK`` of multipart framing), the file's bytes
(``batch.max_file_bytes``), its requests (``batch.max_lines``, counted by
``batch.LineCounter`` without a list of lines), the bytes all uploads of the process hold
together (``batch.upload_memory``), the parts and their headers. A refused upload stops
being read at once: the gateway answers and closes the connection, so what it read is
about the bound, whatever the client meant to send (with or without ``Content-Length``).

Cost per chunk of the request (what the server received since the last one: uvicorn stops
reading once 64 KiB wait, so a chunk is at most one socket read beyond that):
python-multipart's parser (C-speed searches for the boundary), one copy into the file's
buffer and one translated copy for the line counter. Memory: the file's bytes, charged to
``batch.upload_memory`` until the route returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header
from starlette.requests import ClientDisconnect, Request

from ..batch import LineCounter
from ..config import BatchConfig
from ..wire import GatewayError

UPLOAD_SLACK = 64 * 1024
"""Bytes of multipart framing (boundaries, part headers, the ``purpose`` field) allowed
beyond ``batch.max_file_bytes`` in a request."""

MAX_PARTS = 8
"""Parts in one upload (OpenAI's SDK sends two: ``file`` and ``purpose``)."""

MAX_HEADER_BYTES = 8 * 1024
"""Bytes of one part's headers."""

MAX_FIELD_BYTES = 1024
"""Bytes of a field that is not the file (``purpose``)."""

RETRY_AFTER_S = 1
"""The ``retry-after`` of a refusal because other uploads are being read."""


def _too_large(limits: BatchConfig) -> GatewayError:
    return GatewayError(413, f"file larger than {limits.max_file_bytes} bytes "
                        "(batch.max_file_bytes)", reason="file_too_large",
                        code="file_too_large", param="file")


def _invalid(message: str) -> GatewayError:
    return GatewayError(400, "expected a multipart/form-data upload with fields 'file' and "
                        f"'purpose': {message}", reason="invalid_upload", code="invalid_upload")


class UploadGate:
    """The uploads this process reads at once: at most ``batch.max_uploads`` in all and
    ``batch.max_tenant_uploads`` per tenant, holding at most ``batch.upload_memory`` bytes
    together. The limits are read from the configuration at each use (a reload applies to
    the next upload). Event-loop only (no lock): O(1) per call."""

    def __init__(self) -> None:
        self.reading = 0
        self.held = 0  # bytes the uploads being read hold
        self._per_tenant: dict[str, int] = {}

    @contextmanager
    def enter(self, tenant: str, limits: BatchConfig) -> Iterator[UploadPass]:
        """A pass for one upload of ``tenant``, or a refusal: 429 when the tenant already
        has ``max_tenant_uploads`` being read, 503 when the process has ``max_uploads``
        (both with ``retry-after``). What the pass took is given back on exit."""
        mine = self._per_tenant.get(tenant, 0)
        if mine >= limits.max_tenant_uploads:
            raise GatewayError(429, f"tenant {tenant!r} already has {mine} uploads being read "
                               "(batch.max_tenant_uploads): wait for them to end",
                               reason="too_many_uploads", code="too_many_uploads",
                               headers={"retry-after": str(RETRY_AFTER_S)})
        if self.reading >= limits.max_uploads:
            raise GatewayError(503, f"the gateway is reading {self.reading} uploads "
                               "(batch.max_uploads): try again shortly",
                               reason="uploads_busy", code="uploads_busy",
                               headers={"retry-after": str(RETRY_AFTER_S)})
        upload = UploadPass(self, limits.upload_memory)
        self.reading += 1
        self._per_tenant[tenant] = mine + 1
        try:
            yield upload
        finally:
            self.reading -= 1
            self.held -= upload.taken
            left = self._per_tenant[tenant] - 1
            if left:
                self._per_tenant[tenant] = left
            else:
                del self._per_tenant[tenant]


class UploadPass:
    """One upload's share of the gate's memory."""

    def __init__(self, gate: UploadGate, memory: int) -> None:
        self._gate, self._memory = gate, memory
        self.taken = 0

    def take(self, size: int) -> None:
        """Charge ``size`` more bytes, or refuse (503, ``retry-after``) when the uploads
        being read would hold more than ``batch.upload_memory`` together."""
        if self._gate.held + size > self._memory:
            raise GatewayError(503, f"the uploads being read hold {self._gate.held} bytes "
                               "(batch.upload_memory): try again shortly",
                               reason="uploads_busy", code="uploads_busy",
                               headers={"retry-after": str(RETRY_AFTER_S)})
        self._gate.held += size
        self.taken += size


@dataclass
class Upload:
    """What an upload brought: the file's name and bytes, its requests, the other fields."""

    filename: str | None = None
    content: bytearray | None = None  # None: no part named ``file`` with a filename
    lines: int = 0
    fields: dict[str, str] = field(default_factory=dict)


class _Reader:
    """python-multipart's callbacks, each bound checked as the bytes arrive."""

    def __init__(self, limits: BatchConfig, held: UploadPass) -> None:
        self.limits, self.held = limits, held
        self.upload = Upload()
        self.counter = LineCounter()
        self.parts = 0
        self._header = bytearray()  # the current part's headers, names and values
        self._name = b""
        self._disposition = b""
        self._field: bytearray | None = None  # the current part, when it is not the file
        self._in_file = False

    def callbacks(self) -> dict[str, object]:
        return {"on_part_begin": self.part_begin, "on_part_data": self.part_data,
                "on_part_end": self.part_end, "on_header_field": self.header_field,
                "on_header_value": self.header_value, "on_header_end": self.header_end,
                "on_headers_finished": self.headers_finished}

    def part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise _invalid(f"more than {MAX_PARTS} parts")
        self._header.clear()
        self._name = b""
        self._disposition = b""
        self._field, self._in_file = None, False

    def _header_bytes(self, data: bytes, start: int, end: int) -> bytes:
        if len(self._header) + end - start > MAX_HEADER_BYTES:
            raise _invalid(f"a part's headers are longer than {MAX_HEADER_BYTES} bytes")
        chunk = data[start:end]
        self._header += chunk
        return chunk

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self._name += self._header_bytes(data, start, end)

    def header_value(self, data: bytes, start: int, end: int) -> None:
        value = self._header_bytes(data, start, end)
        if self._name.lower() == b"content-disposition":
            self._disposition += value

    def header_end(self) -> None:
        self._name = b""

    def headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name")
        if name is None:
            raise _invalid("a part has no name in its Content-Disposition")
        if name == b"file" and b"filename" in options:
            if self.upload.content is not None:
                raise _invalid("more than one file")
            self.upload.content = bytearray()
            self.upload.filename = options[b"filename"].decode("utf-8", "replace")
            self._in_file = True
        else:
            self._field = bytearray()

    def part_data(self, data: bytes, start: int, end: int) -> None:
        size = end - start
        if not self._in_file:
            assert self._field is not None
            if len(self._field) + size > MAX_FIELD_BYTES:
                raise _invalid(f"a field other than 'file' is longer than {MAX_FIELD_BYTES} "
                               "bytes")
            self._field += data[start:end]
            return
        content = self.upload.content
        assert content is not None
        if len(content) + size > self.limits.max_file_bytes:
            raise _too_large(self.limits)
        self.held.take(size)
        chunk = data[start:end]
        content += chunk
        if self.counter.feed(chunk) > self.limits.max_lines:
            raise GatewayError(400, f"the file has more than {self.limits.max_lines} requests "
                               "(batch.max_lines)", reason="too_many_requests",
                               code="too_many_requests", param="file")

    def part_end(self) -> None:
        if self._field is not None:
            options = parse_options_header(self._disposition)[1]
            name = options[b"name"].decode("utf-8", "replace")
            self.upload.fields.setdefault(name, self._field.decode("utf-8", "replace"))
            self._field = None
        self._in_file = False


async def read_upload(request: Request, limits: BatchConfig, held: UploadPass) -> Upload:
    """The upload of ``request``, read chunk by chunk; raises ``GatewayError`` (400, 413,
    503) as soon as a bound is passed, before the next chunk is read (the route's answer
    then ends the connection: the rest is never read). A body that is not
    multipart/form-data is refused unread."""
    most = limits.max_file_bytes + UPLOAD_SLACK
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > most:
        raise _too_large(limits)
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data":
        raise GatewayError(400, "missing the 'file' field (multipart/form-data)",
                           reason="missing_required_parameter", param="file")
    if not boundary:
        raise _invalid("the Content-Type has no boundary")
    reader = _Reader(limits, held)
    parser = MultipartParser(boundary, reader.callbacks())  # type: ignore[arg-type]
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > most:
                raise _too_large(limits)
            parser.write(chunk)
        parser.finalize()
        if parser.state != MultipartState.END:
            raise _invalid("the upload ends before its closing boundary")
    except FormParserError as exc:
        raise _invalid(str(exc)) from None
    except ClientDisconnect:
        raise GatewayError(400, "the client left while sending its upload",
                           reason="client_disconnected", code="client_disconnected") from None
    reader.upload.lines = reader.counter.count
    return reader.upload
