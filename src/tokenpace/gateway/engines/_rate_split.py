"""One paced tenant's rate R over the several engines its streams run on.

Each engine paces a user with its own limiter, so a tenant whose streams run on two
engines would get R on each. The gateway instead gives each engine a share of R in
proportion to the tenant's streams there (``split``) and moves the shares as streams
start and end:

- a stream starting on engine e lowers the other engines' shares first, by control call
  (``POST /tokenpace/v1/rates``), and waits for their answers; only then is the request
  sent to e, carrying e's new share in ``vllm_xargs`` (which raises e);
- a stream ending lowers whichever shares go down, waits, then raises the rest.

So the shares in force never add up to more than R at any instant. Every change carries
a version, increasing in this process (seeded from the wall clock, so a restarted gateway
numbers above its predecessor); an engine adopts a rate only if its version is not older
than the last it adopted for that user, so a request with an older, higher share that
reaches its engine late cannot undo a lower one. Over any window of W seconds the
tenant's tokens stay within (W + 0.1) R (each engine's burst is a tenth of a second of its
own share) plus a few tokens per engine (a step in flight when a rate drops, a stream's
last tokens between its end in the engine and in the gateway).

Updates of one tenant run one at a time (``SplitBook.hold``: a lock per tenant in
process, ``LocalSplitBook``; with several replicas a lock in the state store, see ``_shared_split``), so the
lower-then-raise order holds between them too. The policy (``split``) is pure;
``RateSplitter`` does the calls through an injected ``send``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import httpx

from ...engine import RATES_PATH

logger = logging.getLogger("tokenpace.gateway")

Send = Callable[[str, str, float, int], Awaitable[None]]
"""``send(engine_url, user, rate, version)``: one control call; raises when it fails."""


def split(rate: float, streams: Mapping[str, int]) -> dict[str, float]:
    """Each engine's share of ``rate``, in proportion to the tenant's streams there
    (engines without a stream get none)."""
    total = sum(n for n in streams.values() if n > 0)
    return {url: rate * n / total for url, n in streams.items() if n > 0} if total else {}


class NewerVersion(Exception):
    """The engine holds a newer version of the user's rate than the one sent."""

    def __init__(self, version: int) -> None:
        super().__init__(f"the engine holds a newer rate version ({version})")
        self.version = version


class SplitFailed(Exception):
    """A share could not be lowered: starting the stream would let the shares exceed R."""


class Split:
    """One tenant's split as one change sees it: its streams per engine (on every replica),
    the share each engine paces it at, and the last version given out for it."""

    def __init__(self, streams: dict[str, int], applied: dict[str, float],
                 version: int) -> None:
        self.streams = streams
        self.applied = applied
        self.version = version
        self.added: dict[str, int] = {}  # this change's own streams, per engine (+1 / -1)

    def add(self, url: str) -> None:
        self.streams[url] = self.streams.get(url, 0) + 1
        self.added[url] = self.added.get(url, 0) + 1

    def leave(self, url: str) -> None:
        self.added[url] = self.added.get(url, 0) - 1
        left = self.streams.get(url, 0) - 1
        if left > 0:
            self.streams[url] = left
        else:
            self.streams.pop(url, None)
            self.applied.pop(url, None)  # no stream there: its share paces nothing


class SplitBook(ABC):
    """Where the splits are kept, and how one change of a tenant's split at a time is
    ensured: in this process (``LocalSplitBook``), or in the state store for several
    replicas (``_shared_split``)."""

    @abstractmethod
    def hold(self, tenant_id: str) -> AbstractAsyncContextManager[Split]:
        """The tenant's split for one change, which nobody else changes meanwhile."""

    async def start(self) -> None:
        """Start background work (none in process)."""

    async def close(self) -> None:
        """Stop background work (none in process)."""


class LocalSplitBook(SplitBook):
    """The splits in this process: an ``asyncio.Lock`` per tenant."""

    def __init__(self, wall_ns: Callable[[], int] = time.time_ns) -> None:
        self._wall_ns = wall_ns
        self._tenants: dict[str, tuple[Split, asyncio.Lock, list[int]]] = {}

    @asynccontextmanager
    async def hold(self, tenant_id: str) -> AsyncIterator[Split]:
        """Kept while any change holds or waits for it, forgotten by the last one when the
        tenant has no stream left (none waits for its lock then, so no one can go on with
        a forgotten split)."""
        entry = self._tenants.get(tenant_id)
        if entry is None:
            entry = self._tenants[tenant_id] = (Split({}, {}, self._wall_ns()),
                                                asyncio.Lock(), [0])
        split_, lock, users = entry
        users[0] += 1
        try:
            async with lock:
                split_.added = {}
                yield split_
        finally:
            users[0] -= 1
            if users[0] == 0 and not split_.streams and self._tenants.get(tenant_id) is entry:
                del self._tenants[tenant_id]

    def shares(self, tenant_id: str) -> dict[str, float]:
        """What each engine paces the tenant at now."""
        entry = self._tenants.get(tenant_id)
        return {} if entry is None else dict(entry[0].applied)


class RateSplitter:
    """The shares of every tenant spread over engines, kept in ``book``."""

    def __init__(self, send: Send, book: SplitBook | None = None,
                 wall_ns: Callable[[], int] = time.time_ns) -> None:
        self._send = send
        self._wall_ns = wall_ns
        self.book = book if book is not None else LocalSplitBook(wall_ns)
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_version = 0

    def _version(self, split_: Split) -> int:
        """A version above every one given out for the tenant before, here, by another
        replica (the shared book keeps the last one) or by a predecessor process (seeded
        from the wall clock), and above every one this process gave out (a tenant's split
        forgotten while idle starts again above them, even if the wall clock stepped back)."""
        split_.version = max(split_.version + 1, self._wall_ns(), self._last_version + 1)
        self._last_version = split_.version
        return split_.version

    def shares(self, tenant_id: str) -> dict[str, float]:
        """What each engine paces the tenant at now (in-process book; for tests)."""
        assert isinstance(self.book, LocalSplitBook), "a shared split is read from the store"
        return self.book.shares(tenant_id)

    async def start(self, tenant_id: str, rate: float, url: str) -> tuple[float, int]:
        """A stream of ``tenant_id`` (rate R = ``rate``) is about to be sent to ``url``:
        lower the other engines' shares, then return ``url``'s share and version for the
        request to carry. Raises ``SplitFailed`` (nothing changed) when a lowering fails,
        and the book's own error (``StateUnavailable``) when it cannot be read or written.

        Cost: a lock and a few dict updates while the tenant runs on one engine (two
        store round trips with a shared book); one control call per other engine of the
        tenant when it spreads.
        """
        async with self.book.hold(tenant_id) as split_:
            split_.add(url)
            target = split(rate, split_.streams)
            try:
                await self._lower(tenant_id, split_, target, keep=url)
            except SplitFailed:
                split_.leave(url)
                raise
            split_.applied[url] = target[url]
            return target[url], self._version(split_)

    def end(self, tenant_id: str, rate: float | None, url: str) -> None:
        """A stream started with ``start`` ended (however): move the shares in the
        background (``rate``: the tenant's rate now; None when it is no longer paced)."""
        task = asyncio.get_running_loop().create_task(self._ended(tenant_id, rate, url))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ended(self, tenant_id: str, rate: float | None, url: str) -> None:
        try:
            async with self.book.hold(tenant_id) as split_:
                split_.leave(url)
                if rate is not None and split_.streams:
                    await self._rebalance(tenant_id, split_, rate)
        except Exception as exc:  # the shares stay lower than they could be: never above R
            logger.warning("tenant %r: could not move its rate shares after a stream "
                           "ended: %s: %s", tenant_id, type(exc).__name__, exc)

    async def _rebalance(self, tenant_id: str, split_: Split, rate: float) -> None:
        target = split(rate, split_.streams)
        try:
            await self._lower(tenant_id, split_, target)
        except SplitFailed:
            return  # the shares stay where they are: at most R, some of it idle
        raises = [(u, r) for u, r in target.items() if r > split_.applied.get(u, 0.0)]
        await self._apply(tenant_id, split_, raises, raising=True)

    async def _lower(self, tenant_id: str, split_: Split, target: dict[str, float],
                     keep: str | None = None) -> None:
        lowers = [(u, target[u]) for u, applied in split_.applied.items()
                  if u != keep and u in target and target[u] < applied]
        if not await self._apply(tenant_id, split_, lowers, raising=False):
            raise SplitFailed(tenant_id)

    async def _apply(self, tenant_id: str, split_: Split, changes: list[tuple[str, float]],
                     raising: bool) -> bool:
        """Send ``changes`` together; True when all were answered. A failed lowering keeps
        the engine's old share in ``applied`` (it may still be in force); a failed raise
        leaves it at its lower value (the tenant gets less, never more)."""
        if not changes:
            return True
        version = self._version(split_)
        results = await asyncio.gather(
            *(self._send(u, tenant_id, r, version) for u, r in changes), return_exceptions=True)
        ok = True
        for (u, r), result in zip(changes, results):
            if isinstance(result, BaseException):
                ok = False
                if isinstance(result, NewerVersion):  # number every later change above it
                    split_.version = max(split_.version, result.version)
                logger.warning("tenant %r: could not %s its rate share on %s to %.3g tok/s: "
                               "%s: %s", tenant_id, "raise" if raising else "lower", u, r,
                               type(result).__name__, result)
            else:
                split_.applied[u] = r
        return ok

    async def drain(self) -> None:
        """Wait until every ended stream's move of the shares is done (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.book.close()


def http_send(clients: Mapping[str, httpx.AsyncClient], timeout_s: float = 5.0) -> Send:
    """``send`` over the engines' background clients (they carry the engine key).

    An engine that answers with a newer version than the one sent holds a rate from an
    earlier gateway process whose clock was ahead: ``NewerVersion``, after which the
    splitter numbers past it, so its next change is adopted."""

    async def send(url: str, user: str, rate: float, version: int) -> None:
        resp = await clients[url].post(RATES_PATH, json={"rates": {user: {
            "rate": rate, "version": version}}}, timeout=timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        held = resp.json()["rates"][user]
        if held.get("version") is not None and held["version"] > version:
            raise NewerVersion(int(held["version"]))

    return send
