"""Noticing, while the gateway waits on something else, that the client went away."""

from __future__ import annotations

import asyncio

import anyio
from starlette.types import Receive


class ClientWatch:
    """Notices the client going away while the gateway waits on something else.

    After the body is read the only message the server can still deliver is
    ``http.disconnect``, so one task waits for it and cancels whatever is registered.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.gone = False
        self._scopes: list[anyio.CancelScope] = []
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                for scope in self._scopes:
                    scope.cancel()
                return

    def guard(self, scope: anyio.CancelScope) -> anyio.CancelScope:
        if self.gone:
            scope.cancel()
        self._scopes.append(scope)
        return scope

    def stop(self) -> None:
        self._task.cancel()
