"""What the gateway tells an engine about a request: one value, built once, written once.

Everything an engine learns from the gateway besides the client's own request (who the
request is for at each level the engine paces, their rates and the rate's version, the
lane's priority, the tenant's cache salt, the served model name, the admitted output limit,
the gateway's request id) is one ``EngineInstructions``. ``for_request`` builds it from
the tenant's and the application's configuration and what admission and dispatch decided;
``engine_body`` writes it into the client's body. A new level or field is a field here, its
line in ``EngineInstructions.pacing`` or ``engine_body``, and its source in ``for_request``.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

from ...engine import (
    APPLICATION_END_USER_RATE_EXTRA_ARG,
    APPLICATION_EXTRA_ARG,
    APPLICATION_RATE_EXTRA_ARG,
    END_USER_EXTRA_ARG,
    END_USER_RATE_EXTRA_ARG,
    RATE_EXTRA_ARG,
    RATE_VERSION_EXTRA_ARG,
    USER_EXTRA_ARG,
)
from ..config import ApplicationConfig, TenantConfig
from ..wire import POOLING_KINDS, ParsedRequest, encode_body


class EngineInstructions(NamedTuple):
    """What one request carries to its engine, whatever the client sent in those fields.

    Immutable, and built at a tuple's cost (0.8 us; a frozen dataclass of these 13 fields
    costs 2.2 us, on the path of every request).

    ``user`` is the tenant, paced at ``rate`` (its share of it with rates split over
    engines, at ``rate_version``); ``end_user`` with ``end_user_rate``: the end user the
    engine paces at that rate inside the tenant's; ``application`` with
    ``application_rate``: the application likewise; ``application_end_user_rate``: the
    rate of the application's own end users (then its end users are its own, at that
    rate). ``priority``: the lane's, for an engine scheduling by priority, else 0.
    ``cache_salt``: the tenant's. ``model``: the served name, when the client sent an
    alias. ``request_id``: the gateway's, given to the engine where the body names it
    (Responses).
    """

    user: str
    max_tokens: int
    rate: float | None = None
    rate_version: int | None = None
    priority: int = 0
    model: str | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    end_user: str | None = None
    end_user_rate: float | None = None
    application: str | None = None
    application_rate: float | None = None
    application_end_user_rate: float | None = None

    def pacing(self) -> tuple[tuple[str, Any], ...]:
        """Each ``vllm_xargs`` pacing field with its value; None: the field is dropped.

        An end user without a rate that would pace it is not named; an application is
        named when it has a rate or end users of its own; a rate version goes with a rate.
        """
        application = self.application
        own_end_users = application is not None and self.application_end_user_rate is not None
        end_user = self.end_user
        if end_user is not None and self.end_user_rate is None and not own_end_users:
            end_user = None  # no rate would pace it: the engine is not told
        named = application is not None and (self.application_rate is not None or own_end_users)
        return (
            (USER_EXTRA_ARG, self.user),
            (RATE_EXTRA_ARG, self.rate),
            (RATE_VERSION_EXTRA_ARG, self.rate_version if self.rate is not None else None),
            (END_USER_EXTRA_ARG, end_user),
            (END_USER_RATE_EXTRA_ARG,
             self.end_user_rate if end_user is not None and not own_end_users else None),
            (APPLICATION_EXTRA_ARG, application if named else None),
            (APPLICATION_RATE_EXTRA_ARG, self.application_rate if application is not None else None),
            (APPLICATION_END_USER_RATE_EXTRA_ARG,
             self.application_end_user_rate if own_end_users and end_user is not None else None),
        )


def paces_end_users(tenant: TenantConfig, application: ApplicationConfig | None) -> bool:
    """Whether the engine is told the request's end user (a rate would pace it): only then
    is the client's end-user field read, and refused when it is not a usable identity."""
    return (tenant.end_user_output_tokens_per_second is not None
            or (application is not None
                and application.end_user_output_tokens_per_second is not None))


def for_request(tenant: TenantConfig, application: ApplicationConfig | None, *, model: str,
                request_id: str, max_tokens: int, priority: int, rate: float | None,
                rate_version: int | None, end_user: str | None) -> EngineInstructions:
    """The instructions of an admitted, dispatched request of ``tenant`` (and its key's
    ``application``): ``rate`` and ``rate_version`` are the tenant's rate or its share on
    the chosen engine, ``priority`` the lane's there, ``max_tokens`` admission's limit.
    Per request: one small object, no lookups."""
    return EngineInstructions(
        user=tenant.id, max_tokens=max_tokens, rate=rate, rate_version=rate_version,
        priority=priority, model=model, cache_salt=tenant.cache_salt, request_id=request_id,
        end_user=end_user, end_user_rate=tenant.end_user_output_tokens_per_second,
        application=None if application is None else application.id,
        application_rate=None if application is None else application.output_tokens_per_second,
        application_end_user_rate=(None if application is None
                                   else application.end_user_output_tokens_per_second))


def engine_body(req: ParsedRequest, instructions: EngineInstructions,
                keep: frozenset[str] | None = None) -> bytes:
    """The body sent upstream: the client's, with ``instructions`` written over it.
    ``keep``: the client's top-level fields the engine reads (``fleet``'s request fields);
    the others are not sent (None: all are).

    Whatever a client put in ``vllm_xargs``' pacing fields, ``priority`` or the output
    limit is replaced, so no client can borrow another tenant's quota or lane; a client's
    own end-user and application fields are dropped. With a tenant's ``cache_salt`` the
    prompt's cached blocks are the tenant's alone: a client's own salt (a string) is mixed
    into it, so it can split its tenant's cache further but never reach another tenant's.
    """
    body = dict(req.body) if keep is None else {k: v for k, v in req.body.items() if k in keep}
    if instructions.model is not None:
        body["model"] = instructions.model
    cache_salt = instructions.cache_salt
    if cache_salt is not None:
        own = body.get("cache_salt")
        if isinstance(own, str) and own:
            cache_salt = hashlib.sha256(f"{cache_salt}\0{own}".encode("utf-8")).hexdigest()
        body["cache_salt"] = cache_salt
    if req.kind in POOLING_KINDS:
        # No output to pace or limit: vLLM's pooling requests read no ``vllm_xargs``
        # (a client's is dropped) and have no output limit; the lane's priority stands.
        body.pop("vllm_xargs", None)
        body["priority"] = instructions.priority
        return encode_body(body)
    xargs = body.get("vllm_xargs")
    xargs = dict(xargs) if isinstance(xargs, dict) else {}
    # Every pacing field is the gateway's: set from the tenant's configuration, or dropped
    # (a client's own value never reaches the engine).
    for field, value in instructions.pacing():
        if value is None:
            xargs.pop(field, None)
        else:
            xargs[field] = value
    body["vllm_xargs"] = xargs
    if req.kind == "messages":
        # vLLM's Messages request has no priority field (one sent would be ignored): the
        # tenant's lane orders the gateway's queue, the engine runs it at priority 0.
        body.pop("priority", None)
    else:
        body["priority"] = instructions.priority
    body[req.max_tokens_field] = instructions.max_tokens
    if req.kind == "responses":
        # Nothing is kept in the engine's memory (see ``wire``'s ``_check_responses``); the
        # engine's request id is the gateway's, so both logs name the request alike.
        body["store"] = False
        if instructions.request_id is not None:
            body["request_id"] = f"resp_{instructions.request_id}"
        return encode_body(body)
    if req.stream and req.kind != "messages":
        # Usage in every chunk: the gateway then knows how many tokens were generated at
        # any moment, also when the client or the engine goes away mid-stream.
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return encode_body(body)
