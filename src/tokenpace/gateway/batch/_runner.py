"""Runs the batches: claims each one, feeds its lines into idle capacity, writes results.

One :class:`BatchRunner` per gateway process. Every ``SCAN_S`` it reads the unfinished
batches from the store and claims those nobody runs (``BatchHost.claim``: a lease in the
shared state store with several replicas, so one replica runs each batch and another takes
it over within the lease time when its holder dies; in process with one). A claimed batch
is driven through its statuses (``_objects``); its lines wait in the :class:`BatchFeed`,
whose pump starts them into capacity the live traffic leaves free (``BatchHost.room``).

A line runs as a request of its batch's tenant through the gateway's whole path
(``BatchHost.run_line``: admission, budgets, the fair queue, the engine, the ledger). How
it ended decides where it goes:

- 2xx: the output file; any other answer the gateway or the engine gave: the error file
  with that answer (``response.status_code`` and ``body``), so that a line that fails
  (unknown model, over a cap, an engine error after the gateway's own re-dispatches)
  never fails the batch;
- 429 (a budget, a request limit, the queue): run again after its ``retry-after``, the
  tenant's other lines held back meanwhile, until the batch expires; 500/502/503: run
  again up to ``ATTEMPTS`` times, then the error file;
- no answer (the gateway is shutting down and the line outlived the shutdown's wait):
  nothing is written, the line runs again wherever the batch resumes.

Never charged twice for a store that fails: a result whose write fails (a database
outage, a full disk) stays in memory with its batch and only its write is tried again,
with back-off (``RETRY_MIN_S`` doubling to ``RETRY_MAX_S``); the line is not sent again,
and the batch starts no new line until every result it holds is written (so what waits
in memory is at most the lines that were in flight). A process that stops before the
write succeeds loses those results, and those lines run again wherever the batch
resumes, as lines in flight at a crash do.

Batches that cannot progress end: driving a batch (validating, running, finalizing) that
raises is tried again after a back-off (``RETRY_MIN_S`` doubling to ``RETRY_MAX_S``), not
on every scan; a failure while the store answers a trivial read counts against the batch,
one while the store does not answer (an outage) does not, and after ``BATCH_ATTEMPTS``
counted failures in a row the batch ends ``failed`` with the reason in OpenAI's
``errors`` object (code ``batch_failed``). An output or error file larger than
``max_output_bytes`` ends the batch ``failed`` at once (code ``output_too_large``),
before anything is built.

Memory: a batch's input is never held whole. Validation streams the file (one stored
part and one line at a time, a digest per ``custom_id``); a running batch reads its
lines a window at a time (``WINDOW_BYTES`` of bodies, at least one line) from where the
last window ended, so a batch holds one part, one window and its lines in flight,
whatever the file's size (per tenant: ``batch.max_batches`` times that). Its output and
error files are written by the store from the stored results, a page at a time.

Expiry: a batch not finished by its ``expires_at`` stops starting lines, lets those in
flight end, and ends ``expired`` with its results so far; the lines that never ran go to
the error file with code ``batch_expired``, as OpenAI's do. Cancelling stops starting
lines and ends ``cancelled`` once those in flight ended; lines that never ran are not
written (OpenAI's behaviour).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from .. import metrics
from ..wire import answer_cached, answer_usage, error_body
from ._feed import BatchFeed
from ._lines import ENDPOINTS, Line, LineChecker, raw_lines, read_line
from ._objects import UNFINISHED, BatchRecord, LineResult, result_line
from ._store import BatchStore

logger = logging.getLogger("tokenpace.gateway.batch")

SCAN_S = 1.0
"""How often the store is read for new, cancelled and expired batches: a new batch starts
within this (creating one wakes the local runner at once), a cancel is seen within it."""

PUMP_S = 0.02
"""How often waiting lines look for free capacity when none was freed by a line of their
own (live requests ending free slots too, and the runner is not told of those)."""

ATTEMPTS = 3
"""Runs of a line that the gateway or the engine failed (500, 502, 503) before its error
is written: the gateway already re-dispatches a request an engine did not take, so a
third failure is the line's own."""

RETRY_MIN_S, RETRY_MAX_S = 0.5, 60.0

BATCH_ATTEMPTS = 5
"""Failures in a row of driving one batch, while the store answers, before it ends
``failed``: with the back-off, about half a minute of tries."""

WINDOW_BYTES = 1024 * 1024
"""Bytes of line bodies a running batch reads from its input at a time (at least one
line): with the store's part, what a batch holds of its input."""

WINDOW_LINES = 1024
"""Lines read at most at a time (a file of tiny lines stays a small window too)."""

_Input = Iterator[tuple[int, int, bytes]]


@dataclass(frozen=True)
class LineAnswer:
    """The gateway's answer to one line: as a client would have received it."""

    status: int
    body: bytes
    request_id: str
    retry_after_s: float | None = None


class BatchHost(Protocol):
    """What the runner needs of the gateway it runs in (``server`` provides it)."""

    async def run_line(self, batch: BatchRecord, line: Line,
                       on_slot: Callable[[], None]) -> LineAnswer | None:
        """Run ``line`` as a request of ``batch``'s tenant; ``on_slot`` is called once it
        holds an engine slot. None: no answer (the gateway is stopping)."""

    def room(self, model: str) -> int:
        """Slots of ``model``'s pool a batch line may take now (0 while live requests
        wait or only the headroom is left)."""

    def tenant_ok(self, tenant: str) -> bool:
        """Whether a line of ``tenant`` may start (its concurrency leaves room)."""

    def weight(self, tenant: str) -> float | None:
        """The tenant's weight; None when it left the configuration."""

    async def claim(self, batch_id: str) -> object | None:
        """This process's right to run the batch (renewed while held), or None."""

    async def unclaim(self, claim: object) -> None: ...


@dataclass(eq=False)
class _Job:
    batch: BatchRecord
    claim: object
    pending: deque[Line] = field(default_factory=deque)
    attempts: dict[int, int] = field(default_factory=dict)  # line number -> runs that failed
    inflight: int = 0
    # "cancelling", "expired", "suspended" (a line got no answer) or "failed" (driving
    # the batch raised): start no more lines
    stop: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # The input's lines not read yet: None before the first read and after a read failed
    # (opened again, lines before ``next_number`` skipped); ``eof`` once all were read.
    reader: _Input | None = None
    next_number: int = 1
    eof: bool = False
    done: set[int] = field(default_factory=set)  # lines with a stored result at the start
    # Results whose write failed, by line number: written again with back-off, never run.
    unstored: dict[int, LineResult] = field(default_factory=dict)
    store_wait_s: float = 0.0  # the back-off before the next write of ``unstored``


class BatchRunner:
    def __init__(self, store: BatchStore, host: BatchHost, *, concurrency: int,
                 max_lines: int, max_output_bytes: int = 1 << 30,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.host = host
        self.concurrency = concurrency
        self.max_lines = max_lines
        self.max_output_bytes = max_output_bytes
        self._wall = wall
        self._clock = clock
        # Batch id -> (failures counted in a row, clock time before which it is not
        # claimed again): the back-off of batches whose driving raised.
        self._failures: dict[str, tuple[int, float]] = {}
        self.feed = BatchFeed(clock)
        self._jobs: dict[str, _Job] = {}
        self._inflight = 0
        self._scan_now = asyncio.Event()
        self._pump_now = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._quiescing = False

    # -- the two loops -----------------------------------------------------------------

    async def run(self) -> None:
        """Scan and pump until cancelled (the gateway's shutdown)."""
        pump = asyncio.create_task(self._pump())
        try:
            failing = False
            while True:
                try:
                    await self._scan()
                    if failing:
                        logger.warning("batch scans work again")
                    failing = False
                except Exception:  # the store does not answer: the next scan tries again
                    if not failing:  # logged once per outage, not once a second
                        logger.exception("batch scan failed; tried again every %g s",
                                         SCAN_S)
                    failing = True
                self._scan_now.clear()
                try:
                    async with asyncio.timeout(SCAN_S):
                        await self._scan_now.wait()
                except TimeoutError:
                    pass
        finally:
            pump.cancel()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(pump, *self._tasks, return_exceptions=True)
            for job in self._jobs.values():
                await self.host.unclaim(job.claim)

    @property
    def inflight(self) -> int:
        """Lines started and not yet ended, all batches of this process."""
        return self._inflight

    @property
    def unsettled(self) -> int:
        """Lines started whose result is not stored yet (in flight, being written, or
        held after a failed write), all batches of this process: a shutdown that waits
        for this to reach 0 loses no result."""
        return sum(job.inflight + len(job.unstored) for job in self._jobs.values())

    def quiesce(self) -> None:
        """Start no line and claim no batch from now on (the gateway is stopping): lines
        in flight end, and their batches wait for the next start."""
        self._quiescing = True

    def wake(self) -> None:
        """A batch was created or cancelled on this process: scan now."""
        self._scan_now.set()

    async def _scan(self) -> None:
        now = self._wall()
        unfinished = await asyncio.to_thread(self.store.unfinished)
        for batch_id in set(self._failures) - {b.id for b in unfinished}:
            del self._failures[batch_id]  # finished elsewhere (another replica, a cancel)
        for batch in unfinished:
            job = self._jobs.get(batch.id)
            if job is not None:
                if batch.status == "cancelling" and job.stop is None:
                    self._stop(job, "cancelling")
                if now >= batch.expires_at and job.stop is None:
                    self._stop(job, "expired")
                continue
            if self._quiescing:
                continue
            failed = self._failures.get(batch.id)
            if failed is not None and self._clock() < failed[1]:
                continue  # backing off after a failure
            claim = await self.host.claim(batch.id)
            if claim is None:
                continue
            job = self._jobs[batch.id] = _Job(batch, claim)
            self._spawn(self._drive(job))

    def _stop(self, job: _Job, why: str) -> None:
        job.stop = why
        self.feed.forget(job.batch.id)
        job.changed.set()

    async def _pump(self) -> None:
        while True:
            while self._inflight < self.concurrency and not self._quiescing:
                ticket = self.feed.next(self.host.room, self.host.tenant_ok)
                if ticket is None:
                    break
                job = self._jobs.get(ticket.batch_id)
                if job is None or job.stop is not None or not job.pending or job.unstored:
                    self.feed.started(ticket.model)
                    continue
                if job.pending[0].model != ticket.model:
                    # A line of another model came back to the front (a retry) since the
                    # ticket was offered: offer that one, under its own model's room.
                    self.feed.started(ticket.model)
                    self._offer(job)
                    continue
                line = job.pending.popleft()
                if job.pending:
                    self._offer(job)  # its next line waits its turn at once
                if len(job.pending) < WINDOW_LINES // 2 and not job.eof:
                    job.changed.set()  # its driver reads the next window
                job.inflight += 1
                self._inflight += 1
                self._spawn(self._run_line(job, line, ticket.model))
            self._pump_now.clear()
            # Lines waiting for room poll for it (live requests ending free slots without
            # telling the runner); with none waiting the pump sleeps until one is offered.
            try:
                async with asyncio.timeout(PUMP_S if self.feed.waiting() else None):
                    await self._pump_now.wait()
            except TimeoutError:
                pass

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- one batch ---------------------------------------------------------------------

    async def _drive(self, job: _Job) -> None:
        batch = job.batch
        try:
            if batch.status == "validating":
                batch = await self._validate(job)
            if batch is not None and batch.status == "in_progress":
                batch = await self._run(job)
            if batch is not None and batch.status in ("finalizing", "cancelling"):
                await self._finalize(job, batch, "completed" if batch.status == "finalizing"
                                     else "cancelled")
            self._failures.pop(job.batch.id, None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._settle_job(job)
            await self._failed(job, exc)
        finally:
            self.feed.forget(job.batch.id)
            self._jobs.pop(job.batch.id, None)
            job.reader = None  # its part of the input, released now
            await self.host.unclaim(job.claim)

    async def _settle_job(self, job: _Job) -> None:
        """Before a batch whose driving raised is let go: no new line, the lines in
        flight end (each bounded by the request's own timeout), and one more try to
        write the results held; any still held are lost, and their lines run again
        where the batch resumes."""
        if job.stop is None:
            self._stop(job, "failed")
        while job.inflight:
            job.changed.clear()
            await job.changed.wait()
        if job.unstored:
            await self._store_held(job)
        if job.unstored:
            logger.error("batch %s: %d result(s) could not be stored; their lines run "
                         "again when the batch resumes", job.batch.id, len(job.unstored))

    async def _failed(self, job: _Job, exc: Exception) -> None:
        """Driving ``job`` raised ``exc``: back off before the batch is claimed again, and
        count the failure against the batch when the store answers (not an outage);
        the ``BATCH_ATTEMPTS``-th ends it ``failed``."""
        batch_id = job.batch.id
        count, _ = self._failures.get(batch_id, (0, 0.0))
        try:
            await asyncio.to_thread(self.store.ping)
            count += 1
            outage = False
        except Exception:
            outage = True
        logger.error("batch %s: runner failed (%s%s); tried again later", batch_id,
                     "the store does not answer; " if outage else
                     f"failure {count} of {BATCH_ATTEMPTS}; ", exc,
                     exc_info=not outage)
        wait = min(RETRY_MAX_S, RETRY_MIN_S * 2 ** max(0, count - 1))
        self._failures[batch_id] = (count, self._clock() + wait)
        if count >= BATCH_ATTEMPTS:
            ended = await self._fail(batch_id, "batch_failed", f"the gateway could not run "
                                     f"this batch ({count} tries failed: "
                                     f"{type(exc).__name__}); its lines' results so far are "
                                     "lost with it")
            if ended:
                self._failures.pop(batch_id, None)

    async def _fail(self, batch_id: str, code: str, message: str) -> bool:
        """End the batch ``failed`` with one error (OpenAI's ``errors.data``); False when
        the store did not take it (it is tried again on the batch's next failure)."""
        try:
            current = await asyncio.to_thread(self.store.batch, batch_id)
            if current is None or current.status not in UNFINISHED:
                return True
            moved = await asyncio.to_thread(
                self.store.move, batch_id, current.status, "failed",
                errors=[{"code": code, "message": message, "param": None, "line": None}])
        except Exception:
            logger.exception("batch %s: could not be marked failed", batch_id)
            return False
        if moved is not None:
            logger.error("batch %s failed: %s", batch_id, message)
        return moved is not None

    def _input(self, batch: BatchRecord) -> _Input | None:
        """The input file's non-blank lines, read part by part (blocking: in a worker
        thread); None when the file is gone."""
        found = self.store.file_parts(batch.tenant, batch.input_file_id)
        return None if found is None else raw_lines(found[1])

    def _check(self, batch: BatchRecord) -> tuple[int, set[str], list[dict[str, Any]]] | None:
        """The input file read once, every line checked (blocking): its valid lines, the
        models they name (two at most: one, or "several"), and its problems; None when the
        file is gone. Memory: one part, one line, a digest per ``custom_id``."""
        reader = self._input(batch)
        if reader is None:
            return None
        checker = LineChecker(batch.endpoint, self.max_lines)
        models: set[str] = set()
        if not checker.full:
            for number, _, raw in reader:
                line = checker.check(number, raw)
                if line is not None and len(models) < 2:
                    models.add(line.model)
                if checker.full:
                    break
        return checker.valid, models, [p.to_json() for p in checker.finish()]

    async def _validate(self, job: _Job) -> BatchRecord | None:
        batch = job.batch
        checked = await asyncio.to_thread(self._check, batch)
        if checked is None:
            problems = [{"code": "file_not_found", "message": f"input file "
                         f"{batch.input_file_id} no longer exists", "param": "input_file_id",
                         "line": None}]
            total, models = 0, set()
        else:
            total, models, problems = checked
        if self._wall() >= batch.expires_at:  # every line written as batch_expired
            return await self._finalize(job, batch, "expired", expire=not problems)
        if problems:
            moved = await asyncio.to_thread(self.store.move, batch.id, "validating", "failed",
                                            errors=problems)
            return moved
        moved = await asyncio.to_thread(self.store.move, batch.id, "validating",
                                        "in_progress", total=total,
                                        model=models.pop() if len(models) == 1 else None)
        if moved is None:  # cancelled meanwhile
            return await asyncio.to_thread(self.store.batch, batch.id)
        job.batch = moved
        return moved

    def _window(self, job: _Job) -> list[Line]:
        """The next lines of the input without a stored result (blocking): up to
        ``WINDOW_LINES`` lines or ``WINDOW_BYTES`` of bodies, at least one line while any
        is left; ``job.eof`` once the file is read. A read that raises (the store does
        not answer) leaves the job to open the file again on its next call, where it
        stopped."""
        lines: list[Line] = []
        size = 0
        if job.eof:
            return lines
        batch = job.batch
        if job.reader is None:
            job.reader = self._input(batch)
            if job.reader is None:
                logger.error("batch %s: its input file %s no longer exists", batch.id,
                             batch.input_file_id)
                job.eof = True
                return lines
        reader = job.reader

        def problem(code: str, message: str, number: int | None, param: str | None) -> None:
            logger.error("batch %s: line %s of its input no longer reads (%s)", batch.id,
                         number, message)

        try:
            for number, _, raw in reader:
                if number < job.next_number:
                    continue  # read before a failed read (the file opened again)
                job.next_number = number + 1
                if number in job.done:
                    continue
                line = read_line(number, raw, batch.endpoint, problem)
                if line is None:
                    continue
                lines.append(line)
                size += len(line.body)
                if len(lines) >= WINDOW_LINES or size >= WINDOW_BYTES:
                    return lines
        except BaseException:
            job.reader = None  # a generator that raised is over: open the file again
            job.pending.extend(lines)  # the lines read before the failure, not lost
            raise
        job.reader, job.eof = None, True
        return lines

    async def _run(self, job: _Job) -> BatchRecord | None:
        batch = job.batch
        job.done = await asyncio.to_thread(self.store.done_lines, batch.id)
        logger.info("batch %s of tenant %s: %d of %d lines to run", batch.id, batch.tenant,
                    max(0, batch.total - len(job.done)), batch.total)
        while True:
            if job.unstored:
                await self._store_held(job)
            if job.stop is None and self._wall() >= batch.expires_at:
                self._stop(job, "expired")
            if job.stop is None and not job.eof and not job.unstored \
                    and len(job.pending) < WINDOW_LINES // 2:
                await self._read(job)
            if job.stop is None and job.pending and not job.unstored:
                self._offer(job)
            if job.inflight == 0 and not job.unstored and (
                    job.stop is not None or (not job.pending and job.eof)):
                break
            job.changed.clear()
            wait = max(0.05, min(SCAN_S, batch.expires_at - self._wall()))
            if job.unstored:
                wait = job.store_wait_s
            try:
                async with asyncio.timeout(wait):
                    await job.changed.wait()
            except TimeoutError:
                pass
        if job.stop == "expired":
            return await self._finalize(job, batch, "expired", expire=True)
        if job.stop == "cancelling":
            current = await asyncio.to_thread(self.store.batch, batch.id)
            return current
        if job.stop == "suspended":  # no answer for a line: the batch resumes later
            return None
        moved = await asyncio.to_thread(self.store.move, batch.id, "in_progress", "finalizing")
        return moved if moved is not None else await asyncio.to_thread(self.store.batch,
                                                                       batch.id)

    async def _read(self, job: _Job) -> None:
        """The next window into ``job.pending``. A read that fails while the store does
        not answer (an outage) is tried again on the driver's next turn, the batch kept
        with its lines in flight and its results held; any other failure raises (the
        batch's own: counted by ``_failed``)."""
        try:
            job.pending.extend(await asyncio.to_thread(self._window, job))
        except Exception as exc:
            try:
                await asyncio.to_thread(self.store.ping)
            except Exception:
                logger.warning("batch %s: its input cannot be read now (%s); tried again",
                               job.batch.id, exc)
                return
            raise

    def _offer(self, job: _Job) -> None:
        line = job.pending[0]
        weight = self.host.weight(job.batch.tenant)
        if weight is None:  # the tenant left the configuration: its lines run and fail
            weight = 1.0
        self.feed.set_weight(job.batch.tenant, weight)
        # Estimated prompt cost: ~4 bytes per token of the body (charged at start, in
        # the feed only; budgets and the fair queue count the exact prompt).
        self.feed.wait(job.batch.id, job.batch.tenant, line.model, len(line.body) / 4)
        self._pump_now.set()

    def _expired_lines(self, job: _Job, written: set[int]) -> tuple[bytes, int]:
        """The error lines (``batch_expired``) of every line that never ran: those
        waiting, then the rest of the input (blocking); and how many."""
        batch = job.batch
        out: list[str] = []
        pending = list(job.pending)
        job.pending.clear()
        while True:
            for line in pending:
                if line.number not in written:
                    written.add(line.number)
                    out.append(result_line("tpg-" + _unrun_id(batch.id, line.number),
                                           line.custom_id, None, None, {
                                               "code": "batch_expired",
                                               "message": "This line could not be run "
                                                          "before the batch's completion "
                                                          "window ended."}) + "\n")
            if job.eof:
                return "".join(out).encode(), len(out)
            pending = self._window(job)

    async def _finalize(self, job: _Job, batch: BatchRecord, end: str,
                        expire: bool = False) -> BatchRecord | None:
        """Write the output and error files from the stored results and end the batch
        (``expire``: the lines that never ran, waiting or not read yet, are written as
        ``batch_expired`` errors). Files over ``max_output_bytes`` end it ``failed``."""
        expired, unrun = b"", 0
        if expire:
            written = await asyncio.to_thread(self.store.done_lines, batch.id)
            expired, unrun = await asyncio.to_thread(self._expired_lines, job, written)
        ok_bytes, error_bytes = await asyncio.to_thread(self.store.result_bytes, batch.id)
        largest = max(ok_bytes, error_bytes + len(expired))
        if largest > self.max_output_bytes:
            await self._fail(batch.id, "output_too_large", f"the batch's output would be "
                             f"{largest} bytes, more than this gateway keeps in one file "
                             f"({self.max_output_bytes}, batch.max_output_bytes)")
            return None
        ended = await asyncio.to_thread(self.store.finish_from_results, batch, end, expired)
        if ended is not None:
            if unrun:
                metrics.child(metrics.BATCH_LINES, batch.tenant, "expired").inc(unrun)
            counts = await asyncio.to_thread(self.store.usage, batch.id)
            logger.info("batch %s of tenant %s %s: %d lines ok, %d failed", batch.id,
                        batch.tenant, end, counts.requests_completed, counts.requests_failed)
        return ended

    # -- one line ----------------------------------------------------------------------

    async def _run_line(self, job: _Job, line: Line, model: str) -> None:
        """Run one line and keep its result. The batch counts the line in flight until its
        result is stored, held for a later write, or the line went back to the batch's
        lines: the batch finalizes from the stored results once nothing is in flight or
        held, so a result still being written must count."""
        slot = False

        def on_slot() -> None:
            nonlocal slot
            if not slot:
                slot = True
                self.feed.started(model)

        try:
            answer: LineAnswer | None = None
            try:
                answer = await self.host.run_line(job.batch, line, on_slot)
            except Exception:
                logger.exception("batch %s line %d failed in the gateway", job.batch.id,
                                 line.number)
                answer = LineAnswer(500, json.dumps(error_body(
                    500, "internal error in the gateway", "internal_error")).encode(),
                    "tpg-" + _unrun_id(job.batch.id, line.number))
            finally:
                on_slot()
                self._inflight -= 1  # the process's bound: another line may start now
                self._pump_now.set()
            if answer is None:
                self._suspend(job, line)
            else:
                await self._settle_line(job, line, model, answer)
        finally:
            job.inflight -= 1
            job.changed.set()

    def _suspend(self, job: _Job, line: Line) -> None:
        """A line ended without a result to keep (the gateway is stopping, or the store
        failed): it goes back to the batch's lines, and the batch stops here without
        finishing; the next scan (of this process or another) resumes it."""
        job.pending.appendleft(line)
        if job.stop is None:
            self._stop(job, "suspended")

    async def _settle_line(self, job: _Job, line: Line, model: str,
                           answer: LineAnswer) -> None:
        """Keep the line's result, or send it back to wait (a 429, a 5xx under
        ``ATTEMPTS``). The line ran: whatever fails from here, it is not run again."""
        batch = job.batch
        status = answer.status
        again = False
        if status == 429 and job.stop is None:
            again = True
            self.feed.hold(batch.tenant, _retry_s(answer.retry_after_s))
        elif status in (500, 502, 503) and job.stop is None:
            runs = job.attempts[line.number] = job.attempts.get(line.number, 0) + 1
            again = runs < ATTEMPTS
        if again:
            metrics.child(metrics.BATCH_LINES, batch.tenant, "retried").inc()
            job.pending.appendleft(line)
            return
        try:
            result, completion = _result(batch, line, answer)
        except Exception:  # an answer the gateway cannot read: the line's error, once
            logger.exception("batch %s line %d: its answer could not be read", batch.id,
                             line.number)
            result, completion = LineResult(line.number, line.custom_id, False, result_line(
                answer.request_id, line.custom_id, 500, error_body(
                    500, "internal error in the gateway", "internal_error"),
                {"code": "internal_error", "message": "the answer could not be read"})), 0
        self.feed.charge(batch.tenant, model, batch.id, completion)
        try:
            kept = await asyncio.to_thread(self.store.add_result, batch.id, result)
        except Exception as exc:
            logger.error("batch %s line %d: its result could not be stored (%s); kept in "
                         "memory and written again, the line is not run again", batch.id,
                         line.number, exc)
            job.unstored[line.number] = result
            job.store_wait_s = job.store_wait_s or RETRY_MIN_S
            self.feed.forget(batch.id)  # no new line while a result waits
            return
        if kept:
            metrics.child(metrics.BATCH_LINES, batch.tenant,
                          "output" if result.ok else "error").inc()

    async def _store_held(self, job: _Job) -> None:
        """Write the results ``job`` holds after failed writes, in line order; on a
        failure the rest wait for the next try, ``store_wait_s`` doubled (at most
        ``RETRY_MAX_S``)."""
        batch = job.batch
        for number in sorted(job.unstored):
            result = job.unstored[number]
            try:
                kept = await asyncio.to_thread(self.store.add_result, batch.id, result)
            except Exception as exc:
                job.store_wait_s = min(RETRY_MAX_S, max(RETRY_MIN_S, job.store_wait_s * 2))
                logger.warning("batch %s: %d result(s) still not stored (%s); next try in "
                               "%.1f s", batch.id, len(job.unstored), exc, job.store_wait_s)
                return
            del job.unstored[number]
            if kept:
                metrics.child(metrics.BATCH_LINES, batch.tenant,
                              "output" if result.ok else "error").inc()
        job.store_wait_s = 0.0
        logger.warning("batch %s: the results held in memory are stored", batch.id)


def _result(batch: BatchRecord, line: Line, answer: LineAnswer) -> tuple[LineResult, int]:
    """The line's result row from the gateway's answer, and its completion tokens."""
    status = answer.status
    try:
        body: Any = json.loads(answer.body)
    except ValueError:
        body = answer.body.decode("utf-8", "replace")
    ok = 200 <= status < 300
    prompt = completion = cached = 0
    if ok:
        kind = ENDPOINTS[batch.endpoint]
        try:
            reported, completion, _ = answer_usage(kind, body)
            prompt = int(reported or 0)
            cached = int(answer_cached(kind, body) or 0)
        except (TypeError, ValueError, AttributeError):
            pass
    error = None
    if not ok and isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        error = {"code": str(err.get("code") or err.get("type") or status),
                 "message": str(err.get("message", ""))}
    return LineResult(line.number, line.custom_id, ok,
                      result_line(answer.request_id, line.custom_id, status, body, error),
                      prompt, cached, completion), completion


def _retry_s(value: float | None) -> float:
    return min(RETRY_MAX_S, max(RETRY_MIN_S, value if value is not None else 1.0))


def _unrun_id(batch_id: str, number: int) -> str:
    """A stable request id for a line the gateway did not send (its output line's id)."""
    return f"{batch_id.removeprefix('batch_')}-{number}"
