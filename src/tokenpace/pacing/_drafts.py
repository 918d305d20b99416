"""Speculative tokens: granted before a step, cut to the quota, given back when unused.

With speculative decoding a decode step verifies ``d`` draft tokens besides the one it
always samples, and delivers between 1 and ``d + 1`` tokens. The planner charges the one
sure token as for any decode step; this module accounts for the drafts around it:

1. **Before the step** (``grant``): a stream that was charged its sure token asks for
   its ``d`` drafts; it gets what every level's quota allows right now (its user's, its
   application's, its end user's: the smallest of them, all taken or given back
   together), and the scheduler verifies only that many. A throttled user's drafts are
   therefore never verified beyond its quota, and with quota to spare nothing changes.
2. **When the step's results arrive** (``settle``): every granted draft that was not
   delivered goes back: those vLLM did not schedule (the step was not dispatched, or vLLM
   cut the drafts for its token budget), those the target model rejected, and accepted
   ones vLLM dropped (past a stop or ``max_tokens``). A user's delivered tokens, not its
   verified drafts, are what its rate bounds. (With an event log the unscheduled ones go
   back at the refund point instead, ``give_back``, so that the log can say which were
   scheduled.)
3. **In bulk windows** (``bulk_steps``, ``charge_delivered``): when every paced user's GCRA
   room covers all it could take over the next ``S`` steps (each of its running streams
   a sure token and every draft, each step), no stream asks for its drafts; they are
   all verified, and every ``S`` steps (or sooner: when a request waits for admission
   or a rate changes) each user is charged the tokens its requests delivered beyond the
   sure ones, from their output lengths; a request that ends or is preempted inside a
   window is counted then. The adapter opens such windows only where those lengths tell
   every delivered token once the results of the steps in flight are in (one step at
   most), no KV connector, no event log, no inner level and no streaming-input session.

Drafts vLLM schedules without asking (it pads a resumed or remotely prefilled request's
first decode step with placeholder drafts) are counted as owed (``owe``): the user pays
them back before its next grant.

Bound. Counting each delivered token at the instant its step was dispatched, a user's
tokens in any window of W seconds stay within ``(W + 0.1) x R + 1 + k x n``, where ``k``
is the number of speculative tokens and ``n`` the user's requests whose drafts were in
flight when the window began: rejected drafts of a step dispatched before the window
are returned inside it. ``n`` is 1 for a user with one stream. A bulk window does not
change it: what a user delivers in a window fits in the room it had when the window
opened, as if it had all been granted then, and a charge that lands later moves the TAT
at least as far as the same charge at dispatch would have.

Cost in a bulk window: no operation per request and step besides counting each dispatch
(``StepPlanner.count_dispatches``); once per window, the adapter's pass over the running
requests (a ``len`` and a few integer operations each) and one GCRA update per user.
Otherwise, only for streams that have drafts, one GCRA update per level per step (``take``
grants ``d`` tokens at once) and one refund per stream whose drafts were not all
delivered; nothing when speculative decoding is off. ``grant_all`` and ``settle`` take a
step's streams at once, with the arithmetic of a stream paced at its user's level alone
(the usual case) in their own loop: no call per stream. Nothing here knows vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ._limiter import OutputRateLimiter, _grant
from ._planner import Stream, _Account

BULK_MAX_STEPS = 16
"""The longest bulk window: the most steps a user's accepted drafts wait to be charged."""
BULK_MIN_STEPS = 2
"""A shorter window than this is not opened: its pass would cost more than it saves."""


class DraftBook:
    """The draft-token accounts of one scheduler (its user and inner limiters)."""

    def __init__(self, limiter: OutputRateLimiter, inner: OutputRateLimiter) -> None:
        self.limiter = limiter
        self.inner = inner
        self.granted = 0
        """Draft tokens granted so far (before any return), for tests and metrics."""
        self.returned = 0
        """Draft tokens given back so far (not dispatched, or rejected)."""
        self.windows = 0
        """Bulk windows opened so far (``bulk_steps`` found room), for tests and metrics."""
        self._window: set[_Account] = set()  # the users paced when the last window opened

    def grant(self, stream: Stream, want: int, now: int) -> int | None:
        """Grant up to ``want`` drafts to ``stream`` at ``now``: the most every level
        allows.

        None when no level paces the stream (nothing counted: it keeps all its drafts).
        Levels are taken in turn, each asked for what the ones before it granted; the
        surplus of the earlier ones is given back at once (exact: the same instant).
        Cost: one GCRA update for a stream of its user alone (the usual case).
        """
        if not stream.levels:
            # The user's state straight from the limiter (``take`` without its two calls).
            bucket = self.limiter._buckets.get(stream.user) if want > 0 else None
            got = (self.limiter.take(stream.user, want, now) if bucket is None
                   else _grant(bucket, want, now))
            if got:
                self.granted += got
                stream.stats.tokens += got
            return got
        granted = want
        taken: list[tuple[OutputRateLimiter, object, int]] = []
        for limiter, key in self._levels(stream):
            if granted <= 0:
                break
            got = limiter.take(key, granted, now)  # type: ignore[arg-type]
            if got is None:
                continue
            taken.append((limiter, key, got))
            if got < granted:
                granted = got
        if not taken:
            return None
        for limiter, key, got in taken:
            if got > granted:
                limiter.refund(key, got - granted)  # type: ignore[arg-type]
        self.granted += granted
        stream.stats.tokens += granted
        return granted

    def grant_all(self, streams: Sequence[Stream],
                  now: int) -> tuple[list[Stream], list[int], bool]:
        """``grant`` for each of ``streams`` that proposes drafts (``Stream.drafts``), all at
        ``now``: the streams paced at some level, what each was granted (in order), and
        whether any got fewer than it proposed.

        Cost per stream with drafts and no inner level: a dict lookup and a GCRA update
        (``_grant``), no method call; with inner levels, ``grant``."""
        buckets = self.limiter._buckets
        take = self.limiter.take
        paced: list[Stream] = []
        granted: list[int] = []
        cut = False
        total = 0
        for s in streams:
            want = s.drafts
            if not want:
                continue
            if s.levels:
                got = self.grant(s, want, now)  # counts itself
                if got is None:
                    continue
            else:
                bucket = buckets.get(s.user)
                if bucket is None:
                    got = take(s.user, want, now)
                    if got is None:  # not paced: it keeps every draft, nothing counted
                        continue
                else:  # ``_grant(bucket, want, now)``, without the call
                    now_scaled = now * bucket.scale
                    tat = bucket.tat
                    restart = tat <= now_scaled
                    if restart:
                        tat = now_scaled
                    room = bucket.burst - (tat - now_scaled)
                    if room < 0:
                        got = 0
                    else:
                        got = room // bucket.interval + 1
                        if got > want:
                            got = want
                        bucket.tat = tat + got * bucket.interval
                        bucket.refundable = got if restart else bucket.refundable + got
                if got:
                    total += got
                    s.stats.tokens += got
            if got < want:
                cut = True
            paced.append(s)
            granted.append(got)
        self.granted += total
        return paced, granted, cut

    def settle(self, streams: Sequence[Stream], granted: Sequence[int],
               delivered: Sequence[int], sure: int, now: int) -> list[int] | None:
        """The step's results: stream ``i`` was granted ``granted[i]`` drafts and delivered
        ``delivered[i]`` tokens, of which the first ``sure`` were not drafts; every granted
        draft beyond those delivered goes back. Returns how many each gave back when some
        did (for an event log), else None.

        Cost per stream: a few integer operations; for one that gives back, at its user's
        level alone, a dict lookup and the refund's arithmetic (``refund_at``'s), no
        method call; with inner levels, ``give_back``."""
        buckets = self.limiter._buckets
        returned: list[int] | None = None
        total = 0
        for i, (s, got, n) in enumerate(zip(streams, granted, delivered)):
            accepted = n - sure
            back = got - accepted if accepted > 0 else got
            if back <= 0:
                continue
            if returned is None:
                returned = [0] * len(granted)
            returned[i] = back
            if s.levels:
                self.give_back(s, back, now)  # counts itself
                continue
            bucket = buckets.get(s.user)
            if bucket is not None and bucket.refundable:
                k = back if back <= bucket.refundable else bucket.refundable
                bucket.refundable -= k
                now_scaled = now * bucket.scale
                tat = bucket.tat - k * bucket.interval
                bucket.tat = tat if tat > now_scaled else now_scaled
            total += back
            stats = s.stats
            stats.tokens -= back
            stats.refunds += back
        self.returned += total
        return returned

    def bulk_steps(self, streams: Mapping[_Account, int], per_step: int, now: int) -> int:
        """How many steps, up to ``BULK_MAX_STEPS``, a bulk window can last: the most
        ``S`` such that each paced user in ``streams`` (user -> its running streams) is
        granted ``S x streams x per_step`` tokens by its GCRA state at ``now`` (the burst
        tolerance, less what its TAT leads the clock by). 0 when that is under
        ``BULK_MIN_STEPS`` for some user (the last window's users are still the ones
        ``charge_delivered`` charges); otherwise the window is counted as opened
        (``windows``). Users without a rate take no part. Cost: one
        ``OutputRateLimiter.room`` per user."""
        limiter = self.limiter
        steps = BULK_MAX_STEPS
        paced: set[_Account] = set()
        for account, n in streams.items():
            room = limiter.room(account.user, now)
            if room is None:
                continue
            paced.add(account)
            fit = room // (n * per_step)
            if fit < steps:
                if fit < BULK_MIN_STEPS:
                    return 0
                steps = fit
        self._window = paced
        self.windows += 1
        return steps

    def charge_delivered(self, delivered: Mapping[_Account, int], now: int) -> None:
        """Charge each user the drafts its requests delivered in the last bulk window
        (user -> tokens delivered beyond the sure ones), at ``now``, whether or not it
        has room (``OutputRateLimiter.take_owed``: they were covered when the window
        opened). Only users paced when the window opened are charged: the sure tokens of
        one that was not were not counted as dispatched. Cost: one GCRA update per user."""
        total = 0
        window = self._window
        for account, n in delivered.items():
            if account in window and self.limiter.take_owed(account.user, n, now):
                total += n
                account.stats.tokens += n
        self.granted += total

    def owe(self, stream: Stream, n: int) -> bool:
        """Count ``n`` drafts that were scheduled without a grant, at every level; False
        when no level paces the stream (nothing counted, nothing to give back later)."""
        if n <= 0:
            return False
        now = self.limiter.now_ns()
        counted = False
        for limiter, key in self._levels(stream):
            counted |= limiter.take_owed(key, n, now)  # type: ignore[arg-type]
        if counted:
            self.granted += n
            stream.stats.tokens += n
        return counted

    def give_back(self, stream: Stream, n: int, now: int | None = None) -> None:
        """Return ``n`` drafts of ``stream`` at every level (not dispatched, or rejected);
        ``now``: the limiter's clock read by the caller (None: read here).

        A level's refund is ignored past what it granted since its TAT last restarted
        (``OutputRateLimiter.refund``), so a late return can never create quota.
        """
        if n <= 0:
            return
        self.limiter.refund_at(stream.user, n, now)
        for level in stream.levels:
            self.inner.refund_at(level, n, now)  # type: ignore[arg-type]
        self.returned += n
        stream.stats.tokens -= n
        stream.stats.refunds += n

    def _levels(self, stream: Stream) -> list[tuple[OutputRateLimiter, object]]:
        """The user first, then the inner levels it names, outermost first."""
        levels: list[tuple[OutputRateLimiter, object]] = [(self.limiter, stream.user)]
        levels.extend((self.inner, level) for level in stream.levels)
        return levels
