"""The Batch API's HTTP surface (``/v1/files``, ``/v1/batches``) and the gateway side of
its runner (``batch.BatchHost``): each line runs through ``handle``, the same path as a
live request, as its batch's tenant.

Every route authenticates the key as the completion routes do and shows the tenant only
its own files and batches: another tenant's id answers 404, as an unknown one does. The
routes answer in OpenAI's shapes (objects, cursor pages, error bodies) so that the openai
SDK's ``files`` and ``batches`` clients work unchanged.

What a tenant can make the gateway hold is bounded before it is paid: an upload is read
within its bounds as it streams in (``_upload``), a batch's body is at most
``MAX_BATCH_BODY`` bytes, the files, bytes and unfinished batches a tenant keeps are
counted in the transaction that writes, and a file is sent part by part as the store
keeps it (one part in memory per download, the store's lock held for one part's read).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..admission import adapter_of, authorization_of, identify, read_body
from ..batch import (
    ENDPOINTS,
    BatchRecord,
    BatchRunner,
    BatchStore,
    Line,
    LineAnswer,
    StoreLimit,
    Usage,
    batch_store_url,
    new_id,
)
from ..exchange import Runtime
from ..ledger import LedgerError
from ..state import SlotClaim, StateUnavailable, StoreLease
from ..tenants import TenantState
from ..wire import GatewayError, clip, error_body, error_response
from ._proxy import BatchLine, handle
from ._upload import UploadGate, read_upload

logger = logging.getLogger("tokenpace.gateway")

COMPLETION_WINDOWS = ("24h",)
"""The windows a batch may ask for (OpenAI's one); ``batch.expire_after`` is how long the
gateway actually gives it (24 h unless configured)."""

MAX_METADATA = 16
MAX_BATCH_BODY = 64 * 1024
"""Bytes of a ``POST /v1/batches`` body, read no further: the largest valid body (16
metadata pairs of 64 + 512 characters, every one escaped) is well below it, so it needs
no configuration key."""

CLOSE_WAIT_S = 2.0
"""How long a shutdown waits, after ``batch.shutdown_wait``, for the lines still in flight
to end as cancelled before the runner is stopped outright (a line stopped so has a ledger
row ``error``)."""

STORE_RETRY_S = 5.0
"""How often a batch store that did not answer at start-up is opened again."""

_LOCAL_CLAIM = object()
"""The claim on a batch with one replica (no shared store): this process is its runner."""


def _error(status: int, message: str, code: str, param: str | None = None) -> Response:
    """``wire.error_response`` with the code always given (every refusal here names one),
    positionally: the routes' refusals stay one line each."""
    return error_response(status, message, code=code, param=param)


@dataclass(frozen=True)
class _Caller:
    tenant: TenantState
    application: str  # "": the tenant's own key
    store: BatchStore


_Handler = Callable[["BatchService", Request, _Caller], Awaitable[Response]]


def _route(handler: _Handler) -> Callable[["BatchService", Request], Awaitable[Response]]:
    """A route of the Batch API: the caller identified first, and a ``GatewayError``
    raised anywhere in the route answered in OpenAI's format."""
    @functools.wraps(handler)
    async def route(self: BatchService, request: Request) -> Response:
        try:
            return await handler(self, request, self.caller(request))
        except GatewayError as exc:
            return exc.response()

    return route


def _reading_route(handler: _Handler) -> Callable[["BatchService", Request], Awaitable[Response]]:
    """``_route`` for a route that reads a body and raises ``GatewayError`` only before
    it has read it whole: the refusal closes the connection (``connection: close``), so
    the server reads nothing more of it (it would otherwise read and drop the rest)."""
    @functools.wraps(handler)
    async def route(self: BatchService, request: Request) -> Response:
        try:
            return await handler(self, request, self.caller(request))
        except GatewayError as exc:
            exc.headers.setdefault("connection", "close")
            return exc.response()

    return route


class BatchService:
    """The store, the runner and the routes of the Batch API in one gateway process."""

    def __init__(self, rt_of: Callable[[], Runtime | None]) -> None:
        self._rt_of = rt_of
        self.store: BatchStore | None = None
        self.runner: BatchRunner | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._cut = asyncio.Event()  # set: lines still in flight see their client leave
        self.uploads = UploadGate()

    @property
    def rt(self) -> Runtime:
        rt = self._rt_of()
        assert rt is not None
        return rt

    # -- life --------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store and start the runner. A store whose database does not answer
        (Postgres down while the gateway starts) is opened again every
        ``STORE_RETRY_S`` in the background; the Batch API answers 503 until then. Any
        other failure (a bad URL, a file that cannot be created) stops the start."""
        config = self.rt.config
        url = config.batch.store or batch_store_url(config.ledger)
        try:
            store = await asyncio.to_thread(BatchStore, url)
        except LedgerError as exc:
            if not url.startswith(("postgresql://", "postgres://")):
                raise
            logger.error("the batch store does not answer (%s); the Batch API answers 503 "
                         "until it does", exc)
            self._task = asyncio.create_task(self._open_later(url))
            return
        self._run(store)

    def _run(self, store: BatchStore) -> None:
        config = self.rt.config
        self.store = store
        self.runner = BatchRunner(store, self, concurrency=config.batch.concurrency,
                                  max_lines=config.batch.max_lines,
                                  max_output_bytes=config.batch.max_output_bytes)
        self._task = asyncio.create_task(self.runner.run())

    async def _open_later(self, url: str) -> None:
        while not self._closing.is_set():
            await asyncio.sleep(STORE_RETRY_S)
            try:
                store = await asyncio.to_thread(BatchStore, url)
            except LedgerError:
                continue
            logger.warning("the batch store answers again; the Batch API is back")
            self._run(store)
            return

    async def close(self) -> None:
        """No line starts from now on; the lines in flight have ``batch.shutdown_wait`` to
        end and have their results stored (each charged what it generated, never run
        again). Those still running then end as if their client left (nothing is written
        for them: they run again when the batch resumes), then the runner stops and gives
        its claims back."""
        self._closing.set()
        runner = self.runner
        if runner is not None:
            runner.quiesce()
        if self._task is not None:
            deadline = time.monotonic() + self.rt.config.batch.shutdown_wait_s
            while runner is not None and runner.unsettled and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # lines end and their results are written
            self._cut.set()
            deadline = time.monotonic() + CLOSE_WAIT_S
            while runner is not None and runner.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # each line sees the disconnect and ends (499)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.store is not None:
            self.store.close()

    # -- BatchHost ---------------------------------------------------------------------

    async def run_line(self, batch: BatchRecord, line: Line,
                       on_slot: Callable[[], None]) -> LineAnswer | None:
        rt = self.rt
        state = rt.tenants.get(batch.tenant)
        application = None
        if state is not None and batch.application:
            application = state.applications.get(batch.application)
        if state is None or (batch.application and application is None):
            who = (f"tenant {batch.tenant!r}" if state is None
                   else f"application {batch.application!r} of tenant {batch.tenant!r}")
            return LineAnswer(403, json.dumps(error_body(
                403, f"{who} is no longer in the gateway's configuration",
                "tenant_removed")).encode(), "tpg-" + new_id(""))
        path = batch.endpoint
        sent = False
        cut = self._cut

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": line.body, "more_body": False}
            await cut.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(line.body)).encode())]}
        response = await handle(rt, ENDPOINTS[path], scope, receive,
                                principal=(state, application),
                                line=BatchLine(batch.id, on_slot))
        if response.status_code == 499:  # the gateway is stopping: no answer
            return None
        assert isinstance(response, Response)  # a line is never streamed
        retry = response.headers.get("retry-after")
        try:
            retry_s = float(retry) if retry is not None else None
        except ValueError:
            retry_s = None
        return LineAnswer(response.status_code, bytes(response.body),
                          response.headers.get("x-request-id") or "tpg-" + new_id(""),
                          retry_s)

    def room(self, model: str) -> int:
        rt = self.rt
        served = rt.config.served_name(model)
        adapter = adapter_of(rt, served)
        pool = rt.dispatcher.pool_for(served if adapter is None else adapter.base)
        if pool is None:
            return 1  # unknown model: the line fails at once with the route's 404
        return rt.dispatcher.spare(pool, rt.config.batch.headroom)

    def tenant_ok(self, tenant: str) -> bool:
        """A tenant's lines leave one of its ``max_concurrency`` slots to its live
        requests (all of it when the limit is 1)."""
        state = self.rt.tenants.get(tenant)
        if state is None:
            return True  # its lines fail at once (tenant_removed)
        limit = state.config.max_concurrency
        if limit is None:
            return True
        return state.inflight < max(1, limit - 1)

    def weight(self, tenant: str) -> float | None:
        state = self.rt.tenants.get(tenant)
        return None if state is None else state.config.weight

    async def claim(self, batch_id: str) -> object | None:
        store = self.rt.store
        if store is None:
            return _LOCAL_CLAIM
        try:
            got = await store.acquire([SlotClaim(f"batch:{batch_id}", 1)])
        except StateUnavailable:
            return None
        return got if isinstance(got, StoreLease) else None

    async def unclaim(self, claim: object) -> None:
        store = self.rt.store
        if store is not None and isinstance(claim, StoreLease):
            with contextlib.suppress(StateUnavailable):
                await store.release(claim)

    # -- routes ------------------------------------------------------------------------

    def caller(self, request: Request) -> _Caller:
        """Who asks (the key's tenant and application, or a 401) and the store."""
        tenant, application = identify(self.rt, authorization_of(request.headers))
        if self.store is None:
            raise GatewayError(503, "the gateway is starting", reason="starting",
                               code="starting")
        return _Caller(tenant, application.id if application is not None else "",
                       self.store)

    @_reading_route
    async def create_file(self, request: Request, caller: _Caller) -> Response:
        tenant, store = caller.tenant, caller.store
        limits = self.rt.config.batch
        with self.uploads.enter(tenant.id, limits) as held:  # O(1), before the store
            files, stored = await asyncio.to_thread(store.stored, tenant.id)
            _check_room(limits.max_files, files, limits.max_stored_bytes, stored)
            upload = await read_upload(request, limits, held)  # raises only before its end
            if upload.content is None:
                return _error(400, "missing the 'file' field (multipart/form-data)",
                              "missing_required_parameter", "file")
            purpose = upload.fields.get("purpose")
            if purpose != "batch":
                return _error(400, f"purpose {clip(repr(purpose))} is not served here: this "
                              "gateway keeps files for the Batch API only (purpose 'batch')",
                              "invalid_value", "purpose")
            try:
                record = await asyncio.to_thread(
                    store.add_file, tenant.id, "batch", upload.filename or "upload.jsonl",
                    upload.content, max_files=limits.max_files,
                    max_bytes=limits.max_stored_bytes)
            except StoreLimit as exc:
                return _limit_error(exc)
            except LedgerError as exc:  # its parts removed while written: nothing kept
                return GatewayError(503, f"the file was not kept ({exc})",
                                    reason="store_busy", headers={"retry-after": "1"}).response()
        return JSONResponse(record.to_json())

    @_route
    async def list_files(self, request: Request, caller: _Caller) -> Response:
        tenant, store = caller.tenant, caller.store
        limit, after = _page_args(request, 10_000)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            return _error(400, f"order must be 'asc' or 'desc', got {clip(repr(order))}",
                          "invalid_value", "order")
        files, more = await asyncio.to_thread(store.files, tenant.id,
                                              request.query_params.get("purpose"), limit,
                                              after, order == "asc")
        return JSONResponse(_page([f.to_json() for f in files], more))

    @_route
    async def get_file(self, request: Request, caller: _Caller) -> Response:
        tenant, store = caller.tenant, caller.store
        record = await asyncio.to_thread(store.file, tenant.id, request.path_params["file_id"])
        if record is None:
            return _no_file(request.path_params["file_id"])
        return JSONResponse(record.to_json())

    @_route
    async def file_content(self, request: Request, caller: _Caller) -> Response:
        tenant, store = caller.tenant, caller.store
        found = await asyncio.to_thread(store.file_parts, tenant.id,
                                        request.path_params["file_id"])
        if found is None:
            return _no_file(request.path_params["file_id"])
        record, parts = found

        async def body() -> Any:
            while (part := await asyncio.to_thread(next, parts, None)) is not None:
                yield part  # the next part is read once this one is sent

        return StreamingResponse(body(), media_type="application/jsonl",
                                 headers={"content-length": str(record.bytes)})

    @_route
    async def delete_file(self, request: Request, caller: _Caller) -> Response:
        tenant, store = caller.tenant, caller.store
        file_id = request.path_params["file_id"]
        if await asyncio.to_thread(store.file_in_use, tenant.id, file_id):
            return _error(400, f"file {clip(str(file_id))} is the input of a batch that has not "
                          "finished; cancel the batch first", "file_in_use", "file_id")
        if not await asyncio.to_thread(store.delete_file, tenant.id, file_id):
            return _no_file(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @_reading_route
    async def create_batch(self, request: Request, caller: _Caller) -> Response:
        tenant, store = caller.tenant, caller.store
        try:
            raw = await read_body(request.receive, request.headers.get("content-length"),
                                  MAX_BATCH_BODY)
        except ClientDisconnect:
            return _error(400, "the client left while sending its body",
                          "client_disconnected")
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the body is not valid JSON", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_json")
        file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        window, metadata = body.get("completion_window"), body.get("metadata")
        if not isinstance(file_id, str) or not file_id:
            return _error(400, "input_file_id is required", "missing_required_parameter",
                          "input_file_id")
        if endpoint not in ENDPOINTS:
            return _error(400, f"endpoint {clip(repr(endpoint))} is not one a batch may run here; "
                          f"expected one of {', '.join(ENDPOINTS)}", "invalid_value",
                          "endpoint")
        if window not in COMPLETION_WINDOWS:
            return _error(400, f"completion_window must be '24h', got {clip(repr(window))}",
                          "invalid_value", "completion_window")
        problem = _metadata_problem(metadata)
        if problem is not None:
            return _error(400, problem, "invalid_value", "metadata")
        record = await asyncio.to_thread(store.file, tenant.id, file_id)
        if record is None:
            return _no_file(file_id, "input_file_id")
        if record.purpose != "batch":
            return _error(400, f"file {clip(str(file_id))} has purpose {record.purpose!r}, "
                          "not 'batch'",
                          "invalid_value", "input_file_id")
        limits = self.rt.config.batch
        now = int(time.time())
        batch = BatchRecord(new_id("batch_"), tenant.id, caller.application, endpoint, file_id,
                            window, "validating", now,
                            now + max(1, round(limits.expire_after_s)),
                            metadata=metadata)
        try:
            await asyncio.to_thread(store.add_batch, batch, limits.max_batches,
                                    limits.max_stored_bytes)
        except StoreLimit as exc:
            return _limit_error(exc)
        if self.runner is not None:
            self.runner.wake()
        return JSONResponse(batch.to_json(Usage()))

    @_route
    async def get_batch(self, request: Request, caller: _Caller) -> Response:
        tenant, store = caller.tenant, caller.store
        batch = await asyncio.to_thread(store.batch, request.path_params["batch_id"],
                                        tenant.id)
        if batch is None:
            return _no_batch(request.path_params["batch_id"])
        return JSONResponse(await self._json(batch))

    @_route
    async def cancel_batch(self, request: Request, caller: _Caller) -> Response:
        tenant, store = caller.tenant, caller.store
        batch_id = request.path_params["batch_id"]
        batch = await asyncio.to_thread(store.batch, batch_id, tenant.id)
        for _ in range(3):  # the runner may move it between the read and the move
            if batch is None:
                return _no_batch(batch_id)
            if batch.status not in ("validating", "in_progress"):
                break
            moved = await asyncio.to_thread(store.move, batch.id, batch.status, "cancelling")
            if moved is not None:
                batch = moved
                if self.runner is not None:
                    self.runner.wake()
                break
            batch = await asyncio.to_thread(store.batch, batch_id, tenant.id)
        assert batch is not None
        if batch.status not in ("cancelling", "cancelled"):
            return _error(400, f"batch {batch_id} is {batch.status}: only a validating or "
                          "in-progress batch can be cancelled", "invalid_state")
        return JSONResponse(await self._json(batch))

    @_route
    async def list_batches(self, request: Request, caller: _Caller) -> Response:
        tenant, store = caller.tenant, caller.store
        limit, after = _page_args(request, 100)
        batches, more = await asyncio.to_thread(store.batches, tenant.id, limit, after)
        return JSONResponse(_page([await self._json(b) for b in batches], more))

    async def _json(self, batch: BatchRecord) -> dict[str, object]:
        assert self.store is not None
        return batch.to_json(await asyncio.to_thread(self.store.usage, batch.id))


def _page_args(request: Request, most: int) -> tuple[int, str | None]:
    raw = request.query_params.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise GatewayError(400, f"limit must be an integer from 1 to {most}, got "
                           f"{clip(raw)!r}",
                           reason="invalid_request", code="invalid_value", param="limit")
    return int(raw), request.query_params.get("after") or None


def _page(data: list[dict[str, object]], more: bool) -> dict[str, object]:
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _check_room(max_files: int, files: int, max_bytes: int, stored: int) -> None:
    """Refuse (``GatewayError``) an upload by a tenant already at one of its storage
    bounds, before a byte of it is read (the write checks again, in its transaction)."""
    if files >= max_files:
        raise _limit_refusal(StoreLimit("batch.max_files", max_files, files))
    if stored >= max_bytes:
        raise _limit_refusal(StoreLimit("batch.max_stored_bytes", max_bytes, stored))


def _limit_error(exc: StoreLimit) -> Response:
    """A write the tenant's storage bounds refused, in OpenAI's error format."""
    return _limit_refusal(exc).response()


def _limit_refusal(exc: StoreLimit) -> GatewayError:
    if exc.key == "batch.max_batches":
        return GatewayError(429, f"{exc.used} batches of this tenant have not finished "
                            f"(batch.max_batches: {exc.limit})", reason="too_many_batches")
    if exc.key == "batch.max_files":
        return GatewayError(400, f"this tenant already stores {exc.used} files "
                            f"(batch.max_files: {exc.limit}): delete some first",
                            reason="too_many_files")
    return GatewayError(400, f"this tenant stores {exc.used} bytes of files, outputs "
                        f"included (batch.max_stored_bytes: {exc.limit}): this would pass "
                        "it; delete some files first", reason="storage_full")


def _no_file(file_id: str, param: str = "file_id") -> Response:
    return _error(404, f"No such File object: {clip(str(file_id))}", "file_not_found", param)


def _no_batch(batch_id: str) -> Response:
    return _error(404, f"No such Batch object: {clip(str(batch_id))}", "batch_not_found",
                  "batch_id")


def _metadata_problem(metadata: Any) -> str | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        return "metadata must be an object of string values"
    if len(metadata) > MAX_METADATA:
        return f"metadata has more than {MAX_METADATA} keys"
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            return ("metadata keys are at most 64 characters and values strings of at most "
                    f"512 (key {key[:64]!r})")
    return None
