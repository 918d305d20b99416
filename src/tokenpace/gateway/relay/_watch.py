"""Interrupting a request's wait when its client goes away or its time runs out.

A request's handler waits on other things in turn (its engine slot, the engine's answer,
the engine's stream); two events must interrupt whichever wait is under way: the client
disconnecting and ``request_timeout`` running out. ``ClientWatch`` notices the first;
``Guard`` is the block that either event interrupts.

``Guard`` is a cancel scope for one task built on asyncio's own ``Task.cancel`` and
``Task.uncancel`` (as ``asyncio.timeout`` is), not anyio's: anyio's ``CancelScope`` costs
10-19 us to enter and leave on this machine (its backend lookup asks sniffio, which asks
asyncio, for the current task on every use) and a request passes three of them.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive


class Guard:
    """``async with guard:``: a block that ``cancel()`` (or the deadline) interrupts.

    The interrupted block ends quietly, with ``cancelled_caught`` set, as anyio's
    ``CancelScope`` would; a cancellation from elsewhere (the server shutting down)
    passes through. ``cancel()`` before the block starts interrupts its first wait.

    Cost: one timer handle when there is a deadline, and two attribute reads and a
    counter read per block; nothing per await inside it.
    """

    __slots__ = ("_deadline", "_task", "_timer", "_baseline", "_requested", "_inside",
                 "cancelled_caught")

    def __init__(self, deadline: float | None = None) -> None:
        self._deadline = deadline  # on the running loop's clock (loop.time())
        self._task: asyncio.Task[object] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._baseline = 0
        self._requested = False
        self._inside = False
        self.cancelled_caught = False

    def cancel(self) -> None:
        if self._requested:
            return
        self._requested = True
        if self._inside:
            assert self._task is not None
            self._task.cancel()

    async def __aenter__(self) -> Guard:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._baseline = task.cancelling()
        self._inside = True
        if self._requested:
            task.cancel()  # cancelled before the block began: its first wait ends it
        elif self._deadline is not None:
            self._timer = asyncio.get_running_loop().call_at(self._deadline, self.cancel)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> bool:
        self._inside = False
        if self._timer is not None:
            self._timer.cancel()
        if not self._requested:
            return False
        task = self._task
        assert task is not None
        if kind is None:
            # Interrupted too late (no wait was left in the block), or the waited-on code
            # swallowed the cancellation: take back one that is still pending, so it
            # cannot hit the code after the block.
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                if task.cancelling() > self._baseline + 1:
                    raise  # also cancelled from elsewhere
            task.uncancel()
            return False
        if task.uncancel() <= self._baseline and issubclass(kind, asyncio.CancelledError):
            self.cancelled_caught = True
            return True
        return False


class ClientWatch:
    """Notices the client going away while the gateway waits on something else.

    After the body is read the only message the server can still deliver is
    ``http.disconnect``, so one task waits for it and cancels the guards it handed out.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.gone = False
        self._guards: list[Guard] = []
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                for guard in self._guards:
                    guard.cancel()
                return

    def guard(self, deadline: float | None = None) -> Guard:
        """A block that the client's going away (or ``deadline``, on the loop's clock)
        interrupts."""
        guard = Guard(deadline)
        if self.gone:
            guard.cancel()
        self._guards.append(guard)
        return guard

    def stop(self) -> None:
        self._task.cancel()
