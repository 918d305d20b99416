"""A request's pacing identity from headers that a trusted proxy sets (``user_header``).

A platform with its own front door (nginx or Envoy doing authentication, an AI gateway)
can set a header in one line but cannot safely rewrite JSON bodies, and whatever a client
puts in ``vllm_xargs`` is the client's claim, not the proxy's. With ``user_header`` (and
``application_header``, ``end_user_header``) in the ``tokenpace`` section, a level's
identity is that header's value and nothing else: the body's field for that level is
replaced by the header's value, or removed when the header is absent (the request is then
anonymous at that level), so a body naming another user changes nothing. The proxy must
set the header on every request (overwriting what a client sent) and the engine must be
reachable only through it.

Two places cooperate, both in the API-server process:

- ``RequestGuard`` (the ASGI middleware) reads the headers of every HTTP request, refuses
  a malformed, repeated or (``require_user_header``) missing one with HTTP 400, and puts
  the result in a context variable for the rest of the request's handling;
- a wrapper of ``AsyncLLM.add_request`` (every generating endpoint of vLLM, whatever its
  body format, ends there) writes that identity into the request's sampling parameters,
  after vLLM has copied the body's ``vllm_xargs`` into them and before anything reads
  them (the data-parallel rank pinning, the engine's scheduler).

A request that reaches ``add_request`` without passing the guard (the middleware is
missing from a plain ``vllm serve``) has no header identity: it is paced as anonymous at
each level a header governs, and the log says once how to fix it, so a missing
middleware never lets the body choose. Costs per request: one pass over the request's
headers (tens of entries) in the guard, one dict copy of ``extra_args`` in the wrapper.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable
from typing import Any, NamedTuple

from ..pacing import LimitsError, validate_user_id
from ._config import PacingConfig
from ._identity import ANONYMOUS_USER
from ._warn import warn_once
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


class HeaderIdentity(NamedTuple):
    """The names a request's headers give each level (None: that header was absent);
    ``gateway``: the request carries none of the identity headers and the engine's key
    with ``trusted_gateway``, so it comes from the trusted gateway, whose body fields
    (identity and rates) are honoured as sent."""

    user: str | None = None
    application: str | None = None
    end_user: str | None = None
    gateway: bool = False


class HeaderRefused(ValueError):
    """A request whose identity headers cannot be used; ``param`` names the header."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


_CURRENT: contextvars.ContextVar[HeaderIdentity | None] = contextvars.ContextVar(
    "tokenpace_header_identity", default=None)
"""Set by the guard for the handling of one HTTP request (tasks it starts inherit it)."""


def read_identity(headers: Iterable[tuple[bytes, bytes]], config: PacingConfig,
                  keyed: bool = False) -> HeaderIdentity:
    """The identity ``headers`` (an ASGI scope's: lower-case names, latin-1 values) give.

    ``keyed``: the request carries one of the engine's API keys. With ``trusted_gateway``
    such a request that has none of the identity headers is the gateway's
    (``HeaderIdentity(gateway=True)``); a request with a header is a proxied client's
    whatever key the proxy added.

    Raises ``HeaderRefused`` for a header given more than once (a proxy that appends
    instead of overwriting would let the client's copy through: which one counts would
    be a guess), for a value that is not a usable identity (empty, over 256 characters),
    and for a missing ``user_header`` when ``require_user_header`` is set (but for the
    trusted gateway's requests).
    """
    wanted = {name.encode("latin-1"): level for level, name in (
        ("user", config.user_header), ("application", config.application_header),
        ("end_user", config.end_user_header)) if name is not None}
    found: dict[str, str] = {}
    for name, value in headers:
        level = wanted.get(name)
        if level is None:
            continue
        header = name.decode("latin-1")
        if level in found:
            raise HeaderRefused(f"header {header!r} was given more than once; the proxy in "
                                "front of this engine must set it once, replacing any the "
                                "client sent", header)
        try:
            found[level] = validate_user_id(value.decode("latin-1").strip(), f"header {header!r}")
        except LimitsError as exc:
            raise HeaderRefused(str(exc), header) from None
    if not found and keyed and config.trusted_gateway:
        return HeaderIdentity(gateway=True)
    if config.require_user_header and "user" not in found:
        assert config.user_header is not None
        raise HeaderRefused(f"header {config.user_header!r} is required: this engine takes "
                            "each request's pacing identity from it (require_user_header); "
                            "send requests through the proxy that sets it", config.user_header)
    return HeaderIdentity(**found)


def enter(identity: HeaderIdentity) -> contextvars.Token[HeaderIdentity | None]:
    """Make ``identity`` the current request's (until ``leave``)."""
    return _CURRENT.set(identity)


def leave(token: contextvars.Token[HeaderIdentity | None]) -> None:
    _CURRENT.reset(token)


def current() -> HeaderIdentity | None:
    """The identity the guard read for the request being handled; None outside one."""
    return _CURRENT.get()


_RATE_FIELDS = (RATE_EXTRA_ARG, RATE_VERSION_EXTRA_ARG, END_USER_RATE_EXTRA_ARG,
                APPLICATION_RATE_EXTRA_ARG, APPLICATION_END_USER_RATE_EXTRA_ARG)
"""The body fields that set rates: only the trusted gateway's requests may carry them."""


def apply_identity(params: Any, identity: HeaderIdentity | None, config: PacingConfig) -> None:
    """Replace the header-governed levels of ``params.extra_args`` (``vllm_xargs``).

    The trusted gateway's request (``identity.gateway``) keeps its fields as sent. Any
    other request loses the body's rate fields (a client behind the proxy does not set
    its own rate), and a level whose header is configured gets the header's value, or
    loses the body's value when the header was absent (anonymous user, no application,
    no end user). Levels without a header and everything else in ``extra_args`` stay as
    sent. A new dict is assigned: the caller's may be shared between the prompts of one
    request.
    """
    if identity is not None and identity.gateway:
        return
    extra = dict(getattr(params, "extra_args", None) or {})
    for field in _RATE_FIELDS:
        extra.pop(field, None)
    for field, header, value in (
            (USER_EXTRA_ARG, config.user_header, identity and identity.user),
            (APPLICATION_EXTRA_ARG, config.application_header, identity and identity.application),
            (END_USER_EXTRA_ARG, config.end_user_header, identity and identity.end_user)):
        if header is None:
            continue
        if value:
            extra[field] = value
        else:
            extra.pop(field, None)
    params.extra_args = extra or None


def _warn_unguarded(config: PacingConfig) -> None:
    warn_once(
        "unguarded",
        "tokenpace: %s is set but a request reached the engine without passing "
        "tokenpace.engine.RequestGuard: it is paced as %s (its vllm_xargs cannot choose "
        "an identity). Start vLLM with --middleware tokenpace.engine.RequestGuard "
        "(tokenpace serve adds it)", config.user_header or config.application_header
        or config.end_user_header, ANONYMOUS_USER)


def _config_of(engine: Any) -> PacingConfig | None:
    """The engine client's pacing configuration when it has identity headers (read once)."""
    cached = getattr(engine, "_tokenpace_identity_config", False)
    if cached is False:
        config = PacingConfig.of_started(engine.vllm_config)
        cached = config if config is not None and config.headers_pace() else None
        engine._tokenpace_identity_config = cached
    return cached  # type: ignore[no-any-return]


def install_header_identity(async_llm_cls: type, wrap: Any) -> bool:
    """Wrap ``AsyncLLM.add_request`` (``wrap`` is ``_hooks._wrap``); True if installed."""

    def make(original: Any) -> Any:
        async def add_request(self: Any, request_id: str, prompt: Any, params: Any,
                              *args: Any, **kwargs: Any) -> Any:
            config = _config_of(self)
            # Cost without identity headers: one attribute read per request.
            if config is not None and getattr(params, "extra_args", ...) is not ...:
                identity = current()
                if identity is None:
                    _warn_unguarded(config)
                apply_identity(params, identity, config)
                inner = getattr(prompt, "sampling_params", None)  # an EngineCoreRequest
                if inner is not None and inner is not params:
                    apply_identity(inner, identity, config)
            return await original(self, request_id, prompt, params, *args, **kwargs)

        return add_request

    return wrap(async_llm_cls, "add_request", make)
