"""Bulk windows of speculative drafts, on vLLM's steps (``pacing._drafts``, part 3).

While a window is open no request asks for its drafts: every draft is verified, and what
each request delivered beyond its dispatched sure tokens is told from its output length
(``len(request._output_token_ids)``) once per window, and charged to its user at once.

A request's output length tells the tokens of the steps whose results have arrived. Under
sync scheduling that is every step dispatched before ``schedule()``; under async
scheduling (vLLM's batch queue: ``schedule()`` of step j + 1 runs before the results of
step j are applied) one step may still be in flight. So the counts follow the results:

- a window whose last step is still in flight when it closes is counted at once for
  everything else; that step's results are counted when they arrive (``applied``), or
  by the next window, opened in the same step, which takes its dispatches in;
- a window that opens with a step of per-request grants in flight takes that step in:
  its grants are given back at once (``give_back_grants``) and its sure tokens count as
  dispatched in the window;
- a request that ends with window steps in flight (a stop found in the results of the
  step before, or an abort) is delivered nothing by them: those dispatches are not
  counted;
- a request preempted with a window step in flight is counted when that step's results
  arrive; vLLM delivers them (stale) or drops them, told by its output length.

Under async scheduling a window opens only after a step that admitted nothing, ran no
prompt chunk and saw no rate change, so that in every step a window counts (the one it
takes in included) each scheduled request of a paced user was dispatched a charged sure
token: what the in-flight corrections count. Nowhere else does a window need more
than one step's results: with pipeline parallel 1, vLLM keeps at most two batches, so at
most one step is in flight when ``schedule()`` runs.

Cost: per step, a few attribute tests, and a dict insert and pop for the step in flight;
at each window's end (and at each try to open one), one pass over the running requests
(``_count``: a ``len`` and a few integer operations each); per request that ends or is
preempted inside a window, a membership test per step in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any, NamedTuple

from ..pacing import DraftBook, OutputRateLimiter, Stream
from ._vllm import Request, SchedulerOutput

BULK_RETRY_STEPS = 8
"""Steps with per-request draft grants before a bulk window is tried again (each try is a
pass over the running requests)."""
FLIGHT_LOST_STEPS = 256
"""A step whose results have not come after this many steps never will (the engine
dropped it): it is counted as having delivered nothing."""


class _Flight(NamedTuple):
    """A step whose results have not arrived yet."""

    output: SchedulerOutput
    in_window: bool
    step: int

    @property
    def scheduled(self) -> Container[str]:
        """Its requests (``SchedulerOutput.num_scheduled_tokens``)."""
        return self.output.num_scheduled_tokens


class DraftWindows:
    """When one scheduler's steps are in bulk windows of drafts, and their counts.

    The scheduler calls ``step`` at the start of each ``schedule()``, ``scheduled`` after
    vLLM's, ``arrived`` and ``applied`` around vLLM's ``update_from_output``, and
    ``ended`` for each request that ends while ``counting``."""

    def __init__(self, book: DraftBook, limiter: OutputRateLimiter, per_step: int,
                 asynchronous: bool, requests: dict[str, Request],
                 stream_of: Callable[[Request], Stream],
                 give_back_grants: Callable[[SchedulerOutput], None]) -> None:
        self._book = book
        self._limiter = limiter
        self._per_step = per_step  # tokens a stream may take in a step: 1 + k
        self._async = asynchronous
        self._requests = requests  # the scheduler's, by id
        self._stream_of = stream_of
        self._give_back_grants = give_back_grants
        self.open = False
        """This step is in a window: no draft grants, dispatches counted."""
        self._left = 0  # steps left in the open window
        self._wait = 0  # steps before the next try
        self._generation = -1  # the limiter's, when the window opened
        self._seen_generation = -1  # the limiter's, at the last step
        self._steps = 0
        self._flight: dict[int, _Flight] = {}  # id(output) -> the step in flight
        self._last: SchedulerOutput | None = None  # the open window's latest step
        self._closing: int | None = None  # id() of the step whose results the close waits for
        self._closed_now = False  # a window closed in this step's ``step``
        self._preempted: list[tuple[Request, int, int]] = []  # (request, its length, id(step))
        self._decoding = False  # the last step admitted nothing and ran no prompt chunk

    @property
    def counting(self) -> bool:
        """Deliveries are being counted: a window is open or its close count is due."""
        return self.open or self._closing is not None

    def end_soon(self) -> None:
        """Close the open window at the next step (someone was refused in it)."""
        self._left = 0

    # -- schedule() --------------------------------------------------------------------

    def step(self, admits: bool, running: list[Request], may_open: bool) -> bool:
        """Whether this step is in a window, opening or closing one first where due.

        An open window goes on while it has steps left, nothing waits for admission
        (``admits``) and the limiter's generation is the same (no rate changed); else it
        closes: each user is charged what its running requests delivered beyond their
        dispatched sure tokens (the window's last step, if still in flight, is counted
        when its results arrive, or by the next window, which takes it in). A new one
        opens, right then or ``BULK_RETRY_STEPS`` after a step that could not be in one,
        when nothing waits, ``may_open`` (no inner level, no streaming-input session),
        no close count is due, and ``DraftBook.bulk_steps`` finds room for at least its
        minimum; under async scheduling also only after a step that admitted nothing, ran
        no prompt chunk and saw no rate change (so that every step a window counts, the
        one it takes in included, dispatched a sure token to each of its requests)."""
        self._steps += 1
        self._closed_now = False
        limiter = self._limiter
        generation = limiter.generation
        changed = generation != self._seen_generation
        self._seen_generation = generation
        carried: _Flight | None = None  # the closed window's last step, still in flight
        if self.open:
            if self._left > 0 and not admits and generation == self._generation:
                self._left -= 1
                return True
            self.open = False
            self._closed_now = True
            last = self._last
            self._last = None
            entry = self._flight.get(id(last)) if last is not None else None
            if entry is None:
                counts = self._count(running, charge=True)
            else:
                # Everything but that step's results, whose dispatches are carried over.
                carried = entry
                self._closing = id(last)
                counts = self._count(running, charge=True, dispatched_in=carried.scheduled,
                                     undelivered_in=(carried.scheduled,))
            if admits:
                self._wait = BULK_RETRY_STEPS
                return False
        elif admits or self._wait > 0 or self._closing is not None:
            if self._wait > 0:
                self._wait -= 1
            return False
        else:
            counts = None
        if self._async and (changed or not self._decoding):
            return False
        # A step of per-request grants in flight (async only): taken into the window.
        absorbed: SchedulerOutput | None = None
        if carried is None:
            for flight in self._flight.values():
                if not flight.in_window:  # (one at most)
                    absorbed = flight.output
                    counts = self._count(running, charge=False,
                                         dispatched_in=flight.scheduled)
                    break
            if counts is None:
                counts = self._count(running, charge=False)
        steps = self._book.bulk_steps(counts, self._per_step, limiter.now_ns()) if may_open else 0
        if not steps:
            self._wait = BULK_RETRY_STEPS
            return False
        if absorbed is not None:
            self._give_back_grants(absorbed)
        self._closing = None
        self.open = True
        self._left = steps - 1 - (absorbed is not None or carried is not None)
        self._generation = generation
        return True

    def scheduled(self, output: SchedulerOutput, in_window: bool, prompts: bool,
                  admits: bool) -> None:
        """After vLLM's ``schedule()``: the step is in flight until ``arrived``; requests
        it preempted while deliveries are counted are counted (now, or when their step in
        flight has its results). ``prompts``: some running request was in its prompt."""
        preempted = output.preempted_req_ids
        if preempted and (in_window or self._closed_now or self._closing is not None):
            self._count_preempted(preempted)
        self._flight[id(output)] = _Flight(output, in_window, self._steps)
        if in_window:
            self._last = output
        self._decoding = not prompts and not admits

    def _count_preempted(self, ids: Iterable[str]) -> None:
        flights = [(key, f.scheduled) for key, f in self._flight.items() if f.in_window]
        now: list[Request] = []
        for rid in ids:
            req = self._requests.get(rid)
            if req is None:
                continue
            for key, scheduled in flights:
                if rid in scheduled:
                    self._preempted.append((req, len(req._output_token_ids), key))
                    break
            else:
                now.append(req)
        if now:
            self._count(now, charge=True)

    # -- update_from_output() ------------------------------------------------------------

    def arrived(self, output: SchedulerOutput) -> None:
        """Before vLLM applies ``output``'s results: it is no longer in flight."""
        if self._flight:
            self._flight.pop(id(output), None)

    def applied(self, output: SchedulerOutput, running: list[Request]) -> None:
        """After vLLM applied ``output``'s results: the requests preempted with it in
        flight are counted, and the close count that waited for it is taken."""
        key = id(output)
        if self._preempted:
            self._count_waiting(key, lost=False)
        if self._closing == key:
            self._closing = None
            self._count(running, charge=True)

    def _count_waiting(self, key: int, lost: bool) -> None:
        """Count the preempted requests whose step ``key`` delivered what it will."""
        keep: list[tuple[Request, int, int]] = []
        for req, n, flight in self._preempted:
            if flight != key:
                keep.append((req, n, flight))
            elif not req.is_finished():  # a finished one was counted by ``ended``
                if lost or len(req._output_token_ids) == n:
                    self._stream_of(req).dispatched -= 1  # its stale output was dropped
                self._count((req,), charge=True)
        self._preempted = keep

    def ended(self, request: Request) -> None:
        """A request ends while ``counting``: its deliveries are charged; the window steps
        in flight deliver it nothing."""
        self._count((request,), charge=True,
                    undelivered_in=[f.scheduled for f in self._flight.values() if f.in_window])

    def cleanup(self, running: list[Request]) -> None:
        """Forget steps whose results never came (``FLIGHT_LOST_STEPS``): they delivered
        nothing. Called now and then (every few hundred steps)."""
        lost = [(key, f) for key, f in self._flight.items()
                if f.step < self._steps - FLIGHT_LOST_STEPS]
        for key, flight in lost:
            del self._flight[key]
            self._count_waiting(key, lost=True)
            if self._closing == key:
                self._closing = None
                self._count(running, charge=True, undelivered_in=[flight.scheduled])

    # -- the counts ----------------------------------------------------------------------

    def _count(self, requests: Iterable[Request], charge: bool,
               dispatched_in: Container[str] = (),
               undelivered_in: Sequence[Container[str]] = ()) -> dict[Any, int]:
        """Count the output tokens of ``requests`` from their lengths: with ``charge``,
        each user is charged those delivered since they were last counted beyond the sure
        tokens dispatched since (its accepted drafts), at once, less one dispatch per step
        in ``undelivered_in`` that scheduled the request (its results will bring it
        nothing); then each request's count starts again from here, with one dispatch if
        ``dispatched_in`` scheduled it (a step in flight taken into a window). Returns
        each user's account -> its requests among them.

        Cost per request: its stream, a ``len``, a few integer operations and stores, one
        or two dict updates, and a membership test per container given; per user
        charged, one GCRA update."""
        stream_of = self._stream_of
        counts: dict[Any, int] = {}
        delivered: dict[Any, int] = {}
        for req in requests:
            s = stream_of(req)
            n = len(req._output_token_ids)
            a = s.account
            if charge:
                sent = s.dispatched
                for scheduled in undelivered_in:
                    if req.request_id in scheduled:
                        sent -= 1
                extra = n - s.seen - sent
                if extra > 0:
                    delivered[a] = delivered.get(a, 0) + extra
            s.seen = n
            s.dispatched = 1 if req.request_id in dispatched_in else 0
            counts[a] = counts.get(a, 0) + 1
        if delivered:
            self._book.charge_delivered(delivered, self._limiter.now_ns())
        return counts
