"""Per-step pacing decisions: who may sample a token this step, and who gives way.

The scheduler adapter opens one ``Stream`` per request (``open_stream``) and, each step,
hands the planner the streams of its running requests with ``samples`` set. The planner
decides which of them run, which are throttled (their user has no quota) and which are
deferred (no active batch slot is left). It owns the limiter calls, so the charge/refund
bookkeeping has one home:

* one charge per request per step, only for steps that sample; a user's charges of one
  step are taken in one limiter call (``take(user, n)``, exact);
* once a user is refused in a step, its other requests are not asked again that step;
* a user's streams take turns (least recently served stream first), so four streams of
  one paced user each get about a quarter of its tokens;
* when the active-slot limit binds, slots go to the user with the least service so far
  (a virtual counter per user, counted in slot-steps, lifted to the smallest counter of
  the present users when it (re)appears, so that no credit is banked while idle);
* one refund point, ``settle``, for every charge whose step was not dispatched.

Cost on the uncontended path (no slot contention, the usual case) while no user was
refused earlier in the step: one pass over the streams that counts service and grants each
sampling stream its token on the user's cached GCRA state (about ten attribute operations
per stream, no call; for a user under its rate no arithmetic but the service count), then
one pass over the charged streams in ``settle`` that only stamps the rotation when the
caller knows every planned stream was dispatched. Sorting, heaps and the per-user limiter call (``take_claims``) only
happen for a user that is short of quota, after an earlier refusal, or when slots bind.

Cost of a throttled stream (its user out of quota; one request per user, the usual case):
in the same pass the same operations, the GCRA test that refuses it and a dict store for
its user; then, per refused user, the instant it has quota again (integer operations on
its cached state, no call); in ``_take_turns`` two dict lookups, an append and a
decrement, no sort; one throttled-steps count; and in the next ``begin_step`` one
throttled-time count. No object is made per throttled stream: a step that throttles
thousands of requests allocates a few containers, so it never sets off the garbage
collector (a list per refused user did, every step, and then took the process's next
full collection too). About 0.7 us per throttled stream at 1,024 of them.

Nothing here knows vLLM: keys are opaque, and the clock lives in the limiter.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Container, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ._inner import InnerKey, InnerRates, inner_levels, inner_limiter
from ._lanes import LanePolicy
from ._limiter import OutputRateLimiter, _Bucket
from ._stats import PacingStats, UserStats

MAX_IDLE_WAIT_S = 1.0
"""Longest idle wait. The engine waits on its input queue, so new requests and aborts end
the wait at once; the wait ends exactly when the earliest user has quota again, and this
bound only makes a limits-file edit visible within a second. (Waiting in 50 ms slices
woke an all-throttled engine 20 times a second for nothing.)"""

NO_SAMPLE = 0
"""``Stream.samples``: this step samples nothing (an intermediate prefill chunk)."""
SAMPLES = 1
"""``Stream.samples``: this step samples if it is scheduled at all (a decode step)."""
MAY_SAMPLE = 2
"""``Stream.samples``: this step may be the last prefill chunk; it samples only if the
scheduler gives it the whole remainder (``settle`` asks ``still_prefilling``)."""


class _Account:
    """One user's planner state: service counter and this step's tally."""

    __slots__ = ("user", "service", "stamp", "fresh", "need", "granted", "bucket",
                 "generation", "stats")

    def __init__(self, user: str, stats: UserStats) -> None:
        self.user = user
        self.stats = stats  # the user's counters for /metrics (outlive the account)
        self.service = 0
        self.stamp = -1  # last step in which the user had a running request
        self.fresh = False
        self.need = 0  # running streams that sample this step
        self.granted: int | None = 0  # tokens granted this step (None: not paced)
        # The user's limiter state as of limiter generation ``generation`` (fast path).
        self.bucket: _Bucket | None = None
        self.generation = -1


class Stream:
    """A request as the planner sees it; opened once, reused every step (no allocation)."""

    __slots__ = ("key", "user", "account", "stats", "priority", "samples", "last_served",
                 "levels", "yielded", "drafts", "seen", "dispatched")

    def __init__(self, key: Hashable, account: _Account, priority: int,
                 levels: tuple[InnerKey, ...] = ()) -> None:
        self.key = key
        self.user = account.user
        self.levels = levels
        """The inner levels the request names, outermost first: its application's key
        and its end user's (``_inner``), each paced at its rate inside the user's; empty:
        the user's rate alone."""
        self.account = account
        self.stats = account.stats
        self.priority = priority
        """Lower runs first, as in vLLM's priority policy; 0 for everyone under FCFS."""
        self.samples = NO_SAMPLE
        """Set by the adapter before each step: NO_SAMPLE, SAMPLES or MAY_SAMPLE."""
        self.last_served = -1
        self.yielded = 0
        """Steps in a row this request's prompt chunk sat out for a better lane (``_lanes``)."""
        self.drafts = 0
        """Set by the adapter before each step with speculative decoding: the draft tokens
        the request proposes (``_drafts``)."""
        self.seen = 0
        """Speculative decoding in bulk windows (``_drafts``): the request's output tokens
        when the adapter last counted them."""
        self.dispatched = 0
        """Its sure tokens dispatched since then (counted by ``settle`` while
        ``StepPlanner.count_dispatches`` is set)."""


@dataclass(slots=True)
class RunningPlan:
    """The running requests that sit out this step; every other one runs."""

    throttled: list[Hashable] = field(default_factory=list)
    """Refused for lack of quota: skipped, keep their KV, do not count as active."""
    deferred: list[Hashable] = field(default_factory=list)
    """Have quota or need none, but no active slot is left this step."""


class Settlement(NamedTuple):
    key: Hashable
    user: str
    dispatched: bool


class StepPlanner:
    """Pacing state that lives across steps: service counters and stream rotation."""

    def __init__(self, limiter: OutputRateLimiter, stats: PacingStats | None = None,
                 inner_rates: InnerRates | None = None) -> None:
        self.limiter = limiter
        # Applications and end users: GCRA levels inside their user's (``_inner``), on the
        # same clock. Used only by streams that name one.
        self.inner = inner_limiter(inner_rates or InnerRates(), lambda: self.limiter.clock_ns())
        self._inner_streams = 0  # open streams that name an inner level
        self._inner_charged: list[Stream] = []  # running streams charged this step
        self._inner_admitted: dict[Hashable, tuple[InnerKey, ...]] = {}  # waiting ones
        self._inner_refused: dict[InnerKey, int] = {}  # -> when it has quota again
        # Inner key -> a waiting request of it refused admission: it gets the level's next
        # token before the level's running streams (as ``_starved`` for users).
        self._inner_starved: dict[InnerKey, Hashable] = {}
        self.stats = stats if stats is not None else PacingStats(
            first=limiter.limits.overrides)
        self._step = 0
        self._step_ns = limiter.now_ns()
        self._accounts: dict[str, _Account] = {}
        self._streams: dict[Hashable, Stream] = {}
        self._charged_streams: list[Stream] = []  # running streams charged this step
        self._charged: dict[Hashable, str] = {}  # other charges: waiting requests
        self._refused: dict[str, int] = {}  # user -> first instant it has quota again
        # user -> a waiting request refused admission for lack of quota. It gets the user's
        # next token before the user's running streams, or those would take every token
        # and the waiting request would never start.
        self._starved: dict[str, Hashable] = {}
        self.count_dispatches = False
        """While set (a bulk window of speculative drafts, ``_drafts``), ``settle`` also
        counts each dispatched charge on its stream (``Stream.dispatched``)."""
        self.lanes: LanePolicy | None = None
        """Set under vLLM's priority policy with room to hold requests: slot contention then
        keeps a reserve for each lower priority level (``_lanes``)."""

    # -- streams --------------------------------------------------------------------

    def open_stream(self, key: Hashable, user: str, priority: int = 0,
                    end_user: str | None = None, application: str | None = None,
                    own_end_users: bool = False) -> Stream:
        """The planner's record of one request, kept until ``forget`` sees it gone.
        ``application`` and ``end_user``: the application and the end user it names
        inside ``user``, if any; ``own_end_users``: the application paces its end users
        at a rate of its own (``_inner``)."""
        stream = self._streams.get(key)
        levels = inner_levels(user, application, end_user, own_end_users)
        if stream is not None and stream.user == user and stream.levels == levels:
            return stream
        if stream is not None and stream.levels:
            self._inner_streams -= 1
        account = self._accounts.get(user)
        if account is None:
            account = self._accounts[user] = _Account(user, self.stats.of(user))
        stream = self._streams[key] = Stream(key, account, priority, levels)
        if levels:
            self._inner_streams += 1
        return stream

    # -- one step -------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new step: users refused in the last one had work waiting for quota since it
        began (their ``throttled_ns``; one clock read per step)."""
        now = self.limiter.now_ns()
        if self._refused:
            waited = now - self._step_ns
            stats = self.stats
            for user in self._refused:
                stats.of(user).throttled_ns += waited
        self._step_ns = now
        self._step += 1
        self._charged_streams = []
        self._charged.clear()
        self._refused.clear()
        if self._inner_refused:
            self._inner_refused.clear()

    def is_paced(self, user: str) -> bool:
        return self.limiter.limits.rate(user) is not None

    def _charge(self, key: Hashable, user: str) -> bool:
        """One token for a waiting request (admission) or a stream on the contended path."""
        if user in self._refused:
            return False
        if self.limiter.try_take(user):
            self._charged[key] = user
            return True
        self._refused[user] = self.limiter.ready_at_ns(user)
        return False

    def may_admit(self, key: Hashable, user: str) -> bool:
        """Should a waiting request be considered for admission this step?

        Asks without charging: the charge comes with ``charge_admission`` once the
        scheduler knows the step reaches the request's sampling position. A request of a
        user without quota is refused and gets the user's next token (see ``_starved``).
        """
        if key in self._charged or not self.is_paced(user):
            return self._inner_ready(key)
        if user not in self._refused:
            ready = self.limiter.ready_at_ns(user)
            if ready <= self.limiter.now_ns():
                return self._inner_ready(key)
            self._refused[user] = ready
        self._starved.setdefault(user, key)
        return False

    def _inner_ready(self, key: Hashable) -> bool:
        """Whether every inner level a waiting request names (if any) has quota now."""
        if not self._inner_streams or key in self._inner_admitted:
            return True
        stream = self._streams.get(key)
        if stream is None:
            return True
        refused = self._inner_refused
        for level in stream.levels:
            if level not in refused:
                ready = self.inner.ready_at_ns(level)  # type: ignore[arg-type]
                if ready <= self.limiter.now_ns():
                    continue
                refused[level] = ready
            self._inner_starved.setdefault(level, key)
            return False
        return True

    def _take_inner(self, levels: tuple[InnerKey, ...]) -> bool:
        """One token of every inner level, all or none (a refused level gives back those
        taken before it: exact, as any refund). One GCRA update per level."""
        inner, refused = self.inner, self._inner_refused
        for i, level in enumerate(levels):
            if level in refused or not inner.try_take(level):  # type: ignore[arg-type]
                if level not in refused:
                    refused[level] = inner.ready_at_ns(level)  # type: ignore[arg-type]
                for taken in levels[:i]:
                    inner.refund(taken)  # type: ignore[arg-type]
                return False
        return True

    def _refund_inner(self, levels: tuple[InnerKey, ...]) -> None:
        for level in levels:
            self.inner.refund(level)  # type: ignore[arg-type]

    def charge_admission(self, key: Hashable, user: str) -> bool:
        """Charge a waiting request whose admission step samples; False if no quota (its
        user's, or an inner level's: then a charge of its user is returned at ``settle``)."""
        if not (key in self._charged or not self.is_paced(user) or self._charge(key, user)):
            return False
        if not self._inner_streams or key in self._inner_admitted:
            return True  # (a starved request's inner tokens were taken before the step)
        stream = self._streams.get(key)
        if stream is None or not stream.levels:
            return True
        if not self._take_inner(stream.levels):
            return False
        self._inner_admitted[key] = stream.levels
        return True

    def _charge_starved(self, waiting: Callable[[Hashable], bool], can_admit: bool) -> None:
        for user, key in list(self._starved.items()):
            if not waiting(key) or not self.is_paced(user):
                del self._starved[user]
            elif can_admit and key not in self._charged:
                self._charge_waiting(key)

    def _charge_waiting(self, key: Hashable) -> None:
        """Every token a starved waiting request's admission needs (its user's and its
        inner levels'), taken before the running streams ask, all or none: a waiting
        request holding one level's token while running streams take another level's
        would hold it every step and never start, and its level's own running streams
        would lose that token every step too."""
        stream = self._streams.get(key)
        if stream is None:
            return
        user = stream.user
        took_user = False
        if self.is_paced(user):
            if not self._charge(key, user):
                return
            took_user = True
        if not stream.levels or key in self._inner_admitted:
            return
        if self._take_inner(stream.levels):
            self._inner_admitted[key] = stream.levels
        elif took_user:
            del self._charged[key]
            self.limiter.refund(user)

    def plan_running(
        self,
        streams: Sequence[Stream],
        slots: int,
        waiting: Callable[[Hashable], bool] = lambda key: False,
        can_admit: bool = True,
    ) -> RunningPlan:
        """Decide run / throttled / deferred for every running request.

        ``streams`` are the running requests in the scheduler's order, each with
        ``samples`` set for this step; ``slots`` is the number of running requests allowed
        in this step's batch; ``waiting(key)`` tells whether a request still waits for
        admission, and ``can_admit`` whether admission can take a request this step.
        """
        if self._starved:
            self._charge_starved(waiting, can_admit)
        gated: list[Hashable] = []
        if self._inner_streams:
            if self._inner_starved:
                self._charge_inner_starved(waiting, can_admit)
            streams, gated = self._charge_inner(streams)
        if len(streams) <= slots:
            plan = self._plan_uncontended(streams)
        else:
            plan = self._plan_contended(streams, slots)
        if self._inner_charged and (plan.throttled or plan.deferred):
            self._return_inner_charges(plan)
        if gated:
            plan.throttled.extend(gated)
        if plan.throttled:  # counted here, the one place every path's throttling passes
            known = self._streams
            for key in plan.throttled:
                stream = known.get(key)
                if stream is not None:
                    stream.stats.throttled_steps += 1
        return plan

    def _charge_inner(self, streams: Sequence[Stream]) -> tuple[Sequence[Stream], list[Hashable]]:
        """Charge each sampling stream that names inner levels one token of each (its
        application's, its end user's), least recently served first; the streams one of
        whose levels is out of quota are left out of the step (returned as throttled)
        before the user level decides anything, so they take no token of their user and no
        active slot. Cost: only when some open stream names an inner level; a sort and one
        GCRA update per level of each such stream."""
        charged = self._inner_charged
        candidates = sorted((s for s in streams if s.levels and s.samples), key=_turn)
        gated: list[Hashable] = []
        for s in candidates:
            if self._take_inner(s.levels):
                charged.append(s)
            else:
                gated.append(s.key)
        if not gated:
            return streams, gated
        out = set(gated)
        return [s for s in streams if s.key not in out], gated

    def _charge_inner_starved(self, waiting: Callable[[Hashable], bool],
                              can_admit: bool) -> None:
        """Give each starved waiting request the next token of its inner levels (taken
        before those levels' running streams ask), for its admission this step."""
        for level, key in list(self._inner_starved.items()):
            if key not in self._streams or not waiting(key):
                del self._inner_starved[level]
            elif can_admit and key not in self._inner_admitted and key not in self._charged:
                self._charge_waiting(key)

    def _return_inner_charges(self, plan: RunningPlan) -> None:
        """The inner tokens of streams that the user level throttled or deferred."""
        out = set(plan.throttled)
        out.update(plan.deferred)
        kept = []
        for s in self._inner_charged:
            if s.key in out:
                self._refund_inner(s.levels)
            else:
                kept.append(s)
        self._inner_charged = kept

    def _tally(self, streams: Sequence[Stream]) -> list[_Account]:
        """Count each present user's sampling streams; lift newcomers.

        Every stream is counted as served (``service += 1``), the outcome of nearly every
        step; the rare streams that sit out are taken back by the caller.
        """
        step = self._step
        prev = step - 1
        present = []
        fresh = []
        for s in streams:
            a = s.account
            if a.stamp == step:
                if s.samples:
                    a.need += 1
            else:
                if a.stamp != prev:
                    fresh.append(a)
                a.stamp = step
                a.need = 1 if s.samples else 0
                present.append(a)
            a.service += 1
        if fresh:
            self._lift(streams, present, fresh)
        return present

    def _lift(self, streams: Sequence[Stream], present: list[_Account],
              fresh: list[_Account]) -> None:
        """Newcomers start at the smallest counter of the users that were already there,
        so that no one banks credit while it has nothing running."""
        counted = _stream_counts(streams)
        for a in fresh:
            a.fresh = True
        old = [a.service - counted[a.user] for a in present if not a.fresh]
        floor = min(old) if old else 0
        for a in fresh:
            a.fresh = False
            a.service = floor + counted[a.user]

    def _plan_uncontended(self, streams: Sequence[Stream]) -> RunningPlan:
        """Every stream has a slot: it runs unless it samples and its user is out of quota."""
        if self._refused:  # a starved request's turn refused someone: the exact path
            return self._plan_uncontended_exact(streams)
        # Fast path, one pass: count each stream as served and grant each sampling stream
        # its token on the spot, on the user's GCRA state cached in its account (k grants
        # of one token at one instant are exactly one grant of k). Per stream: about ten
        # attribute reads and writes and a few integer operations, no call, no lookup
        # (the limiter's ``bucket`` only when its generation changed).
        # The first refusal of a user ends the pass for that user's later streams too (a
        # refusal changes nothing, so the rest are refused alike); which of its streams
        # run is then re-decided by turn, as on the exact path.
        # For a user under its rate (the usual case when nobody is throttled) the GCRA
        # update is one comparison and two stores, no arithmetic and no allocation: a TAT
        # that is not ahead of the clock restarts from now (the burst test always passes),
        # at ``now * scale + interval``, computed once per run of users that share a rate
        # (the limiter hands equal rates the same ``int`` objects, so identity tests find
        # them), and its refundable count restarts at 1 (a cached small int).
        step = self._step
        prev = step - 1
        limiter = self.limiter
        generation = limiter.generation
        now = limiter.now_ns()
        scale: int | None = None
        interval: int | None = None
        now_scaled = restart = 0
        charged: list[Stream] = []
        append = charged.append
        fresh: list[_Account] = []
        short: dict[str, _Account] = {}
        for s in streams:
            a = s.account
            if a.stamp != step:
                if a.stamp != prev:
                    fresh.append(a)
                a.stamp = step
            a.service += 1
            if not s.samples:
                continue
            if a.generation != generation:
                a.bucket = limiter.bucket(a.user, now)
                a.generation = generation
            b = a.bucket
            if b is None:  # not paced: nothing counted
                continue
            if b.scale is not scale:
                scale = b.scale
                now_scaled = now * scale
                interval = None
            tat = b.tat
            if tat <= now_scaled:  # under its rate: the grant restarts from now
                if b.interval is not interval:
                    interval = b.interval
                    restart = now_scaled + interval
                b.tat = restart
                b.refundable = 1
            elif tat - now_scaled > b.burst:
                short[a.user] = a
                continue
            else:
                b.tat = tat + b.interval
                b.refundable += 1
            append(s)
        if fresh:
            present = list({s.account.user: s.account for s in streams}.values())
            self._lift(streams, present, fresh)
        plan = RunningPlan()
        if short:
            refused = self._refused
            for user, a in short.items():
                b = a.bucket  # when it has quota again (``ready_at_ns``: later than now)
                refused[user] = -((b.burst - b.tat) // b.scale)  # type: ignore[union-attr]
                a.granted = 0
            kept = []
            for s in charged:
                if s.user in short:
                    s.account.granted += 1  # type: ignore[operator]
                else:
                    kept.append(s)
            charged = kept
            self._take_turns(streams, short, charged, plan)
        self._charged_streams = charged
        return plan

    def _plan_uncontended_exact(self, streams: Sequence[Stream]) -> RunningPlan:
        """``_plan_uncontended`` when some user was refused earlier this step: one limiter
        call for the users that may still ask, the refused ones are not asked again."""
        present = self._tally(streams)
        refused = self._refused
        limiter = self.limiter
        blocked = [a for a in present if a.need and a.user in refused]
        claims: Sequence[_Account] = [a for a in present if a not in blocked]
        for a in blocked:
            a.granted = 0
        short = limiter.take_claims(claims, limiter.now_ns())
        for a in short:
            refused[a.user] = limiter.ready_at_ns(a.user)
        short += blocked
        plan = RunningPlan()
        charged = [
            s for s in streams
            if s.samples and s.account.granted is not None and s.account not in short
        ]
        if short:
            self._take_turns(streams, {a.user for a in short}, charged, plan)
        self._charged_streams = charged
        return plan

    def _take_turns(self, streams: Sequence[Stream], short_users: Collection[str],
                    charged: list[Stream], plan: RunningPlan) -> None:
        """Users granted fewer tokens than they have sampling streams: their streams take
        turns (least recently served first) for the ``granted`` tokens; the others are
        throttled. Appends to ``charged`` and ``plan.throttled``.

        A user with one sampling stream (one request, the usual case) has nothing to take
        turns for: its stream is decided on the spot. Cost per stream of a short user: two
        dict lookups, and for a throttled one an append and a decrement; no allocation.
        Only a user with several sampling streams gets a list, sorted by turn. (A list per
        user cost more than the decision: with many throttled users the step held one
        object per throttled request, enough to trigger the garbage collector every step,
        and the process's next full collection then fell on a step like this one.)
        """
        sampling = dict.fromkeys(short_users, 0)
        for s in streams:
            if s.samples and s.user in sampling:
                sampling[s.user] += 1
        throttled = plan.throttled
        several: dict[str, list[Stream]] = {}
        for s in streams:
            if not s.samples:
                continue
            n = sampling.get(s.user)
            if n is None:
                continue
            if n > 1:
                mine = several.get(s.user)
                if mine is None:
                    mine = several[s.user] = []
                mine.append(s)
            elif s.account.granted:
                charged.append(s)
            else:
                throttled.append(s.key)
                s.account.service -= 1  # counted as served by the step's pass
        for mine in several.values():
            mine.sort(key=_turn)
            account = mine[0].account
            left = account.granted or 0
            for s in mine:
                if left > 0:
                    left -= 1
                    charged.append(s)
                else:
                    throttled.append(s.key)
                    account.service -= 1  # counted as served by the step's pass

    def _plan_contended(self, streams: Sequence[Stream], slots: int) -> RunningPlan:
        """More running requests than slots: the least served user gets the next slot."""
        counted = _stream_counts(streams)
        for a in self._tally(streams):
            a.service -= counted[a.user]  # counted per placed stream below
        by_user: dict[str, list[Stream]] = {}
        for s in streams:
            by_user.setdefault(s.user, []).append(s)
        for mine in by_user.values():
            if len(mine) > 1:
                mine.sort(key=_turn)
        plan = RunningPlan()
        if self.lanes is not None:
            slots -= self._place_reserves(by_user, slots, plan)
        heap = [
            (mine[0].priority, mine[0].account.service, order, user, 0)
            for order, (user, mine) in enumerate(by_user.items())
        ]
        heapq.heapify(heap)
        while heap and slots > 0:
            _, _, order, user, pos = heapq.heappop(heap)
            mine = by_user[user]
            if self._place(mine[pos], plan):
                slots -= 1
            if pos + 1 < len(mine):
                nxt = mine[pos + 1]
                heapq.heappush(heap, (nxt.priority, nxt.account.service, order, user, pos + 1))
        limiter = self.limiter
        for _, _, _, user, pos in heap:
            out_of_quota = self.is_paced(user) and (
                user in self._refused or not limiter.has_quota(user)
            )
            for s in by_user[user][pos:]:
                if s.samples and out_of_quota:
                    plan.throttled.append(s.key)
                else:
                    plan.deferred.append(s.key)
        return plan

    def _place_reserves(self, by_user: dict[str, list[Stream]], slots: int,
                        plan: RunningPlan) -> int:
        """Place each lower priority level's reserve first (``LanePolicy.reserve``), taking
        the placed streams out of ``by_user``; returns the slots they took. Within a level
        the least served user goes first, then its least recently served stream. Cost:
        nothing unless more than one priority level is present; then a sort of the lower
        levels' streams."""
        assert self.lanes is not None
        reserve, cap = self.lanes.reserve(slots), self.lanes.reserves(slots)
        if not reserve:
            return 0
        best = min(mine[0].priority for mine in by_user.values())
        lower = [s for mine in by_user.values() for s in mine if s.priority > best]
        if not lower:
            return 0
        lower.sort(key=lambda s: (s.priority, s.account.service, s.last_served))
        taken: set[Hashable] = set()
        used = 0
        level, in_level = None, 0
        for s in lower:
            if used >= cap:
                break
            if s.priority != level:
                level, in_level = s.priority, 0
            if in_level >= reserve:
                continue
            taken.add(s.key)
            if self._place(s, plan):  # a throttled one is not placed: the next one goes
                in_level += 1
                used += 1
        if taken:
            for user, mine in list(by_user.items()):
                rest = [s for s in mine if s.key not in taken]
                if rest:
                    by_user[user] = rest
                else:
                    del by_user[user]
        return used

    def _place(self, s: Stream, plan: RunningPlan) -> bool:
        """Run ``s`` if its user has quota for it (or it does not sample)."""
        if s.samples and self.is_paced(s.user):
            if not self._charge(s.key, s.user):
                plan.throttled.append(s.key)
                return False
            del self._charged[s.key]
            self._charged_streams.append(s)
        s.account.service += 1
        return True

    def settle(
        self,
        scheduled: Container[Hashable],
        still_prefilling: Callable[[Hashable], bool],
        report: bool = False,
        all_dispatched: bool = False,
    ) -> list[Settlement]:
        """The one refund point: return the token of every charge not dispatched to sample.

        A charge was dispatched if its request is in ``scheduled`` and, for a step that
        may end a prompt, ``still_prefilling(key)`` is False. With ``report``, returns one
        ``Settlement`` per charge (for the event log); else an empty list. Cost: one
        membership test per charged request, or, with ``all_dispatched`` (the caller
        knows that every stream of this step's ``plan_running`` was scheduled and that
        none of them was a step that may end a prompt), only the rotation stamp.
        """
        step = self._step
        refund = self.limiter.refund
        result: list[Settlement] = []
        refunded: set[Hashable] = set()
        # Per charged stream, also counted for /metrics: one attribute increment (two in a
        # bulk window of drafts: its dispatches, from which its accepted drafts are told).
        counting = self.count_dispatches
        if all_dispatched and not counting:
            for s in self._charged_streams:
                s.last_served = step
                s.stats.tokens += 1
        elif all_dispatched:
            for s in self._charged_streams:
                s.last_served = step
                s.stats.tokens += 1
                s.dispatched += 1
        else:
            for s in self._charged_streams:
                if s.key in scheduled and (s.samples == SAMPLES or not still_prefilling(s.key)):
                    s.last_served = step
                    s.stats.tokens += 1
                    if counting:
                        s.dispatched += 1
                else:
                    refund(s.user)
                    s.stats.refunds += 1
                    refunded.add(s.key)
        if report:
            result = [Settlement(s.key, s.user, s.key not in refunded) for s in self._charged_streams]
        self._charged_streams = []
        if self._inner_charged or self._inner_admitted:
            self._settle_inner(scheduled, still_prefilling, all_dispatched)
        for key, user in self._charged.items():
            if self._starved.get(user) == key:
                del self._starved[user]  # had its turn; if not admitted, it asks again
            ok = key in scheduled and not still_prefilling(key)
            counts = self.stats.of(user)
            if ok:
                counts.tokens += 1
                stream = self._streams.get(key)
                if stream is not None:
                    stream.last_served = step
                    if counting:
                        stream.dispatched += 1
            else:
                refund(user)
                counts.refunds += 1
            if report:
                result.append(Settlement(key, user, ok))
        self._charged.clear()
        return result

    def _settle_inner(self, scheduled: Container[Hashable],
                      still_prefilling: Callable[[Hashable], bool],
                      all_dispatched: bool) -> None:
        """``settle`` for inner charges: the tokens of each one not dispatched go back."""
        if not all_dispatched:
            for s in self._inner_charged:
                if not (s.key in scheduled and (s.samples == SAMPLES or not still_prefilling(s.key))):
                    self._refund_inner(s.levels)
        self._inner_charged = []
        starved = self._inner_starved
        for key, levels in self._inner_admitted.items():
            for level in levels:
                if starved.get(level) == key:
                    del starved[level]  # had its turn; if not admitted, asks again
            if not (key in scheduled and not still_prefilling(key)):
                self._refund_inner(levels)
        self._inner_admitted.clear()

    def sampling_streams(self) -> list[Stream]:
        """The running streams charged a token this step (at their user's level, an inner
        level or both), between ``plan_running`` and ``settle``: the ones whose
        speculative drafts may ask for more (``_drafts``). Cost: a list of them, plus a
        set when some stream names an inner level."""
        charged = self._charged_streams
        if not self._inner_charged:
            return list(charged)
        keys = {s.key for s in charged}
        return list(charged) + [s for s in self._inner_charged if s.key not in keys]

    @property
    def names_inner_levels(self) -> bool:
        """Whether some open stream names an inner level (an application or end user)."""
        return self._inner_streams > 0

    @property
    def refused_any(self) -> bool:
        """Whether some user or inner level was refused a token in the last step."""
        return bool(self._refused) or bool(self._inner_refused)

    def idle_wait_seconds(self, quota_needs: Iterable[Stream | str | None]) -> float:
        """How long nothing can run: 0 if some request can, else up to ``MAX_IDLE_WAIT_S``.

        ``quota_needs`` has one item per request that could be scheduled: its stream (whose
        user's and end user's quota its next step needs) or its user, or None for a step
        that needs none (an intermediate prefill chunk), which can always run.
        """
        limiter = self.limiter
        seen: set[object] = set()
        earliest: int | None = None
        for need in quota_needs:
            if need is None:
                return 0.0
            if isinstance(need, Stream):  # a request's user and the inner levels it names
                who: object = need.levels or need.user
                if who in seen:
                    continue
                seen.add(who)
                ready = limiter.ready_at_ns(need.user)
                for level in need.levels:
                    ready = max(ready, self.inner.ready_at_ns(level))  # type: ignore[arg-type]
            else:
                if need in seen:
                    continue
                seen.add(need)
                ready = limiter.ready_at_ns(need)  # never before its own reading of the clock
            if ready <= limiter.now_ns():
                return 0.0
            if earliest is None or ready < earliest:
                earliest = ready
        if earliest is None:
            return 0.0
        return min(MAX_IDLE_WAIT_S, max(0.0, (earliest - limiter.now_ns()) / 1e9))

    # -- housekeeping ---------------------------------------------------------------

    def forget(self, alive: Callable[[Hashable], bool]) -> None:
        """Drop the streams of requests that are gone, and users left with none."""
        self._streams = {k: s for k, s in self._streams.items() if alive(k)}
        users = {s.user for s in self._streams.values()}
        self._accounts = {u: a for u, a in self._accounts.items() if u in users}
        self._inner_streams = sum(1 for s in self._streams.values() if s.levels)
        if self._inner_starved:
            self._inner_starved = {e: k for e, k in self._inner_starved.items()
                                   if k in self._streams}


def _stream_counts(streams: Sequence[Stream]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in streams:
        counts[s.user] = counts.get(s.user, 0) + 1
    return counts


def _turn(s: Stream) -> tuple[int, int]:
    """Sort key of a user's streams: priority first, then least recently served."""
    return (s.priority, s.last_served)
