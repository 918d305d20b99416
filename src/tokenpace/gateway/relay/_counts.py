"""What an engine generated for a request whose usage never reached the gateway.

A request cut short (the client left, ``request_timeout`` ran out, the gateway restarted)
has no final usage: the gateway knows at most what it relayed, and for a non-streamed
request nothing. vLLM aborts the request when its connection goes; tokenpace's engine
keeps the prompt and output counts of each request that ended (``engine._aborted``) and
answers them at ``POST /tokenpace/v1/aborted``, by the ids its API server gave the engine
requests. Those ids follow from the gateway's request id X (sent as ``X-Request-Id``) and
the route (vLLM 0.32's serving code):

- chat and Messages: ``chatcmpl-X``;
- completions: ``cmpl-X-{p}`` for each prompt p (0 for a single prompt);
- Responses: the body's ``request_id`` (``resp_X``, set by the gateway) and ``_{turn}``,
  one engine request per turn (a response with built-in tools may take several);
- with ``n`` > 1 (chat, completions) each becomes ``n`` engine requests ``{i}_`` + the id.

``ask_engine_counts`` sums them; behind plain vLLM (404) or an engine that does not answer
it gives None, and the caller keeps its own bound.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx

from ...engine import ABORTED_PATH

ABORT_WAIT_S = 2.0
"""How long the gateway asks an engine for a request cut short: the abort reaches the
engine's scheduler a few milliseconds after the connection closes, unless the engine is
slow to notice; past this, the gateway's own bound is charged."""
ASK_EVERY_S = 0.05
TURNS_ASKED = 8
"""Responses: the turns asked for (a response with built-in tools beyond them is charged
its first ``TURNS_ASKED`` turns)."""
CHILDREN_ASKED = 64
"""Ids asked for at once when the number of choices (``n``) is not known."""
MAX_IDS_PER_CALL = 1024  # the engine's limit (``engine._aborted``)

Shape = tuple[int, int]
"""(n, prompts) of a chat or completion request: its engine requests."""


def engine_request_ids(kind: str, request_id: str, n: int = 1,
                       prompts: int = 1) -> list[tuple[str, ...]]:
    """The API server's ids of the engine requests of gateway request ``request_id``, one
    tuple per prompt (the ``n`` engine requests that share it): chat, completion and
    Messages exactly; Responses, the first ``TURNS_ASKED`` turns (each its own prompt),
    of which a response uses the first one or more."""
    if kind == "responses":
        return [(f"resp_{request_id}_{turn}",) for turn in range(TURNS_ASKED)]
    if kind == "completion":
        bases = [f"cmpl-{request_id}-{p}" for p in range(prompts)]
    elif kind in ("chat", "messages"):
        bases = [f"chatcmpl-{request_id}"]
    else:
        raise ValueError(f"unknown route kind {kind!r}")
    if n == 1:
        return [(base,) for base in bases]
    return [tuple(f"{i}_{base}" for i in range(n)) for base in bases]


@dataclass
class _Answer:
    """The engine's answer for some ids, merged over calls."""

    output: dict[str, int] = field(default_factory=dict)
    prompt: dict[str, int] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)
    exchange_ended: bool = False
    """The engine's API server had ended the request's HTTP exchange before its scheduler
    was asked (``engine._aborted``): ids it does not know never reached it."""

    def knows(self, request_id: str) -> bool:
        return request_id in self.output or request_id in self.running


class _Engine:
    """Asks one engine, within one deadline."""

    def __init__(self, client: httpx.AsyncClient, wait_s: float, exchange: str) -> None:
        self.client = client
        self.exchange = exchange
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + wait_s

    def expired(self) -> bool:
        return self.loop.time() >= self.deadline

    async def pause(self) -> None:
        await asyncio.sleep(ASK_EVERY_S)

    async def ask(self, ids: list[str]) -> _Answer | None:
        """The engine's counts of ``ids`` (several calls beyond ``MAX_IDS_PER_CALL``); None
        where it cannot tell: plain vLLM (404), another error, no answer in time."""
        answer = _Answer()
        for at in range(0, len(ids), MAX_IDS_PER_CALL):
            timeout = max(self.deadline - self.loop.time(), ASK_EVERY_S)
            try:
                asked = {"request_ids": ids[at:at + MAX_IDS_PER_CALL],
                         "exchange": self.exchange}
                resp = await self.client.post(ABORTED_PATH, json=asked, timeout=timeout)
                body = resp.json() if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None
            output = body.get("output_tokens") if isinstance(body, dict) else None
            if not isinstance(output, dict):
                return None
            answer.output.update((k, v) for k, v in output.items()
                                 if isinstance(v, int) and not isinstance(v, bool))
            prompt = body.get("prompt_tokens")  # absent from older tokenpace engines
            if isinstance(prompt, dict):
                answer.prompt.update((k, v) for k, v in prompt.items()
                                     if isinstance(v, int) and not isinstance(v, bool))
            running = body.get("running")
            if isinstance(running, list):
                answer.running.update(r for r in running if isinstance(r, str))
            if body.get("exchange_ended") is True:  # absent from older tokenpace engines
                answer.exchange_ended = True
        return answer


async def ask_engine_counts(client: httpx.AsyncClient, kind: str, request_id: str,
                            wait_s: float, *, n: int | None = None,
                            prompts: int | None = None) -> tuple[int | None, int] | None:
    """(prompt tokens, output tokens) the engine behind ``client`` counted for gateway
    request ``request_id`` of route kind ``kind`` ("chat", "completion", "responses",
    "messages"), summed over its engine requests; None where the engine cannot tell:
    plain vLLM (404), an error, or none of them known within ``wait_s`` seconds.

    Asks again every ``ASK_EVERY_S`` until every engine request has ended (a Responses
    request: until the turns it ran have, and at least one did) or ``wait_s`` ran out;
    the output count is then a lower bound (some had not ended, or were forgotten), and
    the prompt count None. The prompt is counted once per prompt (the ``n`` choices of
    one prompt share it) and is None also when the engine does not report prompts (a
    tokenpace engine older than the field).

    ``n`` and ``prompts`` (chat and completions): the request's shape, when the caller
    knows it; otherwise the engine's answers tell it (one or more calls more: ids of up to
    ``CHILDREN_ASKED`` choices, then of the further prompts, a page at a time).

    ``request_id`` is also the request's ``x-request-id`` at the engine (the gateway sends
    its id so): where the engine's API server says that exchange had ended and it knows
    none of the ids, the request never reached its scheduler and generated nothing:
    ``(None, 0)`` at once (the prompt stays what the gateway counted).

    Cost: one call to the engine per ``ASK_EVERY_S`` while it has not answered; in the
    engine, two dict lookups per id (``engine._aborted``).
    """
    if kind not in ("chat", "completion", "responses", "messages"):
        raise ValueError(f"unknown route kind {kind!r}")
    engine = _Engine(client, wait_s, request_id)
    if kind in ("chat", "completion") and (n is None or prompts is None):
        shape = await _discover(engine, kind, request_id, n)
        if shape is None:
            return None
        n, prompts = shape
    groups = engine_request_ids(kind, request_id, n or 1, prompts or 1)
    ids = [r for group in groups for r in group]
    while True:
        answer = await engine.ask(ids)
        if answer is None:
            return None
        if answer.exchange_ended and not any(answer.knows(r) for r in ids):
            return None, 0  # it never reached the scheduler: nothing was generated
        ended = _ended(kind, groups, answer)
        if ended is not None or engine.expired():
            break
        await engine.pause()
    if not answer.output:
        return None
    output = sum(answer.output.values())
    if ended is None:
        return None, output
    prompt = 0
    for group in groups[:ended]:
        counts = [answer.prompt[r] for r in group if r in answer.prompt]
        if not counts:
            return None, output
        prompt += counts[0]
    return prompt, output


def _ended(kind: str, groups: list[tuple[str, ...]], answer: _Answer) -> int | None:
    """How many of ``groups`` the request used, once all of them have ended (None: not
    yet). Chat, completion and Messages use every group; Responses the turns up to the
    last one the engine knows, none of them running."""
    if kind != "responses":
        every = all(r in answer.output for group in groups for r in group)
        return len(groups) if every else None
    used = 0
    for turn, (request_id,) in enumerate(groups):
        if answer.knows(request_id):
            used = turn + 1
    if not used or answer.running:
        return None
    ended = all(request_id in answer.output for (request_id,) in groups[:used])
    return used if ended else None


async def _discover(engine: _Engine, kind: str, request_id: str,
                    n: int | None) -> Shape | None:
    """(n, prompts) of a chat or completion request, from the engine requests the engine
    knows (ended or running); None when it knows none of them within its deadline."""
    if n is None:
        base = engine_request_ids(kind, request_id)[0][0]  # the first prompt's
        asked = 0
        while True:  # n: the plain id (n = 1), else choices {i}_ up to the last known
            ids = ([base] if not asked else []) + [
                f"{i}_{base}" for i in range(asked, asked + CHILDREN_ASKED)]
            answer = await engine.ask(ids)
            if answer is None:
                return None
            if answer.knows(base):
                n = 1
                break
            known = [i for i in range(asked, asked + CHILDREN_ASKED)
                     if answer.knows(f"{i}_{base}")]
            if known:
                n = known[-1] + 1
                if n < asked + CHILDREN_ASKED:
                    break
                asked += CHILDREN_ASKED
                continue
            if asked:
                n = asked
                break
            if answer.exchange_ended:  # never reached the scheduler: the caller finds so
                n = 1
                break
            if engine.expired():
                return None
            await engine.pause()
    if kind == "chat":
        return n, 1
    prompts, page = 1, max(1, MAX_IDS_PER_CALL // n)
    while True:  # prompts: up to the last one known, a page at a time
        first = prompts
        groups = engine_request_ids(kind, request_id, n, first + page)[first:]
        answer = await engine.ask([r for group in groups for r in group])
        if answer is None:
            return None
        known = [p for p, group in enumerate(groups, first)
                 if any(answer.knows(r) for r in group)]
        if known:
            prompts = known[-1] + 1
        if prompts < first + page:
            return n, prompts
