"""The ASGI types and the one JSON answer that the engine's middlewares send themselves.

vLLM builds its API server on Starlette, but the middlewares here speak plain ASGI (no
Starlette import, so ``tokenpace serve`` and the gateway load them in milliseconds)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def error_payload(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """An error in OpenAI's (and vLLM's) wire format, so SDKs raise the matching error."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


async def send_json(send: Send, status: int, payload: dict[str, Any],
                    headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": data})


async def send_error(send: Send, status: int, message: str, kind: str,
                     param: str | None = None) -> None:
    """An error answer in OpenAI's format (``error_payload``)."""
    await send_json(send, status, error_payload(status, message, kind, param))
