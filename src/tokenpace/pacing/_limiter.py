"""GCRA output-token limiter: one theoretical arrival time (TAT) per user.

GCRA is a token bucket without an explicit token count. A user's TAT is the instant at
which its next token is "due" if tokens flowed exactly at its rate. A token is granted
while the TAT leads the clock by at most the burst tolerance, and each grant moves the TAT
forward by one emission interval (1/rate). Tokens therefore come out evenly spaced instead
of a whole second's worth at the start of each second.

Exact arithmetic: a rate is taken as the fraction ``p/q`` it was written as (2.5 -> 5/2).
Each user's times are stored multiplied by ``s = p / gcd(p, 1e9)``, so the emission interval
``1e9 * q / p`` nanoseconds becomes the integer ``1e9 * q / gcd(p, 1e9)`` and every operation
is integer addition and comparison. Nothing drifts, however many tokens pass, and
fractional rates are as exact as whole ones. Most rates divide 1e9 (20, 2.5, 1e9 tok/s), so
their scale is 1 and their times are plain nanoseconds.

Guarantee: in any window of W seconds a user is granted (net of refunds) at most
``(W + 0.1) * rate + 1`` tokens; a user who asks all the time gets at least
``W * rate - 1``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Protocol, TypeVar

from ._limits import UserRateLimits

BURST_NS = 100_000_000
"""Burst tolerance. It must cover at least one engine step: credit a user earns between
two steps that are further apart than this would expire and the user would fall short of
its rate."""

_NS_PER_S = 1_000_000_000


@functools.lru_cache(maxsize=4096)
def _constants(rate: float) -> tuple[int, int, int]:
    """(scale, interval, burst) of a rate, in its scaled time unit; see the module docstring.

    Cached: ``Fraction(repr(rate))`` costs several microseconds, and the idle cleanup drops
    and re-creates the state of every user that is under its rate (in a busy engine, most
    of them) every 256 steps. Equal rates also share the same ``int`` objects, which lets
    the planner's step pass reuse one ``now * scale`` for all users of a scale (an identity
    test instead of a multiplication).
    """
    frac = Fraction(repr(rate))
    common = math.gcd(frac.numerator, _NS_PER_S)
    scale = frac.numerator // common
    return scale, _NS_PER_S * frac.denominator // common, BURST_NS * scale


class _Bucket:
    """One user's GCRA state, in that user's scaled time unit (nanoseconds x ``scale``)."""

    __slots__ = ("rate", "scale", "interval", "burst", "tat", "refundable")

    def __init__(self, rate: float, now_ns: int) -> None:
        self.rate = rate
        self.scale, self.interval, self.burst = _constants(rate)
        self.tat = now_ns * self.scale
        # Grants that a refund may still return; refunds beyond this are ignored so that a
        # caller's bookkeeping error can never hand out extra tokens. Counted since the
        # TAT last restarted from the clock (a grant while the TAT was not ahead of it):
        # refunding grants from before a restart could not move the TAT anyway (a refund
        # never takes it behind the clock, which it was at the restart), so forgetting
        # them changes no decision, and the count stays a small cached int instead of
        # growing with every token of a user under its rate (an allocation per step).
        self.refundable = 0

    def rescale(self, rate: float) -> None:
        """Switch to a new rate, keeping the TAT's instant (rounded up: never earlier)."""
        old_scale = self.scale
        self.rate = rate
        self.scale, self.interval, self.burst = _constants(rate)
        self.tat = -((-self.tat * self.scale) // old_scale)


def _grant(bucket: _Bucket, n: int, now_ns: int) -> int:
    """Grant up to ``n >= 1`` tokens on ``bucket`` at ``now_ns``; how many were granted.

    GCRA admits the i-th of them while ``tat + i * interval - now <= burst``. A TAT not
    ahead of the clock restarts from now (see ``_Bucket.refundable``).
    """
    now_scaled = now_ns * bucket.scale
    tat = bucket.tat
    restart = tat <= now_scaled  # under its rate: restart from now (see refundable)
    if restart:
        tat = now_scaled
    room = bucket.burst - (tat - now_scaled)
    if room < 0:
        return 0
    if n == 1:  # the usual claim (one stream): room >= 0 grants it, no division
        granted = 1
    else:
        granted = room // bucket.interval + 1
        if granted > n:
            granted = n
    bucket.tat = tat + granted * bucket.interval
    bucket.refundable = granted if restart else bucket.refundable + granted
    return granted


class Claim(Protocol):
    """What ``take_claims`` reads (``user``, ``need``) and writes (``granted``)."""

    user: str
    need: int
    granted: int | None


C = TypeVar("C", bound=Claim)


class OutputRateLimiter:
    """Per-user GCRA limiter for output tokens.

    The limiter only keeps accounts; it makes no queueing or fairness decision. The
    scheduler asks ``try_take`` before dispatching a step that samples a token for a
    user's request and calls ``refund`` if that step was not dispatched after all.
    """

    def __init__(
        self,
        limits: UserRateLimits,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._limits = limits
        self.clock_ns = clock_ns
        self._buckets: dict[str, _Bucket] = {}
        self.generation = 0
        """Bumped whenever a bucket may have been dropped or a rate changed: a bucket (or
        "not paced") obtained from ``bucket`` stays valid while this is unchanged."""

    @property
    def limits(self) -> UserRateLimits:
        return self._limits

    def now_ns(self) -> int:
        """The limiter's clock, for callers that compare against ``ready_at_ns``."""
        return self.clock_ns()

    def set_limits(self, limits: UserRateLimits) -> None:
        """Replace the rate table without a restart.

        Users keep their TAT (as an instant), so a user who just used its burst cannot
        gain a fresh one by a reload; users who become unpaced lose their state.
        """
        self._limits = limits
        self.generation += 1
        for user in list(self._buckets):
            bucket = self._buckets[user]
            rate = limits.rate(user)
            if rate is None:
                del self._buckets[user]
            elif rate != bucket.rate:
                bucket.rescale(rate)

    def try_take(self, user: str) -> bool:
        """Grant one output token to ``user`` now, or refuse without changing anything."""
        bucket = self._buckets.get(user)
        now = self.clock_ns()
        if bucket is None:
            rate = self._limits.rate(user)
            if rate is None:
                return True
            bucket = self._buckets[user] = _Bucket(rate, now)
        now_scaled = now * bucket.scale
        if bucket.tat <= now_scaled:  # under its rate: restart from now (see refundable)
            bucket.tat = now_scaled + bucket.interval
            bucket.refundable = 1
            return True
        if bucket.tat - now_scaled > bucket.burst:
            return False
        bucket.tat += bucket.interval
        bucket.refundable += 1
        return True

    def take(self, user: str, n: int, now_ns: int) -> int | None:
        """Grant up to ``n`` tokens to ``user`` at ``now_ns``; how many were granted.

        Exactly what ``n`` calls of ``try_take`` at the same instant would grant (GCRA
        admits the i-th of them while ``tat + i * interval - now <= burst``). None for a
        user without a rate (not paced: nothing is counted, every token is free).
        """
        bucket = self.bucket(user, now_ns) if n > 0 else None
        return None if bucket is None else _grant(bucket, n, now_ns)

    def take_claims(self, claims: Iterable[C], now_ns: int) -> list[C]:
        """``take`` for many users at one instant: sets each claim's ``granted`` and
        returns the claims granted less than they asked.

        The scheduler calls this once per step with one claim per user that has work,
        so a step costs one dictionary lookup and a few integer operations per user, in
        one loop, instead of a method call per request. A claim of 0 tokens is granted
        None (nothing counted).
        """
        buckets = self._buckets
        short: list[C] = []
        for claim in claims:
            n = claim.need
            if n <= 0:
                claim.granted = None
                continue
            bucket = buckets.get(claim.user)
            if bucket is None:
                rate = self._limits.rate(claim.user)
                if rate is None:
                    claim.granted = None
                    continue
                bucket = buckets[claim.user] = _Bucket(rate, now_ns)
            granted = claim.granted = _grant(bucket, n, now_ns)
            if granted < n:
                short.append(claim)
        return short

    def take_owed(self, user: str, n: int, now_ns: int) -> bool:
        """Count ``n`` tokens that were handed out without asking (the TAT may move past
        the burst tolerance: the user is then refused until it has paid them back).

        For tokens the scheduler cannot withhold: vLLM pads a resumed decode request's
        first step with speculative slots (``pacing._drafts``). False for a user without
        a rate (nothing counted).
        """
        if n <= 0:
            return False
        bucket = self.bucket(user, now_ns)
        if bucket is None:
            return False
        now_scaled = now_ns * bucket.scale
        if bucket.tat <= now_scaled:  # restart from now (see refundable)
            bucket.tat = now_scaled + n * bucket.interval
            bucket.refundable = n
        else:
            bucket.tat += n * bucket.interval
            bucket.refundable += n
        return True

    def bucket(self, user: str, now_ns: int) -> _Bucket | None:
        """The user's GCRA state (created at ``now_ns`` if absent), or None if not paced.

        For callers that grant many single tokens per step in their own loop (the
        planner's fast path): they cache the result per user and ask again when
        ``generation`` changed. A single grant on it is exactly ``try_take``'s update::

            now_scaled = now_ns * b.scale
            if b.tat <= now_scaled: b.tat = now_scaled + b.interval; b.refundable = 1
            elif b.tat - now_scaled <= b.burst: b.tat += b.interval; b.refundable += 1
        """
        bucket = self._buckets.get(user)
        if bucket is None:
            rate = self._limits.rate(user)
            if rate is None:
                return None
            bucket = self._buckets[user] = _Bucket(rate, now_ns)
        return bucket

    def room(self, user: str, now_ns: int) -> int | None:
        """How many tokens ``take`` would grant ``user`` at ``now_ns`` if asked for any
        number, without taking them (its state is created if absent, as ``bucket``'s);
        None for a user without a rate. Cost: a dict lookup and a few integer operations."""
        bucket = self.bucket(user, now_ns)
        if bucket is None:
            return None
        lead = bucket.tat - now_ns * bucket.scale  # a TAT behind the clock restarts at now
        room = bucket.burst - lead if lead > 0 else bucket.burst
        return room // bucket.interval + 1 if room >= 0 else 0

    def refund(self, user: str, n: int = 1) -> None:
        """Return ``n`` tokens granted to ``user`` by earlier grants (at most those it
        may still return, see ``_Bucket.refundable``).

        The TAT moves back by ``n`` intervals, but never behind the clock: a TAT in the
        past and a TAT equal to now grant the same, so the refund is exact either way (and
        equal to ``n`` refunds of one).
        """
        self.refund_at(user, n, None)

    def refund_at(self, user: str, n: int, now_ns: int | None) -> None:
        """``refund`` with the clock read by the caller (None: read it here), for callers
        that return many users' tokens at one instant. ``now_ns`` must be a reading of this
        limiter's clock that is not in the future."""
        bucket = self._buckets.get(user)
        if bucket is None or bucket.refundable == 0:
            return
        if n > bucket.refundable:
            n = bucket.refundable
        bucket.refundable -= n
        now_scaled = (self.clock_ns() if now_ns is None else now_ns) * bucket.scale
        tat = bucket.tat - n * bucket.interval
        bucket.tat = tat if tat > now_scaled else now_scaled

    def has_quota(self, user: str) -> bool:
        """Whether ``try_take`` would succeed now (one reading of the clock; nothing taken).
        Compare ``ready_at_ns`` only with a reading taken after it: it is never before its
        own."""
        bucket = self._buckets.get(user)
        if bucket is None:
            return True
        return bucket.tat - self.clock_ns() * bucket.scale <= bucket.burst  # as try_take

    def ready_at_ns(self, user: str) -> int:
        """The first instant (clock ns, not before now) at which ``try_take`` succeeds."""
        now = self.clock_ns()
        bucket = self._buckets.get(user)
        if bucket is None:
            return now
        ready = -((bucket.burst - bucket.tat) // bucket.scale)  # ceil((tat - burst) / p)
        return ready if ready > now else now

    def cleanup_idle_users(self) -> int:
        """Drop users whose TAT is not in the future; return how many were dropped.

        Such a user behaves exactly like a new one (its next grant starts from now), so
        dropping it never changes a decision; it only bounds memory.
        """
        now = self.clock_ns()
        idle = [u for u, b in self._buckets.items() if b.tat <= now * b.scale]
        for user in idle:
            del self._buckets[user]
        if idle:
            self.generation += 1
        return len(idle)

    def tracked_users(self) -> int:
        """Number of users with limiter state (for metrics and tests)."""
        return len(self._buckets)
