"""What an engine tells a gateway of itself on ``/health``.

``/health`` answers carry ``x-tokenpace-scheduling-policy`` (``fcfs`` or ``priority``): vLLM
0.32 silently ignores a request's ``priority`` under ``fcfs``, and a gateway whose lanes
rely on it would otherwise never know; and ``x-tokenpace-max-num-seqs`` (its
``--max-num-seqs``), which a gateway otherwise learns only once the engine is full (its
reserved slots and saturation gate depend on it). Both are read from the running server's
own configuration (its app state), never from flags.

``RequestGuard`` adds them when pacing or lanes run; ``EngineHeaders`` is the same alone,
for a ``tokenpace serve`` engine that runs vLLM's own scheduler.
"""

from __future__ import annotations

from ._asgi import ASGIApp, Message, Receive, Scope, Send

SCHEDULING_POLICY_HEADER = "x-tokenpace-scheduling-policy"
MAX_NUM_SEQS_HEADER = "x-tokenpace-max-num-seqs"


def _scheduler_config(scope: Scope) -> object | None:
    state = getattr(scope.get("app"), "state", None)
    return getattr(getattr(state, "vllm_config", None), "scheduler_config", None)


def scheduling_policy(scope: Scope) -> str | None:
    """The running vLLM server's ``--scheduling-policy``, if it has one."""
    policy = getattr(_scheduler_config(scope), "policy", None)
    return None if policy is None else str(getattr(policy, "value", policy))


def max_num_seqs(scope: Scope) -> int | None:
    """The running vLLM server's ``--max-num-seqs``, if it has one."""
    value = getattr(_scheduler_config(scope), "max_num_seqs", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def with_engine_headers(scope: Scope, send: Send) -> Send:
    """``send`` with the engine's scheduling policy and capacity added to the response's
    headers (those it knows)."""
    added = []
    policy = scheduling_policy(scope)
    if policy is not None:
        added.append((SCHEDULING_POLICY_HEADER.encode(), policy.encode("latin-1")))
    seqs = max_num_seqs(scope)
    if seqs is not None:
        added.append((MAX_NUM_SEQS_HEADER.encode(), str(seqs).encode()))
    if not added:
        return send

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = dict(message)
            message["headers"] = [*message.get("headers", ()), *added]
        await send(message)

    return sending


class EngineHeaders:
    """ASGI middleware: the headers above on ``/health``, nothing else touched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") == "/health":
            send = with_engine_headers(scope, send)
        await self.app(scope, receive, send)
