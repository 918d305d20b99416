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

Updates of one tenant run one at a time (a lock per tenant), so the lower-then-raise
order holds between them too. The policy (``split``) is pure; ``RateSplitter`` does the
calls through an injected ``send``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import httpx

from ..engine import RATES_PATH

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


@dataclass
class _Tenant:
    streams: dict[str, int] = field(default_factory=dict)
    applied: dict[str, float] = field(default_factory=dict)  # what each engine paces at
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # starts and ends holding or waiting for the lock: the state must stay


class RateSplitter:
    """The shares of every tenant spread over engines, kept in this process."""

    def __init__(self, send: Send, wall_ns: Callable[[], int] = time.time_ns) -> None:
        self._send = send
        self._wall_ns = wall_ns
        self._version = 0
        self._tenants: dict[str, _Tenant] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def version(self) -> int:
        """A version above every one given out before, here and by a predecessor process."""
        self._version = max(self._version + 1, self._wall_ns())
        return self._version

    def advance_past(self, version: int) -> None:
        """Number every later change above ``version`` (one an engine already holds)."""
        self._version = max(self._version, version)

    def shares(self, tenant_id: str) -> dict[str, float]:
        """What each engine paces the tenant at now (for tests and /health)."""
        state = self._tenants.get(tenant_id)
        return {} if state is None else dict(state.applied)

    async def start(self, tenant_id: str, rate: float, url: str) -> tuple[float, int]:
        """A stream of ``tenant_id`` (rate R = ``rate``) is about to be sent to ``url``:
        lower the other engines' shares, then return ``url``'s share and version for the
        request to carry. Raises ``SplitFailed`` (nothing changed) when a lowering fails.

        Cost: a lock and a few dict updates while the tenant runs on one engine; one
        control call per other engine of the tenant when it spreads.
        """
        state = self._tenants.setdefault(tenant_id, _Tenant())
        state.users += 1
        try:
            async with state.lock:
                state.streams[url] = state.streams.get(url, 0) + 1
                target = split(rate, state.streams)
                try:
                    await self._lower(tenant_id, state, target, keep=url)
                except SplitFailed:
                    self._leave(state, url)
                    raise
                state.applied[url] = target[url]
                return target[url], self.version()
        finally:
            self._release(tenant_id, state)

    def end(self, tenant_id: str, rate: float | None, url: str) -> None:
        """A stream started with ``start`` ended (however): move the shares in the
        background (``rate``: the tenant's rate now; None when it is no longer paced)."""
        state = self._tenants.get(tenant_id)
        if state is None:
            return
        state.users += 1
        task = asyncio.get_running_loop().create_task(self._ended(tenant_id, state, rate, url))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ended(self, tenant_id: str, state: _Tenant, rate: float | None, url: str) -> None:
        try:
            async with state.lock:
                self._leave(state, url)
                if rate is not None and state.streams:
                    await self._rebalance(tenant_id, state, rate)
        finally:
            self._release(tenant_id, state)

    def _release(self, tenant_id: str, state: _Tenant) -> None:
        """One user of the state is done; the last one forgets a tenant without streams
        (none waits for its lock then, so no one can go on with a forgotten state)."""
        state.users -= 1
        if state.users == 0 and not state.streams and self._tenants.get(tenant_id) is state:
            del self._tenants[tenant_id]

    def _leave(self, state: _Tenant, url: str) -> None:
        left = state.streams.get(url, 0) - 1
        if left > 0:
            state.streams[url] = left
        else:
            state.streams.pop(url, None)
            state.applied.pop(url, None)  # no stream there: its share paces nothing

    async def _rebalance(self, tenant_id: str, state: _Tenant, rate: float) -> None:
        target = split(rate, state.streams)
        try:
            await self._lower(tenant_id, state, target)
        except SplitFailed:
            return  # the shares stay where they are: at most R, some of it idle
        raises = [(u, r) for u, r in target.items() if r > state.applied.get(u, 0.0)]
        await self._apply(tenant_id, state, raises, raising=True)

    async def _lower(self, tenant_id: str, state: _Tenant, target: dict[str, float],
                     keep: str | None = None) -> None:
        lowers = [(u, target[u]) for u, applied in state.applied.items()
                  if u != keep and u in target and target[u] < applied]
        if not await self._apply(tenant_id, state, lowers, raising=False):
            raise SplitFailed(tenant_id)

    async def _apply(self, tenant_id: str, state: _Tenant, changes: list[tuple[str, float]],
                     raising: bool) -> bool:
        """Send ``changes`` together; True when all were answered. A failed lowering keeps
        the engine's old share in ``applied`` (it may still be in force); a failed raise
        leaves it at its lower value (the tenant gets less, never more)."""
        if not changes:
            return True
        version = self.version()
        results = await asyncio.gather(
            *(self._send(u, tenant_id, r, version) for u, r in changes), return_exceptions=True)
        ok = True
        for (u, r), result in zip(changes, results):
            if isinstance(result, BaseException):
                ok = False
                if isinstance(result, NewerVersion):
                    self.advance_past(result.version)
                logger.warning("tenant %r: could not %s its rate share on %s to %.3g tok/s: %s",
                               tenant_id, "raise" if raising else "lower", u, r, result)
            else:
                state.applied[u] = r
        return ok

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


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
