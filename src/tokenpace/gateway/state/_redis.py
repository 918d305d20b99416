"""State shared by every gateway replica, in one Redis server.

Round trips per request: one to reserve the budgets, one to take a queued place, one to
trade it for the running slots (tenant concurrency and engine ``max_inflight`` together),
one to release, one to settle. Fair-queue charges are not sent per token: they collect in
process and go out in one pipeline per flush interval (default 50 ms), together with the
dispatch costs of requests that took their slots without queueing (lane shares) and the
renewal of every lease this replica holds (one script for all of them, every third of the
lease time). A dispatcher's read of the shared counters and lane costs is one pipeline.

Failure handling, in one place (:meth:`RedisStore._run`): every call is bounded by
``timeout_s`` (socket timeouts and an outer deadline, no client retries), so no request
waits longer than that on Redis. After a failure the store is unhealthy and answers
:class:`StateUnavailable` at once, without touching the network, until ``probe_s`` has
passed; then the next call tries again, and success makes it healthy. Reconnection is the
client pool's: a broken connection is dropped and the next call dials a new one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from redis.exceptions import NoScriptError, RedisError, ResponseError

from ...fairness import BudgetRefusal, BudgetSpec, period_end, period_start
from . import _scripts
from ._base import (
    LANE_KEEP_S,
    Admission,
    FairnessView,
    Reservation,
    SlotClaim,
    SlotRefusal,
    StateStore,
    StateUnavailable,
    StoreLease,
)

logger = logging.getLogger("tokenpace.gateway.state")

T = TypeVar("T")


async def _keeping_cancel(call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, re-raising a cancel that arrived while it ran and was lost on the way.

    redis-py bounds a send with ``asyncio.wait_for``, which on Python 3.11 returns the
    result and drops the ``CancelledError`` when the cancel lands just as the send
    completes (CPython gh-86296, fixed in 3.12). The task's cancel count still says it
    was asked: without this, a background loop stopped by ``cancel()`` (lease renewal,
    the split's keep-alive) went on for ever and its ``close()`` never returned. Inside
    ``_run``'s deadline, so a lost cancel from the deadline itself still reads as a
    timeout. Cost: two reads of the task's cancel count per store call.
    """
    task = asyncio.current_task()
    asked = task.cancelling() if task is not None else 0
    try:
        result = await call()
    except asyncio.CancelledError:
        raise
    except BaseException:
        if task is not None and task.cancelling() > asked:
            raise asyncio.CancelledError from None
        raise
    if task is not None and task.cancelling() > asked:
        raise asyncio.CancelledError
    return result


HOMES_PENDING = 100_000
"""Conversation homes kept for the next flush at most (a few MB while Redis is away)."""
ADAPTER_NOTES_PENDING = 100_000
"""Adapter notes kept for the next flush at most (one per engine, adapter and replica)."""
ADAPTER_KEEP_S = 86_400
"""An engine's adapter notes expire this long after the last one was written."""


class RedisStore(StateStore):
    """Budgets, leases and counters in Redis (redis-py's asyncio client)."""

    def __init__(self, url: str, *, lease_s: float = 10.0, timeout_s: float = 0.1,
                 probe_s: float = 0.5, flush_s: float = 0.05, prefix: str = "tokenpace:",
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        """``wall``: unix seconds, which calendar budgets' periods (and keys) follow."""
        from redis.asyncio import BlockingConnectionPool, Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.url = url
        self.lease_ms = int(lease_s * 1000)
        self.timeout_s = timeout_s
        self.probe_s = probe_s
        self.flush_s = flush_s
        self.prefix = prefix
        self._clock = clock
        self._wall = wall
        # No retries: a retry would double the longest wait; the caller decides what a
        # failure means (closed: 503, open: the fallback store). A call finding all 64
        # connections busy waits for one (within the call's own deadline) instead of
        # failing at once: a burst of requests is not an outage.
        self._redis = Redis.from_pool(BlockingConnectionPool.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0, max_connections=64,
            timeout=timeout_s, decode_responses=True))
        self._scripts = {name: self._redis.register_script(getattr(_scripts, name))
                         for name in ("RESERVE", "SETTLE", "LEVELS", "ACQUIRE", "RENEW",
                                      "RELEASE", "HELD", "LIFT", "LANES", "ADMIT", "DISPATCH", "CHARGES",
                                      "FINISH", "SPLIT_READ", "SPLIT_WRITE", "SPLIT_ALIVE")}
        self.healthy = True
        self._retry_at = 0.0
        self._probing = False
        self.failures = 0
        self.lost_leases = 0
        self._leases: dict[str, StoreLease] = {}
        self._charges: dict[tuple[str, str], float] = {}
        self._dispatches: dict[str, float] = {}  # lane share key -> cost not yet sent
        self._homes: dict[str, tuple[str, int]] = {}  # conversation -> (url, ttl) not yet sent
        self._adapter_notes: dict[tuple[str, str], str] = {}  # (engine url, field) -> value
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._last_renew = 0.0

    # -- the one place that talks to Redis ----------------------------------------------

    async def _run(self, call: Callable[[], Awaitable[T]]) -> T:
        probe = False
        if not self.healthy:
            # While down, one call at a time probes (after probe_s); the others fail at once.
            if self._probing or self._clock() < self._retry_at:
                raise StateUnavailable("state store unreachable (waiting before the next try)")
            self._probing = probe = True
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await _keeping_cancel(call)
        except (RedisError, OSError, TimeoutError) as exc:  # all mean "no answer"
            # redis-py strips a known error code from the message (NoScriptError says "No
            # matching script"), so NOSCRIPT is matched by type; BUSY keeps its word.
            outage = isinstance(exc, NoScriptError) or str(exc).startswith(("NOSCRIPT", "BUSY"))
            if isinstance(exc, ResponseError) and not outage:
                raise  # a bug in a script, not an outage
            self.failures += 1
            self._retry_at = self._clock() + self.probe_s
            if self.healthy:
                logger.warning("state store %s unreachable: %s: %s", self.url_redacted,
                               type(exc).__name__, exc)
            self.healthy = False
            raise StateUnavailable(f"state store unreachable: {type(exc).__name__}") from None
        finally:
            if probe:
                self._probing = False
        if not self.healthy:
            logger.warning("state store %s reachable again", self.url_redacted)
            self.healthy = True
        return result

    async def _script(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        script = self._scripts[name]
        return await self._run(lambda: script(keys=list(keys), args=list(args)))

    @property
    def url_redacted(self) -> str:
        from ._config import StateConfig
        return StateConfig(url=self.url).redacted_url() or ""

    def _k(self, kind: str, name: str) -> str:
        return f"{self.prefix}{kind}:{name}"

    # -- budgets ---------------------------------------------------------------------

    def _budget_args(self, tenant: str, budgets: Sequence[BudgetSpec]) -> tuple[list[str], list[str]]:
        """Each budget's key and its three numbers (``_scripts``). A calendar budget's key
        names its period's start on this replica's wall clock (one clock read, and two
        date computations per calendar budget)."""
        keys: list[str] = []
        args: list[str] = []
        wall = self._wall() if any(b.calendar for b in budgets) else 0.0
        for b in budgets:
            if b.calendar is None:
                keys.append(self._k("b", f"{tenant}:{b.key}"))
                args += (repr(float(b.tokens)), repr(b.refill_per_s), "-1")
            else:
                start = period_start(b.calendar, wall)
                keys.append(self._k("b", f"{tenant}:{b.key}@{int(start)}"))
                args += (repr(float(b.tokens)), "0", repr(period_end(b.calendar, wall) - wall))
        return keys, args

    async def reserve(self, tenant: str, budgets: Sequence[BudgetSpec],
                      cost: float) -> Reservation | BudgetRefusal:
        if not budgets:
            return Reservation(tenant, (), cost, self)
        keys, args = self._budget_args(tenant, budgets)
        out = await self._script("RESERVE", keys, [repr(float(cost)), *args])
        if out[0] == "ok":
            return Reservation(tenant, tuple(budgets), cost, self, tuple(map(float, out[1:])),
                               _ends_in(budgets, args))
        return _refusal(out, budgets, cost)

    async def settle(self, reservation: Reservation, actual: float) -> None:
        if not reservation.budgets or reservation.cost == actual:
            return
        keys, args = self._budget_args(reservation.tenant, reservation.budgets)
        await self._script("SETTLE", keys, [repr(float(reservation.cost - actual)), *args])

    async def budget_levels(self, tenant: str, budgets: Sequence[BudgetSpec]) -> dict[str, float]:
        if not budgets:
            return {}
        keys, args = self._budget_args(tenant, budgets)
        out = await self._script("LEVELS", keys, args)
        return {b.key: float(v) for b, v in zip(budgets, out)}

    # -- slots -----------------------------------------------------------------------

    async def acquire(self, claims: Sequence[SlotClaim],
                      releasing: StoreLease | None = None) -> StoreLease | SlotRefusal:
        lease = StoreLease(tuple(c.key for c in claims), self)
        keys = [self._k("s", c.key) for c in claims]
        args: list[Any] = [lease.id, self.lease_ms, len(claims),
                           *(-1 if c.limit is None else c.limit for c in claims)]
        # A lease of this store is given back inside the same script; one of another store
        # (the fallback's) separately, after.
        same = releasing is not None and releasing.store is self and not releasing.released
        if same:
            assert releasing is not None
            keys += [self._k("s", key) for key in releasing.keys]
            keys.append(self._k("r", releasing.id))
        args.append(releasing.id if same and releasing is not None else "")
        out = await self._script("ACQUIRE", keys, args)
        if int(out[0]) != 0:
            return SlotRefusal(claims[int(out[0]) - 1], int(out[1]))
        self._leases[lease.id] = lease
        if releasing is not None:
            if same:
                releasing.released = True
                self._leases.pop(releasing.id, None)
            else:
                await releasing.store.release(releasing)
        return lease

    async def release(self, lease: StoreLease) -> None:
        if lease.released:
            return
        lease.released = True
        self._leases.pop(lease.id, None)
        # If Redis does not answer, the lease expires by itself within the lease time.
        await self._script("RELEASE", [*(self._k("s", key) for key in lease.keys),
                                       self._k("r", lease.id)], [lease.id, self.lease_ms])

    async def held(self, keys: Sequence[str]) -> dict[str, int]:
        out = await self._script("HELD", [self._k("s", key) for key in keys], [])
        return {key: int(n) for key, n in zip(keys, out)}

    async def renew(self) -> None:
        """Push every held lease's expiry a lease time ahead (one script for all)."""
        leases = [lease for lease in self._leases.values() if not lease.released]
        if not leases:
            return
        keys = [k for lease in leases
                for k in (self._k("r", lease.id), *(self._k("s", key) for key in lease.keys))]
        args = [a for lease in leases for a in (lease.id, len(lease.keys))]
        lost = int(await self._script("RENEW", keys, [self.lease_ms, *args]))
        if lost:
            self.lost_leases += lost
            logger.warning("%d slot leases had vanished from the state store (restarted "
                           "without its data, or this replica stalled) and were taken again", lost)

    # -- fair queue ------------------------------------------------------------------

    def charge(self, lane: str, tenant: str, amount: float) -> None:
        key = (lane, tenant)
        self._charges[key] = self._charges.get(key, 0.0) + amount

    def count_dispatch(self, lane: str, cost: float) -> None:
        self._dispatches[lane] = self._dispatches.get(lane, 0.0) + cost

    async def home_read(self, key: str, ttl_s: float) -> str | None:
        # GETEX (Redis 6.2): the read and the new expiry in one command.
        return await self._run(lambda: self._redis.getex(self._k("h", key), ex=int(ttl_s)))

    def home_write(self, key: str, url: str, ttl_s: float) -> None:
        if len(self._homes) < HOMES_PENDING or key in self._homes:
            self._homes[key] = (url, int(ttl_s))
        # else: Redis has been away for a while; a home not shared is a hint lost (the
        # replica's own table still has it).

    def adapter_note(self, url: str, field: str, value: str) -> None:
        key = (url, field)
        if len(self._adapter_notes) < ADAPTER_NOTES_PENDING or key in self._adapter_notes:
            self._adapter_notes[key] = value

    async def adapters_read(self, urls: Sequence[str]) -> dict[str, dict[str, str]]:
        async def read() -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            for url in urls:
                pipe.hgetall(self._k("a", url))
            return await pipe.execute()
        if not urls:
            return {}
        return dict(zip(urls, await self._run(read)))

    async def flush(self) -> None:
        """Send the charges, dispatch costs, conversation homes and adapter notes
        collected since the last flush (one pipeline)."""
        if not self._charges and not self._dispatches and not self._homes \
                and not self._adapter_notes:
            return
        charges, self._charges = self._charges, {}
        dispatches, self._dispatches = self._dispatches, {}
        homes, self._homes = self._homes, {}
        notes, self._adapter_notes = self._adapter_notes, {}
        by_engine: dict[str, dict[str, str]] = {}
        for (url, field), value in notes.items():
            by_engine.setdefault(url, {})[field] = value

        by_lane: dict[str, list[str]] = {}
        for (lane, tenant), amount in charges.items():
            by_lane.setdefault(lane, []).extend((tenant, repr(amount)))

        async def send() -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            for key, (url, ttl) in homes.items():  # a lost one is a hint lost: no check
                pipe.set(self._k("h", key), url, ex=ttl)
            for url, fields in by_engine.items():  # likewise: the next heartbeat says it again
                pipe.hset(self._k("a", url), mapping=fields)
                pipe.expire(self._k("a", url), ADAPTER_KEEP_S)
            for lane, args in by_lane.items():  # by hash: see _lanes
                pipe.evalsha(self._scripts["CHARGES"].sha, 2, self._k("v", lane),
                             self._k("m", lane), *args)
            if dispatches:
                self._lanes(pipe, list(dispatches), [LANE_KEEP_S, *map(repr, dispatches.values())])
            return (await pipe.execute(raise_on_error=False))[len(homes) + 2 * len(by_engine):]

        try:
            out = await self._run(send)
        except StateUnavailable:
            for key, amount in charges.items():  # keep them for the next try
                self._charges[key] = self._charges.get(key, 0.0) + amount
            self._keep_dispatches(dispatches)
            self._homes = {**homes, **self._homes}  # newer homes win
            self._adapter_notes = {**notes, **self._adapter_notes}  # newer notes win
            raise
        for (lane, args), result in zip(by_lane.items(), out[:len(by_lane)]):
            if isinstance(result, NoScriptError):  # Redis restarted: run it once, loading it
                await self._script("CHARGES", [self._k("v", lane), self._k("m", lane)], args)
            elif isinstance(result, Exception):
                raise result  # a wrong type under a counter key: a bug, not an outage
        if dispatches:
            try:
                await self._lanes_result(out[-1], list(dispatches),
                                         [LANE_KEEP_S, *map(repr, dispatches.values())])
            except StateUnavailable:
                self._keep_dispatches(dispatches)
                raise

    def _keep_dispatches(self, dispatches: dict[str, float]) -> None:
        for lane, cost in dispatches.items():  # for the next flush
            self._dispatches[lane] = self._dispatches.get(lane, 0.0) + cost

    def _lanes(self, pipe: Any, lanes: Sequence[str], args: Sequence[Any]) -> None:
        """Queue the LANES script on ``pipe`` by its hash (a registered script on a
        pipeline would cost a SCRIPT EXISTS round trip on every execute)."""
        pipe.evalsha(self._scripts["LANES"].sha, len(lanes),
                     *(self._k("d", lane) for lane in lanes), *args)

    async def _lanes_result(self, result: Any, lanes: Sequence[str], args: Sequence[Any]) -> Any:
        """LANES's answer from a pipeline; after a Redis restart (script cache empty) it
        runs once more on its own, which loads it."""
        if isinstance(result, NoScriptError):
            return await self._script("LANES", [self._k("d", lane) for lane in lanes], args)
        if isinstance(result, Exception):
            raise result
        return result

    async def counters(self, lane: str, tenants: Sequence[str]) -> dict[str, float]:
        if not tenants:
            return {}
        values = await self._run(lambda: self._redis.hmget(self._k("v", lane), list(tenants)))
        pending = self._charges
        return {t: float(v or 0.0) + pending.get((lane, t), 0.0) for t, v in zip(tenants, values)}

    def _lift_keys(self, lane: str) -> list[str]:
        return [self._k("v", lane), self._k("m", lane), self._k("q", lane)]

    async def lift(self, lane: str, tenant: str) -> float:
        return float(await self._script("LIFT", self._lift_keys(lane),
                                        [tenant, self._k("s", "queued:")]))

    async def record_dispatch(self, lane: str, cost: float) -> None:
        await self._script("LANES", [self._k("d", lane)], [LANE_KEEP_S, repr(float(cost))])

    async def lane_costs(self, lanes: Sequence[str], window_s: float) -> dict[str, float]:
        if not lanes:
            return {}
        out = await self._script("LANES", [self._k("d", lane) for lane in lanes], [repr(window_s)])
        return self._with_pending(lanes, out)

    def _with_pending(self, lanes: Sequence[str], out: Sequence[Any]) -> dict[str, float]:
        pending = self._dispatches  # this replica's, not yet flushed (as counters adds)
        return {lane: float(v) + pending.get(lane, 0.0) for lane, v in zip(lanes, out)}

    async def read_fairness(self, counters: Mapping[str, Sequence[str]], lanes: Sequence[str],
                            window_s: float) -> FairnessView:
        """One pipeline: an HMGET per lane of counters, the LANES script over ``lanes``.
        Redis's work: O(tenants read + seconds in the window x lanes)."""
        reads = [(lane, list(tenants)) for lane, tenants in counters.items() if tenants]
        if not reads and not lanes:
            return FairnessView({}, None)
        args = [repr(window_s)]

        async def read() -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            for lane, tenants in reads:
                pipe.hmget(self._k("v", lane), tenants)
            if lanes:
                self._lanes(pipe, lanes, args)
            return await pipe.execute(raise_on_error=False)

        out = await self._run(read)
        pending = self._charges
        values: dict[str, dict[str, float]] = {}
        for (lane, tenants), got in zip(reads, out):
            if isinstance(got, Exception):
                raise got
            values[lane] = {t: float(v or 0.0) + pending.get((lane, t), 0.0)
                            for t, v in zip(tenants, got)}
        costs = None
        if lanes:
            costs = self._with_pending(lanes, await self._lanes_result(out[-1], lanes, args))
        return FairnessView(values, costs)

    # -- one script per gateway stage ------------------------------------------------------

    async def admit(self, tenant: str, budgets: Sequence[BudgetSpec], cost: float,
                    queued: SlotClaim, lane: str) -> Admission | BudgetRefusal | SlotRefusal:
        bkeys, bargs = self._budget_args(tenant, budgets)
        place = StoreLease((queued.key,), self)
        keys = [*bkeys, self._k("s", queued.key), *self._lift_keys(lane)]
        args = [len(budgets), repr(float(cost)), *bargs, place.id, self.lease_ms,
                -1 if queued.limit is None else queued.limit, tenant, self._k("s", "queued:")]
        out = await self._script("ADMIT", keys, args)
        if out[0] == "queue":
            return SlotRefusal(queued, int(out[1]))
        if out[0] == "budget":
            return _refusal(out, budgets, cost)
        self._leases[place.id] = place
        return Admission(Reservation(tenant, tuple(budgets), cost, self), place, float(out[1]))

    async def dispatch(self, claims: Sequence[SlotClaim], queued: StoreLease, lane: str,
                       cost: float, keep_s: float = LANE_KEEP_S) -> StoreLease | SlotRefusal:
        if queued.store is not self:
            return await super().dispatch(claims, queued, lane, cost)
        lease = StoreLease(tuple(c.key for c in claims), self)
        keys = [*(self._k("s", c.key) for c in claims), self._k("s", queued.keys[0]),
                self._k("d", lane), self._k("r", queued.id)]
        args = [lease.id, self.lease_ms, len(claims),
                *(-1 if c.limit is None else c.limit for c in claims),
                queued.id, repr(float(cost)), repr(keep_s)]
        out = await self._script("DISPATCH", keys, args)
        if int(out[0]) != 0:
            return SlotRefusal(claims[int(out[0]) - 1], int(out[1]))
        queued.released = True
        self._leases.pop(queued.id, None)
        self._leases[lease.id] = lease
        return lease

    async def finish(self, lease: StoreLease | None, reservation: Reservation | None,
                     actual: float) -> None:
        if (lease is not None and lease.store is not self) or \
                (reservation is not None and reservation.store is not self):
            await super().finish(lease, reservation, actual)  # mixed stores: one by one
            return
        mine_lease = lease is not None and not lease.released
        mine_res = reservation is not None and bool(reservation.budgets) \
            and reservation.cost != actual
        if not mine_lease and not mine_res:
            return
        keys: list[str] = []
        args: list[Any] = [0, "", 0, self.lease_ms]
        if mine_lease:
            assert lease is not None
            lease.released = True
            self._leases.pop(lease.id, None)
            keys += [*(self._k("s", key) for key in lease.keys), self._k("r", lease.id)]
            args[:2] = [len(lease.keys), lease.id]
        if mine_res:
            assert reservation is not None
            bkeys, bargs = self._budget_args(reservation.tenant, reservation.budgets)
            keys += bkeys
            args[2] = repr(float(reservation.cost - actual))
            args += bargs
        await self._script("FINISH", keys, args)

    # -- a paced tenant's rate split (``gateway.engines._shared_split``) -----------------------

    def _split_keys(self, tenant: str, replica: str) -> list[str]:
        return [self._k("sp", tenant), self._k("spl", tenant), self._k("spa", replica)]

    async def split_read(self, tenant: str, replica: str, token: str,
                         lock_ms: int) -> dict[str, str] | None:
        out = await self._script("SPLIT_READ", self._split_keys(tenant, replica),
                                 [token, lock_ms, self.lease_ms, self._k("spa", "")])
        return None if out is None else dict(zip(out[::2], out[1::2]))

    async def split_write(self, tenant: str, replica: str, token: str, body: str) -> None:
        await self._script("SPLIT_WRITE", self._split_keys(tenant, replica),
                           [token, replica, self.lease_ms, self._k("spa", ""), body])

    async def split_alive(self, replica: str) -> None:
        await self._script("SPLIT_ALIVE", [self._k("spa", replica)], [self.lease_ms])

    @property
    def split_renew_s(self) -> float:
        return self.lease_ms / 3000

    # -- life cycle ------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        """Flush charges every ``flush_s``; renew leases every third of the lease time.

        Ends on cancellation or, at its next turn, once ``close`` has begun: a cancellation
        that lands inside a redis-py call can be absorbed there (the call returns, the task
        stays marked as cancelling), and a loop that only waited for it never ended."""
        while not self._closing:
            await asyncio.sleep(self.flush_s)
            if self._closing:
                break
            try:
                await self.flush()
                if self._clock() - self._last_renew >= self.lease_ms / 3000:
                    await self.renew()
                    self._last_renew = self._clock()
                elif not self.healthy:
                    await self._run(self._redis.ping)
            except StateUnavailable:
                pass
            except Exception:  # keep renewing whatever one round did
                logger.exception("state store background work failed")

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            # Cancelled, or ended by the flag within one flush interval (see ``_keep``).
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self.flush()
        except StateUnavailable:
            pass
        await self._redis.aclose()

    def describe(self) -> dict[str, object]:
        return {"backend": "redis", "url": self.url_redacted, "healthy": self.healthy,
                "leases": len(self._leases)}


def _ends_in(budgets: Sequence[BudgetSpec], args: Sequence[str]) -> tuple[float, ...]:
    """Each budget's seconds until its period ends, as sent (calendar budgets; empty when
    none is one: the headroom is computed from the levels)."""
    if not any(b.calendar for b in budgets):
        return ()
    return tuple(float(args[3 * i + 2]) for i in range(len(budgets)))


def _refusal(out: Sequence[Any], budgets: Sequence[BudgetSpec], cost: float) -> BudgetRefusal:
    """``{'budget', index, wait, remaining, reset}`` from a script -> the refusal."""
    return BudgetRefusal(budget=budgets[int(out[1]) - 1], cost=cost,
                         retry_after_s=float(out[2]), remaining=float(out[3]),
                         reset_s=float(out[4]))
