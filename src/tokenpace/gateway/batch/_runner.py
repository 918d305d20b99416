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
- no answer (the gateway is shutting down): nothing is written, the line runs again
  wherever the batch resumes.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .. import metrics
from ..wire import answer_cached, answer_usage, error_body
from ._feed import BatchFeed
from ._lines import ENDPOINTS, Line, parse_lines
from ._objects import BatchRecord, LineResult, result_line
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
    # "cancelling", "expired", or "suspended" (a line got no answer): start no more lines
    stop: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class BatchRunner:
    def __init__(self, store: BatchStore, host: BatchHost, *, concurrency: int,
                 max_lines: int, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.host = host
        self.concurrency = concurrency
        self.max_lines = max_lines
        self._wall = wall
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
            while True:
                try:
                    await self._scan()
                except Exception:  # a store hiccup: logged, the next scan tries again
                    logger.exception("batch scan failed")
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

    def quiesce(self) -> None:
        """Start no line and claim no batch from now on (the gateway is stopping): lines
        in flight end, and their batches wait for the next start."""
        self._quiescing = True

    def wake(self) -> None:
        """A batch was created or cancelled on this process: scan now."""
        self._scan_now.set()

    async def _scan(self) -> None:
        now = self._wall()
        for batch in await asyncio.to_thread(self.store.unfinished):
            job = self._jobs.get(batch.id)
            if job is not None:
                if batch.status == "cancelling" and job.stop is None:
                    self._stop(job, "cancelling")
                if now >= batch.expires_at and job.stop is None:
                    self._stop(job, "expired")
                continue
            if self._quiescing:
                continue
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
                if job is None or job.stop is not None or not job.pending:
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
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("batch %s: runner failed; it is picked up again on the next "
                             "scan", job.batch.id)
        finally:
            self.feed.forget(job.batch.id)
            self._jobs.pop(job.batch.id, None)
            await self.host.unclaim(job.claim)

    async def _lines(self, batch: BatchRecord) -> tuple[list[Line], list[dict[str, Any]]]:
        content = await asyncio.to_thread(self.store.file_content, batch.tenant,
                                          batch.input_file_id)
        if content is None:
            return [], [{"code": "file_not_found", "message": f"input file "
                         f"{batch.input_file_id} no longer exists", "param": "input_file_id",
                         "line": None}]
        lines, problems = await asyncio.to_thread(parse_lines, content, batch.endpoint,
                                                  self.max_lines)
        return lines, [p.to_json() for p in problems]

    async def _validate(self, job: _Job) -> BatchRecord | None:
        batch = job.batch
        lines, problems = await self._lines(batch)
        if self._wall() >= batch.expires_at:  # every line written as batch_expired
            return await self._finalize(job, batch, "expired", [] if problems else lines)
        if problems:
            moved = await asyncio.to_thread(self.store.move, batch.id, "validating", "failed",
                                            errors=problems)
            return moved
        models = {line.model for line in lines}
        moved = await asyncio.to_thread(self.store.move, batch.id, "validating",
                                        "in_progress", total=len(lines),
                                        model=models.pop() if len(models) == 1 else None)
        if moved is None:  # cancelled meanwhile
            return await asyncio.to_thread(self.store.batch, batch.id)
        job.batch = moved
        return moved

    async def _run(self, job: _Job) -> BatchRecord | None:
        batch = job.batch
        lines, problems = await self._lines(batch)
        if problems:  # the input changed under a running batch: nothing more can run
            logger.error("batch %s: its input file can no longer be read (%s)", batch.id,
                         problems[0]["message"])
            lines = []
        done = await asyncio.to_thread(self.store.done_lines, batch.id)
        job.pending.extend(line for line in lines if line.number not in done)
        if job.pending:
            logger.info("batch %s of tenant %s: %d of %d lines to run", batch.id,
                        batch.tenant, len(job.pending), len(lines))
        while True:
            if job.stop is None and self._wall() >= batch.expires_at:
                self._stop(job, "expired")
            if job.stop is None and job.pending:
                self._offer(job)
            if job.inflight == 0 and (job.stop is not None or not job.pending):
                break
            job.changed.clear()
            try:
                async with asyncio.timeout(max(0.05, min(SCAN_S, batch.expires_at
                                                         - self._wall()))):
                    await job.changed.wait()
            except TimeoutError:
                pass
        if job.stop == "expired":
            unrun = list(job.pending)
            job.pending.clear()
            return await self._finalize(job, batch, "expired", unrun)
        if job.stop == "cancelling":
            current = await asyncio.to_thread(self.store.batch, batch.id)
            return current
        if job.stop == "suspended":  # no answer for a line: the batch resumes later
            return None
        moved = await asyncio.to_thread(self.store.move, batch.id, "in_progress", "finalizing")
        return moved if moved is not None else await asyncio.to_thread(self.store.batch,
                                                                       batch.id)

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

    async def _finalize(self, job: _Job, batch: BatchRecord, end: str,
                        unrun: list[Line] | None = None) -> BatchRecord | None:
        """Write the output and error files from the stored results and end the batch
        (``unrun``: lines that expire unrun, written as ``batch_expired`` errors)."""
        results = await asyncio.to_thread(self.store.results, batch.id)
        output = "".join(r.text + "\n" for r in results if r.ok).encode()
        errors = "".join(r.text + "\n" for r in results if not r.ok)
        if unrun:
            written = {r.number for r in results}
            errors += "".join(result_line("tpg-" + _unrun_id(batch.id, line.number),
                                          line.custom_id, None, None, {
                                              "code": "batch_expired",
                                              "message": "This line could not be run before "
                                                         "the batch's completion window "
                                                         "ended."}) + "\n"
                              for line in unrun if line.number not in written)
        ended = await asyncio.to_thread(self.store.finish, batch, end, output,
                                        errors.encode())
        if ended is not None:
            if unrun:
                metrics.child(metrics.BATCH_LINES, batch.tenant, "expired").inc(
                    sum(1 for line in unrun if line.number not in written))
            counts = await asyncio.to_thread(self.store.usage, batch.id)
            logger.info("batch %s of tenant %s %s: %d lines ok, %d failed", batch.id,
                        batch.tenant, end, counts.requests_completed, counts.requests_failed)
        return ended

    # -- one line ----------------------------------------------------------------------

    async def _run_line(self, job: _Job, line: Line, model: str) -> None:
        """Run one line and keep its result. The batch counts the line in flight until its
        result is stored (or it went back to the batch's lines): the batch finalizes from
        the stored results once nothing is in flight, so a result still being written
        must count."""
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
            try:
                if answer is None:
                    self._suspend(job, line)
                else:
                    await self._settle_line(job, line, model, answer)
            except Exception:
                logger.exception("batch %s line %d: its result could not be kept",
                                 job.batch.id, line.number)
                self._suspend(job, line)
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
        result = LineResult(line.number, line.custom_id, ok,
                            result_line(answer.request_id, line.custom_id, status, body,
                                        error), prompt, cached, completion)
        if await asyncio.to_thread(self.store.add_result, batch.id, result):
            metrics.child(metrics.BATCH_LINES, batch.tenant, "output" if ok else "error").inc()
        self.feed.charge(batch.tenant, model, batch.id, completion)


def _retry_s(value: float | None) -> float:
    return min(RETRY_MAX_S, max(RETRY_MIN_S, value if value is not None else 1.0))


def _unrun_id(batch_id: str, number: int) -> str:
    """A stable request id for a line the gateway did not send (its output line's id)."""
    return f"{batch_id.removeprefix('batch_')}-{number}"
