"""A request's pacing identity, as the scheduler and the API server's hooks read it.

Its user (``vllm_xargs.output_rate_user``, or anonymous) and the inner levels it names
(application, end user). Apart from the scheduler so that the hooks that pin users to
data-parallel ranks read the identity the same way without importing the scheduler.
"""

from __future__ import annotations

import logging
from typing import Any

from ..pacing import LimitsError, validate_user_id
from ._xargs import APPLICATION_EXTRA_ARG, END_USER_EXTRA_ARG, USER_EXTRA_ARG

logger = logging.getLogger("vllm.tokenpace.engine")

ANONYMOUS_USER = "__anonymous__"


def extra_args(request: Any) -> dict[str, Any] | None:
    """``vllm_xargs`` as it reaches the engine (``sampling_params.extra_args``), if any."""
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    return extra if extra and isinstance(extra, dict) else None


def request_user(request: Any) -> str:
    """The pacing identity of a request: ``vllm_xargs.output_rate_user`` or anonymous.

    A malformed identity cannot crash the engine: the API layer refuses it with HTTP 400
    when tokenpace serves; anything that still gets here is paced as anonymous.
    """
    extra = extra_args(request)
    if extra is None:
        return ANONYMOUS_USER
    user = extra.get(USER_EXTRA_ARG)
    if user is None:
        return ANONYMOUS_USER
    try:
        return validate_user_id(user, USER_EXTRA_ARG)
    except LimitsError as exc:
        logger.warning("request %s: %s; paced as %s", getattr(request, "request_id", "?"),
                       exc, ANONYMOUS_USER)
        return ANONYMOUS_USER


def request_end_user(request: Any) -> str | None:
    """The end user a request names (``vllm_xargs.output_rate_end_user``), or None."""
    return _inner_name(request, END_USER_EXTRA_ARG)


def request_application(request: Any) -> str | None:
    """The application a request names (``vllm_xargs.output_rate_application``), or None."""
    return _inner_name(request, APPLICATION_EXTRA_ARG)


def _inner_name(request: Any, field: str) -> str | None:
    """An inner level's name in the request's ``vllm_xargs`` (``field``), or None.

    A malformed one cannot crash the engine: the API layer refuses it with HTTP 400 when
    tokenpace serves; anything that still gets here is paced without that level.
    """
    extra = extra_args(request)
    name = None if extra is None else extra.get(field)
    if name is None:
        return None
    try:
        return validate_user_id(name, field)
    except LimitsError as exc:
        logger.warning("request %s: %s; paced under its user alone",
                       getattr(request, "request_id", "?"), exc)
        return None
