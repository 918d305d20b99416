"""A small OpenAI-style engine served over real HTTP, for gateway edge cases.

It speaks the parts of vLLM's API the gateway uses (``/tokenize``, ``/v1/completions``,
``/v1/chat/completions`` streaming and not, ``stream_options`` usage, the pooling routes
(``/v1/embeddings``, rerank, score, ``/pooling``, ``/classify``), ``/health``,
``/v1/models``; with ``book_extra`` set, tokenpace's book of ended requests) and records
what it received, how many tokens each request streamed and whether the request was
aborted, so tests can check the gateway's book-keeping against the engine's. Its "tokenizer" counts bytes; prompts steer it:

- ``FAIL_AFTER:k`` in the prompt: stream ``k`` tokens, then drop the connection.
- ``SLOW`` in the prompt: 50 ms per token instead of ``token_delay_s``.
- ``UNICODE`` in the prompt: each token's text carries U+0085, U+2028, U+2029 and a
  multi-byte character, unescaped in the JSON as vLLM writes them, and each event is
  written in two pieces cut inside a multi-byte character.

Like vLLM, continuous usage (``continuous_usage_stats``) counts the tokens of the chunk's
own choice; the final usage chunk counts all choices. With ``cached_tokens`` set it reports
that many of the prompt's tokens (at most the prompt) as found in its prefix cache, as vLLM
does with ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens``
in a non-streamed answer and in the final usage chunk only.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests._servers import free_port


BOOK = "fa6e"
"""The fake engine's one book (``/tokenpace/v1/ended``)."""


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    streamed: int = 0
    finished: bool = False
    aborted: bool = False


@dataclass
class FakeEngine:
    token_delay_s: float = 0.002
    max_model_len: int = 4096
    requests: list[Seen] = field(default_factory=list)
    healthy: bool = True
    metrics_text: str | None = None  # served at /metrics when set (vLLM's gauges)
    scheduling_policy: str | None = None  # reported on /health as tokenpace serve does
    max_num_seqs: int | None = None  # ... and this as its --max-num-seqs
    # (path, headers) of every call other than a completion: health, metrics, tokenize, models.
    other_calls: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    tokenized: int = 0  # /tokenize calls received
    tokenize_bodies: list[dict[str, Any]] = field(default_factory=list)  # ... and their bodies
    tokenize_delay_s: float = 0.0  # each /tokenize answer waits this long
    # While this is an unset event, completions are recorded, then wait until it is set: a
    # test can hold the requests it dispatched for as long as it needs, whatever the load.
    gate: threading.Event | None = None
    active: int = 0  # completions being worked on now (held at the gate included)
    peak: int = 0  # the most at once since the last reset_peak()
    models: tuple[str, ...] = ("fake",)  # the names /v1/models lists (--served-model-name)
    models_status: int = 200  # another status: /v1/models answers it, with no body
    # Completions answer 503 and are not recorded, /health stays 200: vLLM at its queue
    # limits or scaling elastic EP. Counted in ``unavailable_answers``.
    unavailable: bool = False
    unavailable_answers: int = 0
    # New completions answer what vLLM 0.32's API server answers once SIGTERM started its
    # shutdown (500, "cannot schedule new futures after shutdown"), not recorded; /health
    # stays 200 and completions already running go on. Counted in ``unavailable_answers``.
    shutting_down: bool = False
    # Prompt tokens reported as cached (prompt_tokens_details); None: no details, as vLLM
    # without --enable-prompt-tokens-details.
    cached_tokens: int | None = None
    # Set: tokenpace's book of ended requests (``POST /tokenpace/v1/aborted``, requests
    # with n = 1 and one prompt), each reporting this many tokens more than it sent, as an
    # engine does that generated on until the abort landed. None: 404, as plain vLLM.
    book_extra: int | None = None
    book_calls: int = 0
    # The same book in order (``GET /tokenpace/v1/ended``): each request as the book
    # first saw it ended, with the time then; engine ids as in ``_book``.
    ended: list[tuple[Seen, float]] = field(default_factory=list)
    ended_calls: int = 0
    # The pooling routes (``POOLING_PATHS``) it answers; the others get FastAPI's plain
    # 404, as vLLM's API server answers a route its model's task does not serve.
    pooling_paths: tuple[str, ...] | None = None  # None: all
    # Served at /openapi.json when set (vLLM's API server publishes its request models
    # there); None: 404, as vLLM with --disable-fastapi-docs.
    openapi: dict[str, Any] | None = None

    def usage_details(self, prompt_tokens: int) -> dict[str, Any]:
        """The ``prompt_tokens_details`` part of a final usage, as vLLM 0.32 writes it."""
        if self.cached_tokens is None:
            return {}
        return {"prompt_tokens_details": {"cached_tokens": min(self.cached_tokens, prompt_tokens),
                                          "created_cache_tokens": None,
                                          "multimodal_tokens": None}}

    def reset_peak(self) -> None:
        self.peak = self.active

    def _enter(self) -> None:
        self.active += 1
        self.peak = max(self.peak, self.active)

    def count(self, text: str) -> int:
        return len(text.encode())

    def chat_prompt_tokens(self, body: dict[str, Any]) -> int:
        total = 0
        for m in body["messages"]:
            content = m.get("content") or ""
            total += 3 + self.count(content if isinstance(content, str) else json.dumps(content))
        return total + (2 if body.get("add_generation_prompt", True) else 0)

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        if "messages" in body:
            return self.chat_prompt_tokens(body)
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        return len(prompt) if isinstance(prompt, list) else self.count(prompt) + 1

    def prompt_text(self, body: dict[str, Any]) -> str:
        if "messages" in body:
            return " ".join(str(m.get("content")) for m in body["messages"])
        return str(body.get("prompt"))

    # -- the app -----------------------------------------------------------------------

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", self._health),
            Route("/metrics", self._metrics),
            Route("/v1/models", self._models),
            Route("/openapi.json", self._openapi),
            Route("/tokenize", _validated(self._tokenize), methods=["POST"]),
            Route("/v1/completions", _validated(self._complete), methods=["POST"]),
            Route("/v1/chat/completions", _validated(self._complete), methods=["POST"]),
            *(Route(path, _validated(self._complete), methods=["POST"]) for path in POOLING_PATHS),
            Route("/tokenpace/v1/aborted", self._book, methods=["POST"]),
            Route("/tokenpace/v1/ended", self._ended, methods=["GET"]),
        ])

    async def _openapi(self, request: Request) -> Response:
        self.other_calls.append((request.url.path, dict(request.headers)))
        if self.openapi is None:
            return Response(status_code=404)
        return JSONResponse(self.openapi)

    async def _book(self, request: Request) -> Response:
        """The ended requests' counts by the ids vLLM's API server gives them
        (``chatcmpl-X``, ``cmpl-X-0``; X: the ``x-request-id`` header)."""
        self.book_calls += 1
        if self.book_extra is None:
            return Response(status_code=404)
        by_id = {seen.headers.get("x-request-id"): seen for seen in self.requests}
        output, prompt, running = {}, {}, []
        for rid in (await request.json())["request_ids"]:
            x = rid.removeprefix("chatcmpl-") if rid.startswith("chatcmpl-") \
                else rid.removeprefix("cmpl-").removesuffix("-0")
            seen = by_id.get(x)
            if seen is None:
                continue
            if seen.finished or seen.aborted:
                output[rid] = seen.streamed + self.book_extra
                prompt[rid] = self.prompt_tokens(seen.body)
            else:
                running.append(rid)
        return JSONResponse({"output_tokens": output, "prompt_tokens": prompt,
                             "running": running})

    async def _ended(self, request: Request) -> Response:
        """Every request that ended, oldest first, from the cursor ``after`` (one book,
        ``BOOK``), as tokenpace's engine lists them: the API server's id (``chatcmpl-X``,
        ``cmpl-X-0``), the pacing user, prompt and output counts (``book_extra`` more)."""
        self.ended_calls += 1
        if self.book_extra is None:
            return Response(status_code=404)
        listed = {id(seen) for seen, _ in self.ended}
        for seen in self.requests:
            if (seen.finished or seen.aborted) and id(seen) not in listed:
                self.ended.append((seen, time.time()))
        after = int(request.query_params.get("after", f"{BOOK}:-1").partition(":")[2])
        limit = int(request.query_params.get("limit", "1000"))
        items = []
        for seq in range(after + 1, min(len(self.ended), after + 1 + limit)):
            seen, ended_at = self.ended[seq]
            x = seen.headers.get("x-request-id")
            chat = seen.path.endswith("chat/completions")
            items.append({"book": BOOK, "seq": seq,
                          "request_id": f"chatcmpl-{x}" if chat else f"cmpl-{x}-0",
                          "user": (seen.body.get("vllm_xargs") or {}).get("output_rate_user", ""),
                          "prompt_tokens": self.prompt_tokens(seen.body),
                          "output_tokens": seen.streamed + self.book_extra,
                          "ended_at": ended_at})
        last = items[-1]["seq"] if items else after
        return JSONResponse({"requests": items, "next": f"{BOOK}:{last}", "oldest": {BOOK: 0}})

    def _note(self, request: Request) -> None:
        self.other_calls.append((request.url.path, dict(request.headers)))
        del self.other_calls[:-200]  # health checks run forever: keep the recent ones

    async def _health(self, request: Request) -> Response:
        self._note(request)
        headers = ({"x-tokenpace-scheduling-policy": self.scheduling_policy}
                   if self.scheduling_policy else {})
        if self.max_num_seqs is not None:
            headers["x-tokenpace-max-num-seqs"] = str(self.max_num_seqs)
        return Response(status_code=200 if self.healthy else 503, headers=headers)

    async def _metrics(self, request: Request) -> Response:
        self._note(request)
        if self.metrics_text is None:
            return Response(status_code=404)
        return Response(self.metrics_text, media_type="text/plain")

    async def _models(self, request: Request) -> Response:
        self._note(request)
        if self.models_status != 200:
            return Response(status_code=self.models_status)
        return JSONResponse({"object": "list",
                             "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _tokenize(self, request: Request) -> Response:
        self._note(request)
        self.tokenized += 1
        body = await request.json()
        self.tokenize_bodies.append(body)
        await asyncio.sleep(self.tokenize_delay_s)
        n = self.prompt_tokens(body)
        return JSONResponse({"count": n, "max_model_len": self.max_model_len, "tokens": [0] * n})

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        if self.unavailable:
            self.unavailable_answers += 1
            return JSONResponse({"error": "the server is shutting down"}, status_code=503)
        if self.shutting_down:
            self.unavailable_answers += 1
            return JSONResponse({"error": {
                "message": "cannot schedule new futures after shutdown",
                "type": "InternalServerError", "param": None, "code": 500}}, status_code=500)
        seen = Seen(request.url.path, body, dict(request.headers))
        self.requests.append(seen)
        self._enter()
        streaming = False
        try:
            response = await self._answer(request, body, seen)
            streaming = isinstance(response, StreamingResponse)
            return response
        finally:
            if not streaming:
                self.active -= 1

    async def _answer(self, request: Request, body: dict[str, Any], seen: Seen) -> Response:
        while self.gate is not None and not self.gate.is_set():
            await asyncio.sleep(0.005)
        if body.get("fake_error"):
            return JSONResponse({"error": {"message": "the fake engine refuses", "type": "BadRequestError",
                                           "code": body["fake_error"]}}, status_code=body["fake_error"])
        if request.url.path in POOLING_PATHS:
            return await self._pool(request.url.path, body, seen)
        chat = request.url.path.endswith("chat/completions")
        prompt_tokens = self.prompt_tokens(body)
        max_tokens = (body.get("max_completion_tokens") if chat else None) \
            or body.get("max_tokens") or 16
        n = body.get("n") or 1
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (max_tokens, n)):
            raise ValueError("max_tokens and n must be integers")  # vLLM's schema says so
        text = self.prompt_text(body)
        fail = re.search(r"FAIL_AFTER:(\d+)", text)
        fail_after = int(fail.group(1)) if fail else None
        delay = 0.05 if "SLOW" in text else self.token_delay_s
        kind = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            if delay < 0.01:
                await asyncio.sleep(delay * max_tokens)
                seen.streamed = max_tokens * n
            else:  # SLOW: token by token, and a client gone aborts it (as vLLM's routes do)
                for _ in range(max_tokens):
                    await asyncio.sleep(delay)
                    seen.streamed += n
                    if await request.is_disconnected():
                        seen.aborted = True
                        return Response(status_code=499)
            seen.finished = True
            choices = [
                {"index": i, "finish_reason": "length",
                 **({"message": {"role": "assistant", "content": "x" * max_tokens}} if chat
                    else {"text": "x" * max_tokens})}
                for i in range(n)
            ]
            return JSONResponse({
                "id": "cmpl-fake", "object": kind, "model": body["model"], "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens * n,
                          "total_tokens": prompt_tokens + max_tokens * n,
                          **self.usage_details(prompt_tokens)},
            })
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and bool(options.get("continuous_usage_stats"))

        unicode = "UNICODE" in text
        piece = "a\u0085b\u2028c\u2029d\u20ac" if unicode else "x"

        async def events() -> Any:
            per_choice = [0] * n
            try:
                for i in range(max_tokens):
                    if fail_after is not None and i == fail_after:
                        raise ConnectionError("fake engine failure")
                    await asyncio.sleep(delay)
                    last = i == max_tokens - 1
                    for c in range(n):
                        choice: dict[str, Any] = {"index": c, "finish_reason": "length" if last else None}
                        if chat:
                            choice["delta"] = {"content": piece}
                        else:
                            choice["text"] = piece
                        chunk: dict[str, Any] = {"id": "cmpl-fake", "object": kind + ".chunk",
                                                 "model": body["model"], "choices": [choice]}
                        seen.streamed += 1
                        per_choice[c] += 1
                        if continuous:
                            chunk["usage"] = {"prompt_tokens": prompt_tokens,
                                              "completion_tokens": per_choice[c],
                                              "total_tokens": prompt_tokens + per_choice[c]}
                        event = f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()
                        if unicode:
                            cut = event.index("\u20ac".encode()) + 1  # inside the euro sign
                            yield event[:cut]
                            await asyncio.sleep(0.002)
                            yield event[cut:]
                        else:
                            yield event
                if include_usage:
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": seen.streamed,
                             "total_tokens": prompt_tokens + seen.streamed,
                             **self.usage_details(prompt_tokens)}
                    final = {"id": "cmpl-fake", "choices": [], "usage": usage}
                    yield f"data: {json.dumps(final, separators=(',', ':'))}\n\n"
                yield "data: [DONE]\n\n"
                seen.finished = True
            finally:
                self.active -= 1
                if not seen.finished and fail_after is None:
                    seen.aborted = True

        return StreamingResponse(events(), media_type="text/event-stream")


    # -- the pooling routes, answered in vLLM 0.32's formats -----------------------------

    def pooled_tokens(self, path: str, body: dict[str, Any]) -> list[int]:
        """Each input's prompt tokens as this engine counts them: a string as ``/tokenize``
        counts it, token ids their number, chat messages as a chat prompt, a (query,
        document) pair as the two texts joined by a line break."""
        if path.endswith("rerank") or path.endswith("score"):
            return [self.count(self._text(q)) + self.count(self._text(d)) + 2
                    for q, d in _pairs(path, body)]
        value = body.get("input")
        if value is None:
            return [self.chat_prompt_tokens(body)]
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]
        return [len(v) if isinstance(v, list) else self.count(v) + 1 for v in value]

    @staticmethod
    def _text(value: Any) -> str:
        return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))

    async def _pool(self, path: str, body: dict[str, Any], seen: Seen) -> Response:
        """vLLM's answer on ``path``: one result per input (an 8-float vector, a score),
        ``usage`` with the prompt tokens (``dimensions`` sets the vectors' size)."""
        if self.pooling_paths is not None and path not in self.pooling_paths:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        counts = self.pooled_tokens(path, body)
        if "SLOW" in json.dumps(body):
            await asyncio.sleep(0.5)
        await asyncio.sleep(self.token_delay_s)
        seen.finished = True
        total = sum(counts)
        usage = {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0,
                 "prompt_tokens_details": None}
        size = body.get("dimensions") or 8
        if path.endswith("rerank"):
            docs = body["documents"] if isinstance(body["documents"], list) else [body["documents"]]
            return JSONResponse({"id": "rerank-fake", "model": body["model"],
                                 "usage": {"prompt_tokens": total, "total_tokens": total},
                                 "results": [{"index": i, "document": {"text": self._text(d)},
                                              "relevance_score": 1.0 / (i + 1)}
                                             for i, d in enumerate(docs)]})
        if path.endswith("score"):
            data = [{"index": i, "object": "score", "score": 0.5} for i in range(len(counts))]
        elif path.endswith("classify"):
            data = [{"index": i, "label": "a", "probs": [1.0, 0.0], "num_classes": 2}
                    for i in range(len(counts))]
        else:
            data = [{"index": i, "object": "embedding" if path.endswith("embeddings") else "pooling",
                     ("embedding" if path.endswith("embeddings") else "data"):
                         [0.125 * (i + 1)] * size}
                    for i in range(len(counts))]
        return JSONResponse({"id": "embd-fake", "object": "list", "created": 0,
                             "model": body["model"], "data": data, "usage": usage})


POOLING_PATHS = ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score",
                 "/pooling", "/classify")
"""The pooling routes a vLLM 0.32 API server serves (this engine serves all, for any model)."""


def _pairs(path: str, body: dict[str, Any]) -> list[tuple[Any, Any]]:
    """The (query, document) pairs of a rerank or score body, as vLLM pairs them."""
    if path.endswith("rerank"):
        docs = body["documents"]
        return [(body["query"], d) for d in (docs if isinstance(docs, list) else [docs])]
    for a, b in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                 ("text_1", "text_2")):
        if a in body and b in body:
            left = body[a] if isinstance(body[a], list) else [body[a]]
            right = body[b] if isinstance(body[b], list) else [body[b]]
            if len(left) == 1:
                return [(left[0], d) for d in right]
            if len(right) == 1:
                return [(q, right[0]) for q in left]
            return list(zip(left, right))
    raise ValueError("no pair of fields to score")


def _validated(handler: Any) -> Any:
    """A body this engine cannot read gets a 400, as vLLM's request validation answers it
    (hostile-input tests then see the gateway's handling, not this engine's crash)."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except (KeyError, TypeError, AttributeError, ValueError, OverflowError) as exc:
            return JSONResponse({"error": {"message": f"invalid request: {exc!r}",
                                           "type": "BadRequestError", "code": 400}},
                                status_code=400)

    return route


class EngineServer:
    """A ``FakeEngine`` on uvicorn in a background thread, on a free port."""

    def __init__(self, engine: FakeEngine | None = None, port: int | None = None,
                 host: str = "127.0.0.1") -> None:
        """``port``: a given one (an engine restarted where it was), else a free one;
        ``host``: a loopback address (engines found by DNS share a port on several)."""
        self.engine = engine or FakeEngine()
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(
            self.engine.app(), host=host, port=self.port, log_level="warning",
            lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> EngineServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake engine did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
