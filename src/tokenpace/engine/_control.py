"""Rate control: a trusted gateway changes users' rates between requests.

A gateway that spreads one tenant's rate R over several engines gives each engine a share
of R and must move the shares when the tenant's streams start and end, also when no new
request goes to the engine whose share changes. ``POST /tokenpace/v1/rates`` on the API
server does that:

    {"rates": {"team-a": {"rate": 40.0, "version": 17}}}

answers ``{"rates": {"team-a": {"rate": 40.0, "version": 17}}}``: per user, the rate now
in force and its version. A version below the user's last adopted one (a late, older
change) is not applied, and the answer then shows the newer rate that stays. The route
needs the engine's API key (``Authorization: Bearer``) even when ``EngineAuth`` is not
installed in front of it, and pacing with ``trusted_gateway``: 401 and 403 otherwise,
400 with the offending field for a bad body.

How the call reaches the scheduler (vLLM 0.32): the API server's engine client sends a
utility call (``engine_core.call_utility_async``; with data parallelism every rank gets
it), the engine process runs ``EngineCoreProc.tokenpace_set_rates`` — a method this
module adds to vLLM's class — in its busy loop between two steps, so the rate table
never changes in the middle of a step, and the idle wait ends at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from ..pacing import LimitsError, validate_rate, validate_rate_version, validate_user_id
from ._asgi import Receive, Scope, Send, error_payload, send_json
from ._auth import carries_key, keys_of


RATES_PATH = "/tokenpace/v1/rates"
UTILITY_METHOD = "tokenpace_set_rates"
MAX_BODY_BYTES = 1 << 20
MAX_USERS_PER_CALL = 10_000

logger = logging.getLogger("vllm.tokenpace.engine")

Rates = dict[str, tuple[float, "int | None"]]


class ControlRefused(ValueError):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def parse_rates(body: Any) -> Rates:
    """The ``rates`` of a control call's JSON body, validated (``ControlRefused`` 400)."""
    rates = body.get("rates") if isinstance(body, dict) else None
    if not isinstance(rates, dict) or not rates:
        raise ControlRefused(400, "expected {\"rates\": {user: {\"rate\": r, \"version\": v}}} "
                                  "with at least one user", "rates")
    if len(rates) > MAX_USERS_PER_CALL:
        raise ControlRefused(400, f"at most {MAX_USERS_PER_CALL} users per call", "rates")
    out: Rates = {}
    for user, entry in rates.items():
        param = f"rates.{user}"
        try:
            validate_user_id(user, "user id")
            if not isinstance(entry, dict) or "rate" not in entry:
                raise LimitsError(f"{param}: expected {{\"rate\": r, \"version\": v}}")
            out[user] = (validate_rate(entry["rate"], f"{param}.rate"),
                         validate_rate_version(entry.get("version"), f"{param}.version"))
        except LimitsError as exc:
            raise ControlRefused(400, str(exc), param) from None
    return out


# -- the engine process -------------------------------------------------------------------


def tokenpace_set_rates(core: Any, rates: Any) -> dict[str, Any]:
    """Runs in the engine process (as ``EngineCoreProc.tokenpace_set_rates``): apply
    ``rates`` (the body's ``rates``, checked again here: the engine trusts no caller)
    to the paced scheduler. Returns ``{"rates": ...}`` or ``{"error": ..., "status": ...}``
    (an error answer, not an exception: vLLM logs a traceback for every failed utility)."""
    set_user_rates = getattr(core.scheduler, "set_user_rates", None)
    if set_user_rates is None:
        return {"error": "this engine does not run tokenpace's paced scheduler", "status": 403}
    try:
        applied = set_user_rates(parse_rates({"rates": rates}))
    except ControlRefused as exc:
        return {"error": str(exc), "status": exc.status}
    except PermissionError as exc:
        return {"error": str(exc), "status": 403}
    return {"rates": {u: {"rate": r, "version": v} for u, (r, v) in applied.items()}}


def install_utility(engine_core_proc_cls: type, name: str,
                    function: Callable[..., dict[str, Any]]) -> bool:
    """Add ``function(core, *args)`` to vLLM's engine-core class as method ``name`` (once);
    True if added.

    vLLM runs a utility call by ``getattr(engine_core, method_name)`` in the engine
    process, so a method on the class is all a utility needs."""
    if getattr(engine_core_proc_cls, name, None) is not None:
        return False

    def method(self: Any, *args: Any) -> dict[str, Any]:
        return function(self, *args)

    method.__name__ = name
    setattr(engine_core_proc_cls, name, method)
    return True


def install_rate_control(engine_core_proc_cls: type) -> bool:
    """Add ``tokenpace_set_rates`` to vLLM's engine-core class (once); True if added."""
    return install_utility(engine_core_proc_cls, UTILITY_METHOD, tokenpace_set_rates)


# -- the API server ------------------------------------------------------------------------


async def handle_rates(scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /tokenpace/v1/rates`` (any other method: 405)."""

    async def refuse(status: int, message: str, kind: str, param: str | None = None) -> None:
        await send_json(send, status, error_payload(status, message, kind, param))

    if scope.get("method") != "POST":
        await refuse(405, "use POST", "MethodNotAllowed")
        return
    state = getattr(scope.get("app"), "state", None)
    keys = keys_of(scope)
    if not keys:
        await refuse(403, "rate control needs the engine's API key: start it with "
                          "--trusted-gateway and --api-key (or VLLM_API_KEY)", "PermissionDenied")
        return
    if not carries_key(scope, keys):
        await refuse(401, "send the engine's API key as 'Authorization: Bearer <key>'",
                     "AuthenticationError")
        return
    try:
        rates = parse_rates(json.loads(await _read(receive)))
    except ControlRefused as exc:
        await refuse(exc.status, str(exc), "BadRequestError", exc.param)
        return
    except (ValueError, RecursionError):
        await refuse(400, "the body is not JSON", "BadRequestError")
        return
    client = getattr(getattr(state, "engine_client", None), "engine_core", None)
    if client is None:
        await refuse(503, "the engine is not running", "ServiceUnavailable")
        return
    result = await client.call_utility_async(
        UTILITY_METHOD, {u: {"rate": r, "version": v} for u, (r, v) in rates.items()})
    if "error" in result:
        await refuse(int(result.get("status", 500)), result["error"], "PermissionDenied")
        return
    await send_json(send, 200, result)


async def _read(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ControlRefused(400, "the client left while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ControlRefused(400, f"the body exceeds {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
