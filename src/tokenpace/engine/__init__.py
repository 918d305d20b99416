"""The vLLM adapter: paced scheduler subclasses, their configuration and vLLM hooks.

Names are loaded on first use: the configuration, the HTTP guard and the ``vllm_xargs``
field names (``USER_EXTRA_ARG``, ``RATE_EXTRA_ARG``) and the event-log reader import nothing from vLLM (so
``tokenpace serve`` validates flags in milliseconds and a gateway can share the names),
while the schedulers and hooks import vLLM. vLLM resolves ``--scheduler-cls
tokenpace.engine.PacedScheduler``, ``--middleware tokenpace.engine.RequestGuard`` and
``--middleware tokenpace.engine.EngineAuth`` through these lazy names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._auth import EngineAuth
    from ._config import PacingConfig, PacingConfigError, validate_header_name
    from ._events import read_charges
    from ._guard import RequestGuard, RequestRefused, check_request_body
    from ._health_headers import MAX_NUM_SEQS_HEADER, SCHEDULING_POLICY_HEADER, EngineHeaders
    from ._hooks import configure_pacing, register
    from ._identity import ANONYMOUS_USER, request_user
    from ._scheduler import PacedAsyncScheduler, PacedScheduler
    from ._aborted import ABORTED_PATH
    from ._ended import ENDED_PATH, parse_cursor, format_cursor
    from ._control import RATES_PATH
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

_WHERE = {
    "ABORTED_PATH": "_aborted",
    "ENDED_PATH": "_ended",
    "format_cursor": "_ended",
    "parse_cursor": "_ended",
    "EngineAuth": "_auth",
    "PacingConfig": "_config",
    "PacingConfigError": "_config",
    "validate_header_name": "_config",
    "EngineHeaders": "_health_headers",
    "MAX_NUM_SEQS_HEADER": "_health_headers",
    "RequestGuard": "_guard",
    "RequestRefused": "_guard",
    "SCHEDULING_POLICY_HEADER": "_health_headers",
    "check_request_body": "_guard",
    "configure_pacing": "_hooks",
    "register": "_hooks",
    "read_charges": "_events",
    "ANONYMOUS_USER": "_identity",
    "APPLICATION_END_USER_RATE_EXTRA_ARG": "_xargs",
    "APPLICATION_EXTRA_ARG": "_xargs",
    "APPLICATION_RATE_EXTRA_ARG": "_xargs",
    "END_USER_EXTRA_ARG": "_xargs",
    "END_USER_RATE_EXTRA_ARG": "_xargs",
    "PacedAsyncScheduler": "_scheduler",
    "PacedScheduler": "_scheduler",
    "RATE_EXTRA_ARG": "_xargs",
    "RATE_VERSION_EXTRA_ARG": "_xargs",
    "RATES_PATH": "_control",
    "USER_EXTRA_ARG": "_xargs",
    "request_user": "_identity",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
