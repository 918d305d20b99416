"""HTTP 400 for requests that pacing cannot serve, before they reach the engine.

An ASGI middleware for vLLM's API server (``--middleware tokenpace.engine.RequestGuard``;
``tokenpace serve`` adds it when pacing is on). It refuses:

- beam search (``use_beam_search: true``): vLLM runs it as many hidden requests whose
  tokens the scheduler cannot attribute to one stream, so the rate promise would not hold;
- a malformed ``vllm_xargs.output_rate_user`` (not a string, empty, over 256
  characters): the client meant a specific identity, and pacing it as anonymous instead
  would silently share someone else's quota;
- a malformed ``vllm_xargs.output_rate_tokens_per_second`` (not a number, a boolean,
  zero or less, not finite): a gateway that sends rates has a broken tenant
  configuration, and the engine would otherwise only log and ignore the value. A
  well-formed rate passes whether or not the engine trusts it (``trusted_gateway``):
  the guard does not know the engine's configuration, and the engine decides.

It also serves ``POST /tokenpace/v1/rates``, the rate control of a trusted gateway
(``_control``: authenticated with the engine key by itself), the book of ended requests
(``POST /tokenpace/v1/aborted``, ``_aborted``; ``GET /tokenpace/v1/ended``, ``_ended``),
and puts the engine's scheduling policy and capacity on its ``/health`` answers
(``_health_headers``).

With identity headers configured (``user_header``: a trusted proxy in front names each
request's user), it reads them from every request, refuses a repeated, malformed or
(``require_user_header``) missing one on a POST with HTTP 400, and hands the identity to
the engine's side of the API server for the request's handling (``_header_identity``).

It only looks inside JSON bodies of POST requests (a body without a content type is
read as JSON, as FastAPI reads it) and passes everything else through untouched; a body
that is not valid JSON is left to vLLM, which answers it with its own 400. Each JSON
POST's ``x-request-id`` is noted as an exchange under way until it is answered or its
client leaves (``_aborted.EndedExchanges``). The scheduler does not trust this layer: a
malformed identity that still arrives (for example through the Python API) is paced as
anonymous, never a crash.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..pacing import LimitsError, validate_rate, validate_rate_version, validate_user_id
from ._asgi import ASGIApp, Message, Receive, Scope, Send, error_payload, send_json
from ._aborted import ABORTED_PATH, ENDED_EXCHANGES, exchange_of, handle_aborted
from ._auth import carries_key, keys_of
from ._ended import ENDED_PATH, handle_ended
from ._config import PacingConfig
from ._control import RATES_PATH, handle_rates
from ._header_identity import HeaderIdentity, HeaderRefused, enter, leave, read_identity
from ._health_headers import with_engine_headers
from ._metrics import METRICS_PATHS, handle_metrics
from ._xargs import (
    APPLICATION_END_USER_RATE_EXTRA_ARG,
    APPLICATION_EXTRA_ARG,
    APPLICATION_RATE_EXTRA_ARG,
    END_USER_EXTRA_ARG,
    END_USER_RATE_EXTRA_ARG,
    RATE_EXTRA_ARG,
    RATE_VERSION_EXTRA_ARG,
    USER_EXTRA_ARG,
)


# The pacing fields of ``vllm_xargs`` and how each is checked (its param is its path).
_XARG_CHECKS: tuple[tuple[str, Callable[[Any, str], object]], ...] = (
    (USER_EXTRA_ARG, validate_user_id),
    (RATE_EXTRA_ARG, validate_rate),
    (RATE_VERSION_EXTRA_ARG, validate_rate_version),
    (END_USER_EXTRA_ARG, validate_user_id),
    (END_USER_RATE_EXTRA_ARG, validate_rate),
    (APPLICATION_EXTRA_ARG, validate_user_id),
    (APPLICATION_RATE_EXTRA_ARG, validate_rate),
    (APPLICATION_END_USER_RATE_EXTRA_ARG, validate_rate),
)


class RequestRefused(ValueError):
    """A request body pacing cannot serve; ``param`` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_request_body(body: Any) -> None:
    """Raise ``RequestRefused`` if a parsed JSON request body cannot be paced."""
    if not isinstance(body, dict):
        return
    if body.get("use_beam_search") is True:
        raise RequestRefused(
            "beam search is not supported while output pacing is on: its hidden requests "
            "cannot share one per-user token rate; use sampling (n >= 1) instead",
            "use_beam_search",
        )
    xargs = body.get("vllm_xargs")
    if not isinstance(xargs, dict):
        return
    for field, validate in _XARG_CHECKS:
        if field in xargs:
            param = f"vllm_xargs.{field}"
            try:
                validate(xargs[field], param)
            except LimitsError as exc:
                raise RequestRefused(str(exc), param) from None

def _is_json(scope: Scope) -> bool:
    """Whether FastAPI would read the body as JSON: no content type, ``application/json``
    or ``application/*+json``."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (
                kind.startswith(b"application/") and kind.endswith(b"+json"))
    return True


_UNREAD: Any = object()


class RequestGuard:
    """ASGI middleware: buffers a JSON POST body, checks it, replays it downstream."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._identity_config: PacingConfig | None = _UNREAD

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        config = self._identity_config
        if config is _UNREAD:
            config = self._read_identity_config(scope)
        if config is None or scope["type"] != "http":
            await self._guard(scope, receive, send)
            return
        # With trusted_gateway, whether the request is keyed (the gateway, when it has no
        # identity header): a SHA-256 per configured key per request.
        keyed = config.trusted_gateway and carries_key(scope, keys_of(scope))
        try:
            identity = read_identity(scope.get("headers", ()), config, keyed)
        except HeaderRefused as exc:
            if scope.get("method") == "POST":
                await _send_error(send, str(exc), exc.param)
                return
            identity = HeaderIdentity()  # a GET generates nothing: no identity needed
        token = enter(identity)
        try:
            await self._guard(scope, receive, send)
        finally:
            leave(token)

    def _read_identity_config(self, scope: Scope) -> PacingConfig | None:
        """The server's pacing configuration if it has identity headers (read once, from
        the running server's own configuration, like ``scheduling_policy``)."""
        state = getattr(scope.get("app"), "state", None)
        vllm_config = getattr(state, "vllm_config", None)
        if vllm_config is None:
            return None  # not set up yet (or not vLLM's app): looked for again next time
        config = PacingConfig.of_started(vllm_config)
        if config is not None and not config.headers_pace():
            config = None
        self._identity_config = config
        return config

    async def _guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") == "/health":
            await self.app(scope, receive, with_engine_headers(scope, send))
            return
        if scope["type"] == "http" and scope.get("path") == RATES_PATH:
            await handle_rates(scope, receive, send)  # checks the engine key itself
            return
        if scope["type"] == "http" and scope.get("path") == ABORTED_PATH:
            await handle_aborted(scope, receive, send)  # behind EngineAuth when keyed
            return
        if scope["type"] == "http" and scope.get("path") == ENDED_PATH:
            await handle_ended(scope, receive, send)  # the engine's key, when it has one
            return
        if scope["type"] == "http" and scope.get("method") == "GET" \
                and scope.get("path") in METRICS_PATHS:
            await handle_metrics(self.app, scope, receive, send)  # vLLM's page + pacing
            return
        if scope["type"] != "http" or scope.get("method") != "POST" or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        exchange = exchange_of(scope)
        if exchange is not None:
            ENDED_EXCHANGES.begin(exchange)
        try:
            await self._checked(scope, receive, send)
        finally:  # answered, refused, failed or cancelled (the client left): ended here
            if exchange is not None:
                ENDED_EXCHANGES.end(exchange)

    async def _checked(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A JSON POST: its body read whole and checked, then replayed downstream."""
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            check_request_body(json.loads(body))
        except RequestRefused as exc:
            await _send_error(send, str(exc), exc.param)
            return
        except (ValueError, RecursionError):  # not JSON, not UTF-8, absurdly nested: vLLM answers
            pass

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_error(send: Send, message: str, param: str | None) -> None:
    await send_json(send, 400, error_payload(400, message, "BadRequestError", param))
