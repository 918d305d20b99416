"""HTTP 401 for every request to a trusted-gateway engine that does not carry its secret.

With ``--trusted-gateway`` the engine believes what a request says about its user and
that user's rate, so whoever can reach the port can generate without a budget, borrow a
tenant's identity and change that tenant's rate for all its running streams. vLLM's own
``--api-key`` guards only ``/v1/...``: ``/tokenize``, ``/detokenize``, ``/metrics``,
``/pooling`` and the rest stay open. This ASGI middleware
(``--middleware tokenpace.engine.EngineAuth``; ``tokenpace serve --trusted-gateway`` adds
it) closes every route by default and requires ``Authorization: Bearer <key>``, with the
keys vLLM itself uses: ``--api-key`` (one or more), else the ``VLLM_API_KEY`` environment
variable. Only ``/health`` stays open, so load balancers and ``tokenpace up`` can wait for
the engine; it reveals nothing and does no work.

The keys are read from vLLM's parsed arguments (``app.state.args``) at the first request,
because vLLM builds middleware before it parses them into the app. With no key at all the
middleware fails closed: every guarded request gets 401 and the log says why.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import MutableMapping
from typing import Any


OPEN_PATHS = frozenset({"/health"})
"""Routes that stay open: liveness only."""

from ._asgi import ASGIApp, Receive, Scope, Send, error_payload, send_json

logger = logging.getLogger("tokenpace.engine")


def configured_keys(args: Any, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """vLLM's rule: ``--api-key`` values, else ``VLLM_API_KEY``; empty strings do not count."""
    env = os.environ if environ is None else environ
    given = getattr(args, "api_key", None) or [env.get("VLLM_API_KEY")]
    return [key for key in given if key]


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def bearer_matches(headers: list[tuple[bytes, bytes]], digests: list[bytes]) -> bool:
    """True if an ``Authorization: Bearer`` header carries one of the keys.

    Digests of equal length are compared with ``hmac.compare_digest``, against every key
    (no early exit), so the time taken says nothing about how close a guess came.
    """
    value = next((v for name, v in headers if name == b"authorization"), None)
    if value is None:
        return False
    scheme, _, token = value.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = key_digest(token.strip())
    match = False
    for known in digests:
        match |= hmac.compare_digest(digest, known)
    return match


def keys_of(scope: Scope) -> list[str]:
    """The API keys of the vLLM server serving ``scope`` (its parsed arguments)."""
    return configured_keys(getattr(getattr(scope.get("app"), "state", None), "args", None))


def carries_key(scope: Scope, keys: list[str]) -> bool:
    """Whether the request's ``Authorization: Bearer`` is one of ``keys``."""
    return bearer_matches(list(scope.get("headers", ())), [key_digest(k) for k in keys])


class EngineAuth:
    """ASGI middleware: every route but ``/health`` needs one of the engine's API keys."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._digests: list[bytes] | None = None

    def _keys(self, scope: Scope) -> list[bytes]:
        if self._digests is None:
            state = getattr(scope.get("app"), "state", None)
            keys = configured_keys(getattr(state, "args", None))
            if not keys:
                logger.error("tokenpace: EngineAuth has no API key (--api-key or VLLM_API_KEY): "
                             "every request but /health is refused")
            self._digests = [key_digest(k) for k in keys]
        return self._digests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path in OPEN_PATHS or bearer_matches(list(scope.get("headers", ())), self._keys(scope)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send_json(send, 401, error_payload(
            401, "this engine serves a trusted gateway: send its API key as "
                 "'Authorization: Bearer <key>'", "AuthenticationError"),
            headers=((b"www-authenticate", b"Bearer"),))
