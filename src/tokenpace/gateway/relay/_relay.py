"""The hot path: the engine call of a dispatched request, and the relay of its answer.

Non-streamed requests pass the engine's answer on as it is (usage read from it); streamed
ones relay the engine's SSE events as they come, one ``send`` per network read, counting
tokens from the usage the engine reports in the stream; what a client reading slower than
its engine writes has yet to read is kept in memory (``ClientPipe``, bounded), so a stream
is settled, its engine slot back, when the engine's stream ends, not when the client has
read it. However either ends, it ends in one ``Exchange.finish`` with its ``Outcome``. One cut short before the engine's final
usage (the client left, ``request_timeout``, the engine stream broke) is settled in the
background once the engine said what it generated (``_counts``): the larger of that and
what was relayed, or where the engine cannot tell, what was relayed (streams) or the
reservation (non-streamed requests).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..engines import ConnectFailed, Upstream, UpstreamError, UpstreamResponse
from ..exchange import Exchange, Outcome
from ..wire import (
    POOLING_KINDS,
    ROUTES,
    ChunkRewriter,
    EventScanner,
    EventSplitter,
    GatewayError,
    ParsedRequest,
    answer_cached,
    answer_usage,
    anthropic_error_body,
    error_body,
    headroom_headers,
    parse_request,
    pooling_usage,
    stream_error_event,
)
from ._counts import ABORT_WAIT_S, ask_engine_counts
from ._pipe import ClientPipe, client_flow
from ._watch import ClientWatch

PATHS = ROUTES


async def engine_output_count(ex: Exchange, n: int | None = 1,
                              prompts: int | None = 1) -> int | None:
    """The tokens the engine generated for ``ex``, a request cut short
    (``ask_engine_counts``, within ``ABORT_WAIT_S``); None where the engine cannot tell.
    Where the engine gives the prompt's count and the gateway never got one (admitted on
    the prompt's byte bound), the exchange learns it (``Exchange.learn_prompt``).
    ``n``, ``prompts``: the request's shape (None: not known, the engine's answers tell).
    Called only for a request whose usage did not arrive whole: about 1 to 3 calls."""
    assert ex.lease is not None
    client = ex.rt.clients.get(ex.lease.engine.url)
    if client is None:  # the engine left the configuration meanwhile
        return None
    counts = await ask_engine_counts(client, ex.kind, ex.id, ABORT_WAIT_S, n=n,
                                     prompts=prompts)
    if counts is None:
        return None
    prompt, output = counts
    if prompt is not None and ex.prompt_bound is not None:
        ex.learn_prompt(prompt)
    return output


def _settle_with_engine(ex: Exchange, watch: ClientWatch, outcome: Outcome,
                        detail: str | None, n: int | None, prompts: int | None,
                        unknown: int) -> None:
    """Settle ``ex`` in the background once the engine said what it generated: the
    larger of that and what the gateway relayed (``ex.completion_tokens``), or
    ``unknown`` where the engine cannot tell. The slot is held until then: the engine
    works on the request until the abort lands. The task is kept in ``rt.settling``."""

    async def settle() -> None:
        try:
            count = await engine_output_count(ex, n, prompts)
            ex.completion_tokens = (unknown if count is None
                                    else max(count, ex.completion_tokens))
        finally:
            ex.finish(outcome, detail)
            watch.stop()

    task = asyncio.get_running_loop().create_task(settle())
    ex.rt.settling.add(task)
    task.add_done_callback(ex.rt.settling.discard)


def _shape(ex: Exchange, body: bytes) -> tuple[int | None, int | None]:
    """(n, prompts) of a chat or completion request from its engine body (None, None when
    it cannot be read: the engine's answers tell). Only for a request cut short: one
    ``json.loads`` of the body."""
    if ex.kind not in ("chat", "completion"):
        return 1, 1
    try:
        config = ex.rt.config
        parsed = parse_request(ex.kind, json.loads(body), config.max_model_name_chars,
                               config.max_prompts_per_request)
    except (ValueError, RecursionError, GatewayError):
        return None, None
    return parsed.n, parsed.prompts


def _ratelimit_headers(ex: Exchange) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers of an admitted request (``wire._ratelimit``)."""
    if ex.requests_headroom is None and ex.tokens_headroom is None:
        return {}
    return headroom_headers(ex.requests_headroom, ex.tokens_headroom)


def _upstream_headers(ex: Exchange, extra: Mapping[str, str] | None) -> dict[str, str]:
    """A completion's headers to its engine; ``extra``: those a router in front of engines
    reads (``engines.RouterHeaders``, names that never collide with these: ``config``)."""
    headers = {"content-type": "application/json", "x-request-id": ex.id}
    if extra:
        headers.update(extra)
    return headers


UNAVAILABLE = 503
"""An engine's answer that it takes no request now, before any work on this one: vLLM when
its own queue limits are reached (``--max-num-queued-reqs``) or while elastic expert
parallelism scales. Taken as brief: the engine is back at the next probe that answers."""
SHUTTING_DOWN = b"after shutdown"
"""In a 500 answer: vLLM's API server shutting down (SIGTERM, draining for
``--shutdown-timeout``) answers every new request so ("cannot schedule new futures after
shutdown", its executors are closed) while its ``/health`` still answers 200 and its
requests in flight finish. Measured on vLLM 0.32 (docs/gateway/failures.md, When engines fail)."""


ADAPTER_MISSING = b"does not exist"
"""In vLLM's 404 for a model it does not serve: for a LoRA adapter the gateway believed the
engine held (another replica, or an operator, unloaded it since the gateway's last look),
the request was not taken, and goes again once the adapter is loaded."""


def not_taken(status: int, content: bytes, adapter: bool = False) -> tuple[bool, bool]:
    """Whether an engine's answer says it did not take the request (so it may go to another
    engine, or again: ``adapter``, a request for a LoRA adapter the engine does not hold),
    and whether the engine is shutting down. One comparison on a 200."""
    if status == UNAVAILABLE or (adapter and status == 404 and ADAPTER_MISSING in content):
        return True, False
    if status == 500 and SHUTTING_DOWN in content:
        return True, True
    return False, False


class NotReached(Exception):
    """The engine did not take the request: it refused the connection (nothing was sent)
    or answered that it takes none now (``not_taken``), so the request may go to another
    engine. The exchange is left open (not finished) for the caller to retry."""

    def __init__(self, answered: int | None = None, stopping: bool = False) -> None:
        super().__init__(answered)
        self.answered = answered  # the engine's status; None: the connection was refused
        self.stopping = stopping  # the engine said it is shutting down


async def call(ex: Exchange, upstream: Upstream, body: bytes, watch: ClientWatch,
               deadline: float, headers: Mapping[str, str] | None = None) -> Response:
    """A non-streaming request (every pooling request): the engine's answer is passed on
    as it is, held once in memory (bounded by the engine's answer; a pooling answer's
    usage is read without parsing its vectors). A pooling request cut short is charged
    what admission counted (the engine keeps no book of pooling requests). Raises
    ``NotReached`` (the exchange still open) when the engine refused the connection.
    ``headers``: the router headers of this request on this engine, if any."""
    outcome, detail = Outcome.CANCELLED, None
    resp = None
    reached = True
    cut = False
    try:
        async with watch.guard(deadline) as scope:
            try:
                resp = await upstream.post(PATHS[ex.kind], body, _upstream_headers(ex, headers))
                content = await resp.read()
            except ConnectFailed:
                reached = False
                raise NotReached() from None
            except UpstreamError as exc:
                ex.charge_usage = False
                outcome = Outcome.UPSTREAM_ERROR
                raise GatewayError(502, f"engine failed: {type(exc).__name__}",
                                   reason="engine_error", code="engine_error") from None
        if scope.cancelled_caught:
            # The answer never arrived: the engine is asked what it generated (settled in
            # the background, ``_settle_with_engine``); where it cannot tell, the
            # reservation (max_tokens) stands as the charge.
            cut = True
            if watch.gone:
                return Response(status_code=499)
            outcome = Outcome.TIMEOUT
            return _timeout_response(ex)
        assert resp is not None
        taken_not, stopping = not_taken(resp.status, content,
                                        ex.rt.config.adapter(ex.model) is not None)
        if taken_not:
            reached, outcome = False, Outcome.UPSTREAM_ERROR  # read whole: the connection is kept
            raise NotReached(resp.status, stopping)
        if resp.status != 200:
            ex.charge_usage = False
            outcome = Outcome.UPSTREAM_ERROR
            if resp.status in NOT_SERVED and ex.kind in POOLING_KINDS \
                    and b'"error"' not in content:  # not vLLM's own error (a model unknown)
                return _not_served(ex, resp.status)
            return Response(content, status_code=resp.status,
                            media_type=resp.headers.get("content-type"),
                            headers={"x-request-id": ex.id})
        try:
            if ex.kind in POOLING_KINDS:
                # Only the usage is read (vectors are skipped, not parsed); no output.
                reported, reason = pooling_usage(content), None
            else:
                answer = json.loads(content)
                reported, ex.completion_tokens, reason = answer_usage(ex.kind, answer)
                # Cached prompt tokens: a few dict lookups on the answer already parsed.
                ex.learn_cached(answer_cached(ex.kind, answer))
            if reported:
                ex.learn_prompt(int(reported))
            outcome, detail = Outcome.FINISHED, reason
        except (ValueError, AttributeError, TypeError):
            outcome = Outcome.UPSTREAM_ERROR
        return Response(content, status_code=200, media_type="application/json",
                        headers={"x-request-id": ex.id, **_ratelimit_headers(ex)})
    finally:
        if resp is not None:
            if outcome in (Outcome.CANCELLED, Outcome.TIMEOUT):
                resp.close()  # the engine sees the connection go and aborts the request
            else:
                resp.release()
        if not reached:
            pass
        elif cut and ex.lease is not None and ex.charge_usage \
                and ex.kind not in POOLING_KINDS:
            _settle_with_engine(ex, watch, outcome, detail, *_shape(ex, body),
                                unknown=ex.max_completion_tokens)
        else:
            if cut:
                ex.completion_tokens = ex.max_completion_tokens
            ex.finish(outcome, detail)
            watch.stop()


NOT_SERVED = (404, 405)
"""An engine's answer on a pooling route its model does not serve: vLLM registers each
pooling route only for a model whose runner supports it (FastAPI's plain 404 otherwise,
``{"detail": "Not Found"}``; vLLM's own errors, such as an unknown model's 404, carry an
``error`` object and pass as they are)."""


def _not_served(ex: Exchange, status: int) -> Response:
    """A 400 in OpenAI's format for a pooling route the request's model does not serve
    (the engine's own answer is FastAPI's, in no API's format)."""
    message = (f"model {ex.model!r} does not serve {ROUTES[ex.kind]} (its engine answered "
               f"{status}): a pooling model serves the routes of its task only")
    return Response(json.dumps(error_body(400, message, "unsupported_route", "model")),
                    status_code=400, media_type="application/json",
                    headers={"x-request-id": ex.id})


def _timeout_response(ex: Exchange) -> Response:
    message = f"the request did not finish within request_timeout ({ex.rt.config.request_timeout_s:g} s)"
    body = (anthropic_error_body(504, message, "timeout") if ex.kind == "messages"
            else error_body(504, message, "timeout"))
    return Response(json.dumps(body), status_code=504, media_type="application/json",
                    headers={"x-request-id": ex.id})


async def open_stream(ex: Exchange, upstream: Upstream, req: ParsedRequest, body: bytes,
                      watch: ClientWatch, deadline: float,
                      headers: Mapping[str, str] | None = None) -> Response | "StreamResponse":
    """Start the engine stream; its status decides between a pass-through error and SSE.
    Raises ``NotReached`` (the exchange still open) when the engine refused the connection.
    ``headers``: the router headers of this request on this engine, if any."""
    outcome = Outcome.CANCELLED
    resp: UpstreamResponse | None = None
    try:
        async with watch.guard(deadline) as scope:
            try:
                resp = await upstream.post(PATHS[ex.kind], body, _upstream_headers(ex, headers))
            except ConnectFailed:
                raise NotReached() from None
            except UpstreamError as exc:
                ex.charge_usage = False
                outcome = Outcome.UPSTREAM_ERROR
                raise GatewayError(502, f"engine failed: {type(exc).__name__}",
                                   reason="engine_error", code="engine_error") from None
            if resp.status != 200:
                try:
                    content = await resp.read()
                except UpstreamError:
                    content = b""
                resp.release()
                taken_not, stopping = not_taken(resp.status, content,
                                                ex.rt.config.adapter(ex.model) is not None)
                if taken_not:
                    raise NotReached(resp.status, stopping)
                ex.charge_usage = False
                outcome = Outcome.UPSTREAM_ERROR
                ex.finish(outcome)
                watch.stop()
                return Response(content, status_code=resp.status,
                                media_type=resp.headers.get("content-type"),
                                headers={"x-request-id": ex.id})
        if scope.cancelled_caught:
            if resp is not None:
                resp.close()  # closing the connection makes the engine abort the request
            ex.charge_usage = False
            outcome = Outcome.CANCELLED if watch.gone else Outcome.TIMEOUT
            ex.finish(outcome)
            watch.stop()
            return Response(status_code=499) if watch.gone else _timeout_response(ex)
        assert resp is not None
        return StreamResponse(ex, resp, req, watch, deadline)
    except NotReached:
        raise
    except BaseException:
        if resp is not None:
            resp.close()
        ex.finish(outcome)
        watch.stop()
        raise


LAST_BODY = {"type": "http.response.body", "body": b"", "more_body": False}


class StreamResponse:
    """ASGI response relaying the engine's SSE stream; settles the exchange however it ends."""

    def __init__(self, ex: Exchange, upstream: UpstreamResponse, req: ParsedRequest,
                 watch: ClientWatch, deadline: float) -> None:
        self.ex = ex
        self.upstream = upstream
        self.n, self.prompts = req.n, req.prompts
        self.batch = req.prompts > 1
        # Chat and completion chunks are rewritten (usage cut out as the client asked);
        # Responses and Messages events go through unchanged, only read (``wire._usage``).
        self.rewriter: ChunkRewriter | None = None
        self.scanner: EventScanner | None = None
        if req.kind in ("chat", "completion"):
            self.rewriter = ChunkRewriter(req.client_wants_usage,
                                          req.client_wants_continuous_usage, req.n, req.prompts)
            self.progress = self.rewriter.progress
        else:
            self.scanner = EventScanner()
            self.progress = self.scanner.progress
        self.watch = watch
        self.deadline = deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex, progress, watch = self.ex, self.progress, self.watch
        config = ex.rt.config
        pipe = ClientPipe(send, client_flow(scope), config.stream_buffer_bytes,
                          config.tenant_stream_buffer_bytes, ex.rt.backlogs, ex.tenant.id)
        outcome, detail = Outcome.CANCELLED, None
        ended = False  # the engine's part is over and the exchange settled
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-request-id", ex.id.encode()),
                *((k.encode(), v.encode()) for k, v in _ratelimit_headers(ex).items()),
            ]})
            async with watch.guard(self.deadline) as cancel:
                failure = await self._relay(send, pipe)
                if failure is not None or progress.error is not None or not progress.done:
                    outcome = Outcome.UPSTREAM_ERROR
                    if failure is not None or not progress.done and progress.error is None:
                        pipe.put(stream_error_event(
                            ex.kind, 502, failure or "the engine stream ended early",
                            "engine_error"))
                else:
                    outcome, detail = Outcome.FINISHED, progress.finish_reason
                # The engine's answer is complete: its slot goes back and the request is
                # settled now; a slow client reads the rest from memory, within the
                # request's deadline.
                ended = True
                self._end(outcome, detail)
                await pipe.drain()
                await send(LAST_BODY)
            if not cancel.cancelled_caught:
                return
            if ended:  # the client did not read the answer within request_timeout
                pipe.flow.abort()
                return
            outcome = Outcome.CANCELLED if watch.gone else Outcome.TIMEOUT
            if outcome is Outcome.TIMEOUT:
                pipe.put(stream_error_event(ex.kind, 504, "the request did not finish "
                                            "within request_timeout", "timeout"))
                with anyio.move_on_after(1.0, shield=True) as late:
                    await pipe.drain()
                    await send(LAST_BODY)
                if late.cancelled_caught:
                    pipe.flow.abort()
        except OSError:
            outcome = Outcome.CANCELLED  # the client socket broke while we wrote to it
        finally:
            pipe.discard()
            if not ended:
                self._end(outcome, detail)

    def _end(self, outcome: Outcome, detail: str | None) -> None:
        """The engine's part is over: its connection back (or closed, which aborts the
        request), what it generated onto the exchange, and the exchange settled (its slot
        back), at once or once the engine said what it generated."""
        ex, progress = self.ex, self.progress
        if progress.done:
            self.upstream.release()
        else:
            self.upstream.close()  # the engine sees the connection go and aborts
        ex.completion_tokens = progress.completion_tokens
        if progress.prompt_tokens is not None and not (
                self.batch and progress.prompt_tokens < ex.prompt_tokens):
            # (A batch cut short reported only some prompts: the admission's count stands.)
            ex.learn_prompt(progress.prompt_tokens)
        # Read with the final usage (wire: nothing per token); None when not reported.
        ex.learn_cached(progress.cached_tokens)
        if not progress.final and ex.lease is not None and ex.charge_usage:
            # A stream cut short, before the engine's final usage: the engine may have
            # generated more than was relayed (Responses and Messages events carry no
            # count at all until the end), and only it knows how much more.
            _settle_with_engine(ex, self.watch, outcome, detail, self.n, self.prompts,
                                unknown=ex.completion_tokens)
        else:
            ex.finish(outcome, detail)
            self.watch.stop()

    async def _relay(self, send: Send, pipe: ClientPipe) -> str | None:
        """Copy events until the engine ends the stream; return a failure description.

        The events of one network read go out in one ``send``: one write per read, not
        per event. Responses and Messages streams go out as read (their events are only
        scanned) and are read to their end: their last event is not followed by a
        ``[DONE]`` line, and its closing blank line may come in a later read.
        """
        ex, rewriter, scanner = self.ex, self.rewriter, self.scanner
        progress = self.progress
        splitter = EventSplitter()
        flow = pipe.flow
        try:
            upstream = self.upstream
            # Per read: one await on the connection; per event a few bytes operations
            # (EventSplitter, ChunkRewriter or EventScanner); one send per read.
            while data := await upstream.chunk():
                if scanner is not None:
                    for payload in splitter.feed(data):
                        scanner.event(payload)
                    body = data
                else:
                    assert rewriter is not None
                    out = []
                    for payload in splitter.feed(data):
                        event = rewriter.event(payload)
                        if event is not None:
                            out.append(b"data: " + event + b"\n\n")
                    body = b"".join(out)
                if progress.first_token and ex.ttft_s is None:
                    ex.ttft_s = ex.rt.clock() - ex.arrived
                if progress.prompt_tokens is not None and not ex.prompt_counted \
                        and not self.batch:
                    # The first usage: the exact prompt count (once; corrects a reservation
                    # made on the prompt's byte bound).
                    ex.learn_prompt(progress.prompt_tokens)
                if progress.completion_tokens > ex.completion_tokens or not ex.prompt_counted:
                    ex.completion_tokens = progress.completion_tokens
                    ex.charge_progress()
                if body:
                    # Two attribute reads: is the client keeping up? If not, the bytes are
                    # kept (``ClientPipe``) and the engine read on.
                    if not pipe.held and not flow.paused:
                        await send({"type": "http.response.body", "body": body,
                                    "more_body": True})
                    else:
                        await pipe.hold(body)
                if progress.done and scanner is None:
                    return None
            for payload in splitter.flush():
                if scanner is not None:
                    scanner.event(payload)
                    continue
                assert rewriter is not None
                event = rewriter.event(payload)
                if event is not None:
                    pipe.put(b"data: " + event + b"\n\n")
        except UpstreamError as exc:
            return f"the engine stream failed: {type(exc).__name__}"
        return None
