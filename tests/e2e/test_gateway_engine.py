"""The gateway in front of a real ``tokenpace serve --trusted-gateway`` on the tiny model.

Checks what only a real engine can show: prompt tokens counted exactly as vLLM counts them
(chat template included), the tenant's rate from the gateway configuration pacing the
engine, usage in the ledger equal to vLLM's, and a client that leaves mid-stream aborting
the engine's request.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tokenpace.gateway.engines import PromptBounds
from tokenpace.gateway.engines._prompt_bound import bound as prompt_bound
from tokenpace.gateway.wire import parse_request

from tests._engine_pool import ModuleEngines
from tests._servers import Server, free_port, tokenpace_serve_argv
from tests.e2e._engine_log import (
    all_dispatches,
    engine_requests,
    paced_rate,
    wait_for_engine_requests,
)
from tests.e2e._timing import expect
from tests.gateway.conftest import GatewayProcess

pytestmark = pytest.mark.vllm

KEY_SLOW, KEY_FAST, KEY_BUDGET = "sk-slow", "sk-fast", "sk-budget"
KEY_READERS = "sk-readers"
KEY_LONG = "sk-long"  # uncapped, paced fast: answers that outlast a client that leaves
KEY_APPS_BOT = "sk-apps-bot"
KEY_APPS_CHAT = "sk-apps-chat"
BUDGET = 10000  # per day: refills 0.12 per second
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    port = free_port()
    return [Server(tokenpace_serve_argv(tiny_model, port, "--trusted-gateway",
                                        "--allow-unauthenticated-trusted-gateway",
                                        "--scheduling-policy", "priority",
                                        "--output-rate-event-log", str(home / "events.jsonl")),
                   port, home / "vllm.log")]


@pytest.fixture(scope="module")
def engine(module_engines: ModuleEngines) -> Server:
    [srv] = module_engines.servers
    return srv


def engine_prompt_tokens(engine: Server) -> tuple[int, int]:
    """vLLM's own prompt counts of CHAT and of the plain prompt "Hello world"."""
    chat = httpx.post(f"{engine.base_url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": CHAT, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    plain = httpx.post(f"{engine.base_url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "Hello world", "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    return chat, plain


@pytest.fixture(scope="module")
def gateway(engine: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    chat_tokens, _ = engine_prompt_tokens(engine)
    home = tmp_path_factory.mktemp("gateway")
    config: dict[str, Any] = {
        "engines": [{"url": engine.base_url, "max_inflight": 16, "scheduling_policy": "priority"}],
        "cost": {"prompt": 1.0, "completion": 2.0},
        "lanes": [{"name": "interactive", "priority": 0}, {"name": "batch", "priority": 10}],
        "ledger": f"sqlite:///{home / 'usage.db'}",
        "tenants": [
            {"id": "slow", "api_keys": [KEY_SLOW], "lane": "batch", "output_tokens_per_second": 20},
            # Exactly the engine's count of CHAT: one token more must be refused.
            {"id": "fast", "api_keys": [KEY_FAST], "lane": "interactive",
             "max_input_tokens": chat_tokens, "max_output_tokens": 200},
            {"id": "long", "api_keys": [KEY_LONG], "lane": "interactive",
             "output_tokens_per_second": 300},
            # A cap and a budget the byte bound of short prompts fits: no /tokenize first.
            {"id": "budgeted", "api_keys": [KEY_BUDGET], "max_input_tokens": 2000,
             "budgets": [{"tokens": BUDGET, "per": "1d"}]},
            # End users (the OpenAI "user" field) paced at 6 tok/s each inside 20.
            {"id": "readers", "api_keys": [KEY_READERS], "output_tokens_per_second": 20,
             "end_user_output_tokens_per_second": 6},
            # Applications: bot paced at 5 tok/s inside the tenant's 20, chat unpaced.
            {"id": "apps", "output_tokens_per_second": 20, "applications": [
                {"id": "bot", "api_keys": [KEY_APPS_BOT], "output_tokens_per_second": 5},
                {"id": "chat", "api_keys": [KEY_APPS_CHAT]}]},
        ],
    }
    gw = GatewayProcess(home, config).start()
    try:
        yield gw
    finally:
        gw.stop()


def api(gw: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=120)


def test_prompt_tokens_are_counted_as_the_engine_counts_them(gateway: GatewayProcess,
                                                            engine: Server) -> None:
    chat_tokens, _ = engine_prompt_tokens(engine)
    fast = api(gateway, KEY_FAST)
    ok = fast.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    assert ok.usage.prompt_tokens == chat_tokens
    longer = [CHAT[0], {"role": "user", "content": CHAT[1]["content"] + " again"}]
    with pytest.raises(openai.BadRequestError) as info:
        fast.chat.completions.create(model="tiny", messages=longer, max_tokens=4)
    assert f"at most {chat_tokens} (max_input_tokens)" in info.value.message


def test_tenant_rate_from_the_gateway_paces_the_engine(gateway: GatewayProcess,
                                                      engine: Server) -> None:
    """The rate at the engine (event log, net of the engine's absences: see
    ``paced_rate``), not between chunks as the client read them.

    60 tokens at 20 tok/s span 2.85 s; 10% is 0.29 s of lag, and GCRA cannot run faster
    than the rate. The unpaced tenant is not in the event log (it has no rate), so its
    check is the whole request, send to last byte: paced at 20 tok/s its 60 tokens could
    not take less than (60 - 1 - 2) / 20 = 2.85 s (GCRA is exact), unpaced they took
    0.33-1.54 s at load averages of 14-22 on 2 cores (the old bound, 1.5 s, failed once
    in 10 there).
    """
    tokens = 60
    events = engine.log_path.parent / "events.jsonl"
    since = time.monotonic()
    usage = None
    chunks = api(gateway, KEY_SLOW).completions.create(
        model="tiny", prompt="Hello", max_tokens=tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == tokens
    [request] = wait_for_engine_requests(events, {"slow"}, since, tokens)
    assert len(request.times) == tokens, (len(request.times), events)
    rate = paced_rate(request.times, 20, all_dispatches(events, since))
    logs = [engine.log_path, events]
    for bound, upper in ((0.9 * 20, False), (1.1 * 20, True)):
        expect("gateway_engine", "slow tenant's paced rate (20 tok/s)", rate.paced_rate, bound,
               upper=upper, logs=logs, **rate.as_series())
    # The unpaced tenant is not held to that rate.
    t0 = time.monotonic()
    api(gateway, KEY_FAST).completions.create(model="tiny", prompt="Hello", max_tokens=60,
                                              extra_body={"ignore_eos": True})
    expect("gateway_engine", "unpaced tenant's 60 tokens (s)", time.monotonic() - t0,
           (60 - 1 - 0.1 * 20) / 20, logs=logs)


def test_ledger_usage_equals_engine_usage(gateway: GatewayProcess) -> None:
    t0 = time.time()
    fast = api(gateway, KEY_FAST)
    reported = []
    r = fast.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12)
    reported.append((r.usage.prompt_tokens, r.usage.completion_tokens))
    chunks = list(fast.chat.completions.create(model="tiny", messages=CHAT, max_tokens=15,
                                               stream=True, stream_options={"include_usage": True}))
    reported.append((chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens))
    rows = gateway.rows_since(t0, 2)
    assert sorted((x.prompt_tokens, x.completion_tokens) for x in rows) == sorted(reported)
    assert all(x.finish_reason in ("stop", "length") for x in rows)


def test_client_leaving_mid_stream_aborts_the_engine_request(gateway: GatewayProcess,
                                                             engine: Server) -> None:
    t0 = time.time()
    received = 0
    with httpx.stream("POST", f"{gateway.url}/v1/completions",
                      headers={"authorization": f"Bearer {KEY_SLOW}"}, timeout=60,
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 1000,
                            "ignore_eos": True, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                received += 1
                if received == 10:
                    break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{engine.base_url}/metrics").text
        running = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")]
        if running and all(float(line.rsplit(" ", 1)[1]) == 0 for line in running):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the engine still runs the abandoned request")
    [row] = gateway.rows_since(t0, 1)
    assert row.finish_reason == "cancelled"
    assert 10 <= row.completion_tokens <= 13  # what the engine had streamed when we left


# Text a normalizer could lengthen or a tokenizer could split finely: accents precomposed
# and combining, CJK, emoji with modifiers and joiners, NFKC and NFC expansions (U+FDFA,
# U+0958), a ligature, dotted capital I, control characters, whitespace runs, the
# template's own markers inside a content.
TEXTS = ["Hello world", "h\u00e9llo w\u00f6rld e\u0301", "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
         "\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467", "\ufdfa \u0958\u0959 \ufb03 \u0130stanbul",
         "  many   spaces\n\n\ttabs \x01\x7f", "<|user|> not a turn <|assistant|>",
         "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440 " * 20]


def test_the_byte_bound_is_never_below_the_engines_count(engine: Server) -> None:
    """The bound the gateway admits on (overhead learned by its own probes of this engine)
    against vLLM's prompt_tokens, for chat and completions, ASCII and not."""
    async def learn() -> tuple[object, object]:
        bounds = PromptBounds()
        async with httpx.AsyncClient(base_url=engine.base_url) as client:
            chat = await bounds.learned(client, engine.base_url, "tiny", "chat")
            plain = await bounds.learned(client, engine.base_url, "tiny", "completion")
        return chat, plain

    chat, plain = asyncio.run(learn())
    assert chat is not None and chat.overhead is not None  # type: ignore[attr-defined]
    assert plain is not None and plain.overhead is not None  # type: ignore[attr-defined]
    checked = []
    for text in TEXTS:
        bodies = [
            ("completion", {"model": "tiny", "prompt": text}),
            ("chat", {"model": "tiny", "messages": [{"role": "user", "content": text}]}),
            ("chat", {"model": "tiny", "messages": [
                {"role": "system", "content": text}, {"role": "user", "content": text},
                {"role": "assistant", "content": text, "name": "bot"},
                {"role": "user", "content": [{"type": "text", "text": text}]}]}),
        ]
        for kind, body in bodies:
            learned = chat if kind == "chat" else plain
            claimed = prompt_bound(parse_request(kind, {**body, "max_tokens": 1}),
                            learned.overhead)  # type: ignore[attr-defined]
            path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            usage = httpx.post(f"{engine.base_url}{path}", timeout=60,
                               json={**body, "max_tokens": 1}).json()["usage"]
            checked.append((kind, text[:12], usage["prompt_tokens"], claimed))
    assert all(claimed is not None and count <= claimed for _, _, count, claimed in checked), checked


def test_a_budgeted_tenant_admitted_on_the_bound_is_charged_the_engines_count(
        gateway: GatewayProcess) -> None:
    """Ledger rows equal vLLM's usage and the budget is exact after settlement, for
    requests the gateway admitted on the byte bound (their reservation was larger)."""
    t0 = time.time()
    client = api(gateway, KEY_BUDGET)
    reported = []
    msgs = [{"role": "user", "content": TEXTS[1]}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5)
    reported.append((r.usage.prompt_tokens, r.usage.completion_tokens))
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                                 stream=True, stream_options={"include_usage": True}))
    reported.append((chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens))
    c = client.completions.create(model="tiny", prompt=TEXTS[2], max_tokens=4)
    reported.append((c.usage.prompt_tokens, c.usage.completion_tokens))
    rows = gateway.rows_since(t0, 3)
    assert sorted((x.prompt_tokens, x.completion_tokens) for x in rows) == sorted(reported)
    spent = sum(p + 2 * c for p, c in reported)  # cost: prompt 1, completion 2
    level = gateway.metric("tokenpace_gateway_budget_remaining_tokens", tenant="budgeted")
    # refill 0.12 per second: within 2 for the 16 s these requests may take under load
    assert level == pytest.approx(BUDGET - spent, abs=2)


# -- the Responses and Messages APIs, batched prompts ------------------------------------------

def claude(gw: GatewayProcess, key: str) -> anthropic.Anthropic:
    """The anthropic SDK as Claude Code configures it: the key in ``x-api-key``."""
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=120)


def test_responses_api_plain_and_streamed_are_admitted_and_charged(gateway: GatewayProcess) -> None:
    """The openai SDK's ``responses.create`` through the gateway, for a tenant with a cap
    and a budget (its prompt is counted before dispatch): the ledger holds what the
    client was told, on the route it called."""
    t0 = time.time()
    client = api(gateway, KEY_BUDGET)
    plain = client.responses.create(model="tiny", instructions="You are terse.",
                                    input="Hello there", max_output_tokens=7)
    reported = [(plain.usage.input_tokens, plain.usage.output_tokens)]
    assert plain.status == "incomplete" and plain.usage.output_tokens == 7
    completed = None
    for event in client.responses.create(model="tiny", input=[{"role": "user", "content": "Hi"}],
                                         max_output_tokens=9, stream=True):
        if event.type == "response.completed":
            completed = event.response
    assert completed is not None and completed.usage.output_tokens == 9
    reported.append((completed.usage.input_tokens, completed.usage.output_tokens))
    rows = gateway.rows_since(t0, 2)
    assert sorted((r.prompt_tokens, r.completion_tokens) for r in rows) == sorted(reported)
    assert {(r.route, r.finish_reason) for r in rows} == {("/v1/responses", "length")}
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="tiny", input="Hi", previous_response_id=plain.id)


def test_messages_api_plain_streamed_and_counted(gateway: GatewayProcess) -> None:
    """The anthropic SDK's ``messages.create`` (plain, streamed) and ``count_tokens``: the
    count equals the engine's usage, the ledger equals what the client received."""
    t0 = time.time()
    client = claude(gateway, KEY_BUDGET)
    messages = [{"role": "user", "content": "Hello there"}]
    counted = client.messages.count_tokens(model="tiny", system="You are terse.",
                                           messages=messages).input_tokens
    plain = client.messages.create(model="tiny", system="You are terse.", max_tokens=6,
                                   messages=messages)
    assert plain.usage.input_tokens == counted and plain.usage.output_tokens == 6
    assert plain.stop_reason == "max_tokens"
    with client.messages.stream(model="tiny", max_tokens=8, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage.output_tokens == 8 and isinstance(text, str)
    rows = gateway.rows_since(t0, 2)
    assert sorted((r.prompt_tokens, r.completion_tokens) for r in rows) == sorted(
        [(counted, 6), (final.usage.input_tokens, 8)])
    assert {(r.route, r.finish_reason) for r in rows} == {("/v1/messages", "length")}
    with pytest.raises(anthropic.AuthenticationError) as info:
        claude(gateway, "sk-nobody").messages.create(model="tiny", max_tokens=4,
                                                     messages=messages)
    assert info.value.body["error"]["type"] == "authentication_error"


def test_a_responses_request_carries_the_tenants_identity_and_rate(gateway: GatewayProcess,
                                                                  engine: Server) -> None:
    """At the engine (its event log), a Responses request of the paced tenant runs as that
    tenant, under the gateway's request id, at the tenant's rate (20 tok/s, within 10%
    as the chat test above, net of the engine's absences)."""
    tokens = 40
    events = engine.log_path.parent / "events.jsonl"
    since = time.monotonic()
    t0 = time.time()
    done = api(gateway, KEY_SLOW).responses.create(
        model="tiny", input="Hello", max_output_tokens=tokens, extra_body={"ignore_eos": True})
    assert done.usage.output_tokens == tokens
    [request] = wait_for_engine_requests(events, {"slow"}, since, tokens)
    [row] = gateway.rows_since(t0, 1)
    assert request.request_id.startswith(f"resp_{row.request_id}")
    assert len(request.times) == tokens and row.route == "/v1/responses"
    rate = paced_rate(request.times, 20, all_dispatches(events, since))
    logs = [engine.log_path, events]
    for bound, upper in ((0.9 * 20, False), (1.1 * 20, True)):
        expect("gateway_engine", "Responses request's paced rate (20 tok/s)", rate.paced_rate,
               bound, upper=upper, logs=logs, **rate.as_series())


@pytest.mark.parametrize("route, delta", [
    ("/v1/responses", "event: response.output_text.delta"),
    ("/v1/messages", "event: content_block_delta"),
])
def test_an_abandoned_stream_is_charged_what_the_engine_generated(
        gateway: GatewayProcess, engine: Server, route: str, delta: str) -> None:
    """A Responses or Messages stream the client leaves after 10 text events (their
    events carry no usage until the end): the engine aborts the request, the gateway asks
    it what the request generated (``POST /tokenpace/v1/aborted``), and the ledger charges
    exactly that: the count in the engine's event log. The tiny model's random bytes
    often end a token inside a UTF-8 character, so 10 events are usually more than 10
    tokens: the events alone would undercount."""
    events = engine.log_path.parent / "events.jsonl"
    since = time.monotonic()
    t0 = time.time()
    received = 0
    body: dict[str, Any] = {"model": "tiny", "stream": True, "ignore_eos": True}
    if route == "/v1/responses":
        body |= {"input": "Hello", "max_output_tokens": 1000}
    else:
        body |= {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1000}
    with httpx.stream("POST", f"{gateway.url}{route}", json=body, timeout=60,
                      headers={"x-api-key": KEY_SLOW}) as resp:
        for line in resp.iter_lines():
            if line.startswith(delta):
                received += 1
                if received == 10:
                    break
    [row] = gateway.rows_since(t0, 1)
    assert row.finish_reason == "cancelled" and row.route == route
    [request] = wait_for_engine_requests(events, {"slow"}, since, row.completion_tokens)
    time.sleep(0.5)  # the event log is written every 200 ms: the abort's last tokens
    [request] = [r for r in engine_requests(events, {"slow"}, since)
                 if r.request_id == request.request_id]
    book = engine_book(engine, [request.request_id])["output_tokens"]
    assert received <= row.completion_tokens == book[request.request_id] < 1000, (
        received, row.completion_tokens, book)
    # The event log may hold one charge more: a step running when the abort came.
    assert 0 <= len(request.times) - row.completion_tokens <= 1, (row, len(request.times))


def engine_book(engine: Server, ids: list[str]) -> dict[str, Any]:
    """The engine's own answer for ``ids`` (``POST /tokenpace/v1/aborted``), asked directly."""
    return httpx.post(f"{engine.base_url}/tokenpace/v1/aborted", timeout=10,
                      json={"request_ids": ids}).json()


def generated_by(events: Path, request_id: str, since: float, tokens: int) -> list[int]:
    """Tokens in the engine's event log of each engine request of gateway request
    ``request_id`` (ids ``chatcmpl-<id>-...``, ``0_cmpl-<id>-1-...``), by engine id."""
    wait_for_engine_requests(events, {"slow"}, since, tokens)
    time.sleep(0.5)  # the event log is written every 200 ms: the abort's last tokens
    return [len(r.times) for r in sorted(engine_requests(events, {"slow"}, since),
                                         key=lambda r: r.request_id)
            if f"cmpl-{request_id}" in r.request_id]


@pytest.mark.parametrize("route,fields,ids", [
    # n = 2: two engine requests sharing one prompt, "{i}_chatcmpl-<id>".
    ("/v1/chat/completions", {"messages": CHAT, "n": 2}, ["0_chatcmpl-{id}", "1_chatcmpl-{id}"]),
    # Two prompts: "cmpl-<id>-0" and "cmpl-<id>-1", each its own prompt.
    ("/v1/completions", {"prompt": ["Hello", "Goodbye now"]}, ["cmpl-{id}-0", "cmpl-{id}-1"]),
])
def test_an_abandoned_chat_or_completion_stream_is_charged_what_the_engine_generated(
        gateway: GatewayProcess, engine: Server, route: str, fields: dict[str, Any],
        ids: list[str]) -> None:
    """A chat or completion stream the client leaves: the gateway relayed the engine's
    own count up to then, and the engine went on until the abort landed (at 300 tokens
    per second, some tokens more than were relayed). The ledger holds the engine's count
    summed over the request's engine requests, and its prompt as the engine counted it:
    its book, asked directly."""
    t0 = time.time()
    received = 0
    # 2 x 2000 tokens at 300 per second are 13 s of work: the client leaves after its 12th
    # line, tens of milliseconds after the first token. (Unpaced, a loaded machine let the
    # engine finish first: vLLM's API server fell seconds behind its engine core, and the
    # abort came after the last token.)
    body = {"model": "tiny", "stream": True, "ignore_eos": True, "max_tokens": 2000, **fields}
    with httpx.stream("POST", f"{gateway.url}{route}", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEY_LONG}"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                received += 1
                if received == 12:
                    break
    [row] = gateway.rows_since(t0, 1)
    assert row.finish_reason == "cancelled" and row.route == route
    book = engine_book(engine, [i.format(id=row.request_id) for i in ids])
    counts = list(book["output_tokens"].values())
    assert len(counts) == 2 and not book["running"]
    assert received - 2 <= row.completion_tokens == sum(counts) < 4000, (row, counts)
    prompts = list(book["prompt_tokens"].values())
    assert row.prompt_tokens == (prompts[0] if route.endswith("chat/completions")
                                 else sum(prompts)), (row.prompt_tokens, prompts)


def test_an_abandoned_plain_request_is_charged_what_the_engine_generated(
        gateway: GatewayProcess, engine: Server) -> None:
    """A non-streamed request whose client leaves before the answer: its count never
    reached the gateway, which charged the reservation (``max_tokens``) for it; now the
    engine's count."""
    events = engine.log_path.parent / "events.jsonl"
    since = time.monotonic()
    t0 = time.time()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/v1/chat/completions", timeout=1.5,
                   headers={"authorization": f"Bearer {KEY_SLOW}"},
                   json={"model": "tiny", "messages": CHAT, "max_tokens": 1000,
                         "ignore_eos": True})
    [row] = gateway.rows_since(t0, 1)
    assert row.finish_reason == "cancelled"
    [logged] = generated_by(events, row.request_id, since, 1)
    book = engine_book(engine, [f"chatcmpl-{row.request_id}"])
    assert book["output_tokens"] == {f"chatcmpl-{row.request_id}": row.completion_tokens}
    assert 10 <= row.completion_tokens < 1000  # 20 tok/s for 1.5 s; the reservation was 1000
    # The event log may hold one charge more: a step running when the abort came.
    assert 0 <= logged - row.completion_tokens <= 1, (logged, row)


def test_batched_completion_prompts_are_admitted_and_charged_whole(gateway: GatewayProcess) -> None:
    """A list of prompts with n=2: the cap and budget take the whole batch; the ledger
    holds the engine's totals, streamed (usage chunks of each prompt summed) or not."""
    t0 = time.time()
    client = api(gateway, KEY_BUDGET)
    plain = client.completions.create(model="tiny", prompt=["Hello there", "a b c"],
                                      max_tokens=3, n=2)
    assert len(plain.choices) == 4 and plain.usage.completion_tokens == 12
    last = None
    for chunk in client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]],
                                           max_tokens=2, stream=True,
                                           stream_options={"include_usage": True}):
        last = chunk
    assert last is not None and last.usage.prompt_tokens == 5
    rows = gateway.rows_since(t0, 2)
    assert sorted((r.prompt_tokens, r.completion_tokens) for r in rows) == sorted(
        [(plain.usage.prompt_tokens, 12), (5, last.usage.completion_tokens)])


def test_end_users_are_paced_in_the_engine_inside_their_tenant(gateway: GatewayProcess,
                                                               engine: Server) -> None:
    """Two end users of one tenant at 6 tok/s each (the tenant's
    end-user rate, inside its 20): alice with one stream of 30 tokens, bob with three of
    10 that share his quota. Measured at the engine (event log, net of the engine's
    absences as in the tenant-rate test above, same 10% margin). The engine's request ids
    do not name the end user; the token counts do (alice's is the one of 30). Without
    end-user pacing alice alone would run at up to 20; with one quota for both, 3 each."""
    from concurrent.futures import ThreadPoolExecutor

    events = engine.log_path.parent / "events.jsonl"
    since = time.monotonic()

    def stream(job: tuple[str, int]) -> int:
        end_user, tokens = job
        usage = None
        for chunk in api(gateway, KEY_READERS).completions.create(
                model="tiny", prompt="Hello", max_tokens=tokens, stream=True, user=end_user,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None
        return usage.completion_tokens

    jobs = [("alice", 30), ("bob", 10), ("bob", 10), ("bob", 10)]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(stream, jobs)) == [30, 10, 10, 10]
    found = wait_for_engine_requests(events, {"readers"}, since, 60)
    assert sorted(len(r.times) for r in found) == [10, 10, 10, 30], events
    everyone = all_dispatches(events, since)
    alice = next(r.times for r in found if len(r.times) == 30)
    bob = sorted(t for r in found if len(r.times) == 10 for t in r.times)
    logs = [engine.log_path, events]
    for name, times in (("alice", alice), ("bob (3 streams)", bob)):
        rate = paced_rate(times, 6, everyone)
        for bound, upper in ((0.9 * 6, False), (1.1 * 6, True)):
            expect("gateway_engine", f"end user {name} at 6 tok/s", rate.paced_rate, bound,
                   upper=upper, logs=logs, **rate.as_series())


def test_an_application_is_paced_in_the_engine_inside_its_tenant(gateway: GatewayProcess,
                                                                 engine: Server) -> None:
    """Application bot at 5 tok/s (its output_tokens_per_second) inside
    its tenant's 20, two streams of 15 tokens sharing it; its sibling chat, with no rate
    of its own, one stream of 40 beside them. Measured at the engine (event log, net of
    the engine's absences, 10% margin as above): bot at 5, the tenant as a whole never
    over 20 (GCRA's bound, whatever the load), and chat not held to bot's rate (at least
    half of the 15 bot leaves it). Without application pacing bot's two streams would
    take two thirds of the 20."""
    from concurrent.futures import ThreadPoolExecutor

    events = engine.log_path.parent / "events.jsonl"
    since = time.monotonic()

    def stream(job: tuple[str, int]) -> int:
        key, tokens = job
        usage = None
        for chunk in api(gateway, key).completions.create(
                model="tiny", prompt="Hello", max_tokens=tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None
        return usage.completion_tokens

    jobs = [(KEY_APPS_BOT, 15), (KEY_APPS_BOT, 15), (KEY_APPS_CHAT, 40)]
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(stream, jobs)) == [15, 15, 40]
    found = wait_for_engine_requests(events, {"apps"}, since, 70)
    assert sorted(len(r.times) for r in found) == [15, 15, 40], events
    everyone = all_dispatches(events, since)
    bot = sorted(t for r in found if len(r.times) == 15 for t in r.times)
    chat = next(sorted(r.times) for r in found if len(r.times) == 40)
    logs = [engine.log_path, events]
    rate = paced_rate(bot, 5, everyone)
    for bound, upper in ((0.9 * 5, False), (1.1 * 5, True)):
        expect("gateway_engine", "application bot at 5 tok/s", rate.paced_rate, bound,
               upper=upper, logs=logs, **rate.as_series())
    tenant = sorted(bot + chat)
    for window in (1.0, 2.0):
        most = max(sum(1 for u in tenant if t <= u < t + window) for t in tenant)
        expect("gateway_engine", f"tenant apps in {window:g} s", most, (window + 0.1) * 20 + 1,
               upper=True, logs=logs)
    chat_rate = (len(chat) - 1) / (chat[-1] - chat[0])
    expect("gateway_engine", "application chat beside bot", chat_rate, 0.5 * 15, upper=False,
           logs=logs)


def _batch_file(api_: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    return api_.files.create(file=("input.jsonl", content), purpose="batch").id


def _finished(api_: openai.OpenAI, batch_id: str, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = api_.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}"
        time.sleep(0.1)


def _custom_ids(api_: openai.OpenAI, file_id: str | None) -> list[str]:
    if file_id is None:
        return []
    return [json.loads(x)["custom_id"] for x in api_.files.content(file_id).text.splitlines()]


def test_a_batch_runs_on_the_engine_with_no_batch_configuration(gateway: GatewayProcess) -> None:
    """The gateway's configuration says nothing of batches: chat and Responses batches run
    on the real engine, in the lowest lane ("batch"), each line charged what the engine
    reported (its ledger row names the batch), a line for an unknown model in the error
    file; a live request served meanwhile."""
    fast = api(gateway, KEY_FAST)
    chat = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "messages": CHAT, "max_tokens": 8,
                      "ignore_eos": True}} for i in range(12)]
    chat.append({"custom_id": "unknown-model", "method": "POST",
                 "url": "/v1/chat/completions",
                 "body": {"model": "no-such-model", "messages": CHAT}})
    chat_batch = fast.batches.create(input_file_id=_batch_file(fast, chat),
                                     endpoint="/v1/chat/completions", completion_window="24h")
    responses = [{"custom_id": f"resp-{i}", "method": "POST", "url": "/v1/responses",
                  "body": {"model": "tiny", "input": "Hello there", "max_output_tokens": 6}}
                 for i in range(4)]
    resp_batch = fast.batches.create(input_file_id=_batch_file(fast, responses),
                                     endpoint="/v1/responses", completion_window="24h")
    live = fast.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    assert live.usage.completion_tokens == 4
    done = _finished(fast, chat_batch.id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (12, 1)
    assert _custom_ids(fast, done.error_file_id) == ["unknown-model"]
    output = [json.loads(x) for x in fast.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in output) == sorted(f"chat-{i}" for i in range(12))
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 8 for x in output)
    assert done.usage.output_tokens == 96
    rdone = _finished(fast, resp_batch.id)
    assert rdone.status == "completed" and rdone.request_counts.completed == 4
    routput = [json.loads(x) for x in fast.files.content(rdone.output_file_id).text.splitlines()]
    assert all(x["response"]["body"]["object"] == "response" for x in routput)
    rows = [r for r in gateway.rows_since(0, 0) if r.batch_id in (chat_batch.id, resp_batch.id)]
    deadline = time.monotonic() + 10
    while len(rows) < 17 and time.monotonic() < deadline:
        time.sleep(0.2)
        rows = [r for r in gateway.rows_since(0, 0)
                if r.batch_id in (chat_batch.id, resp_batch.id)]
    assert len(rows) == 17 and {r.lane for r in rows} == {"batch"}
    by_id = {r.request_id: r for r in rows}
    for x in output + routput:
        row = by_id[x["response"]["request_id"]]
        usage = x["response"]["body"]["usage"]
        assert row.completion_tokens == usage.get("completion_tokens", usage.get("output_tokens"))
        assert row.prompt_tokens == usage.get("prompt_tokens", usage.get("input_tokens"))


def reconcile(gw: GatewayProcess, since: float, *extra: str) -> subprocess.CompletedProcess[str]:
    """``tokenpace usage reconcile`` on the gateway's configuration, for requests the
    engine ended since ``since`` (no grace: every row asked for is written)."""
    return subprocess.run(
        [sys.executable, "-m", "tokenpace.cli", "usage", "reconcile", "--config",
         str(gw.config_path), "--since", datetime.fromtimestamp(since, timezone.utc).isoformat(),
         "--grace", "0", *extra], capture_output=True, text=True, timeout=60)


def test_usage_reconcile_finds_the_request_whose_row_was_lost(gateway: GatewayProcess,
                                                              engine: Server) -> None:
    """The engine lists every request it ended (``GET /tokenpace/v1/ended``) with its
    tenant as pacing user and its count, equal to the row's; ``tokenpace usage reconcile``
    finds no drift, then, once a row is deleted by hand, that request under its tenant
    with its tokens, and exits 1."""
    t0 = time.time()
    ids = {}
    for name, key, path, body in [
            ("chat", KEY_FAST, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6}),
            ("completion", KEY_BUDGET, "/v1/completions", {"prompt": "Hello", "max_tokens": 5}),
            ("stream", KEY_FAST, "/v1/chat/completions",
             {"messages": CHAT, "max_tokens": 4, "stream": True})]:
        resp = httpx.post(f"{gateway.url}{path}", timeout=60, json={"model": "tiny", **body},
                          headers={"authorization": f"Bearer {key}"})
        assert resp.status_code == 200, resp.text
        ids[name] = resp.headers["x-request-id"]
    rows = {r.request_id: r for r in gateway.rows_since(t0, 3)}
    assert set(rows) == set(ids.values())

    listed = httpx.get(f"{engine.base_url}/tokenpace/v1/ended", params={"limit": 10000},
                       timeout=10).json()
    by_id = {e["request_id"]: e for e in listed["requests"]}
    for name, engine_id, tenant in [("chat", "chatcmpl-{}", "fast"),
                                    ("completion", "cmpl-{}-0", "budgeted"),
                                    ("stream", "chatcmpl-{}", "fast")]:
        e = by_id[engine_id.format(ids[name])]
        row = rows[ids[name]]
        assert (e["user"], e["output_tokens"], e["prompt_tokens"]) == (
            tenant, row.completion_tokens, row.prompt_tokens), (e, row)
        assert t0 <= e["ended_at"] <= time.time()
    assert len(listed["oldest"]) == 1 and listed["next"].count(":") == 1

    clean = reconcile(gateway, t0, "--json")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    report = json.loads(clean.stdout)
    tenants = {t["tenant"]: t for t in report["tenants"]}
    assert tenants["fast"]["requests"] == 2 and tenants["budgeted"]["requests"] == 1
    assert all(t["drift"] == 0 for t in tenants.values()) and report["requests"] == []

    lost = ids["chat"]
    with sqlite3.connect(gateway.config["ledger"].removeprefix("sqlite:///")) as conn:
        assert conn.execute("DELETE FROM requests WHERE request_id = ?", (lost,)).rowcount == 1
    drift = reconcile(gateway, t0, "--json")
    assert drift.returncode == 1, drift.stdout + drift.stderr
    report = json.loads(drift.stdout)
    [fault] = report["requests"]
    assert (fault["request_id"], fault["tenant"], fault["kind"], fault["engine_tokens"],
            fault["ledger_tokens"]) == (lost, "fast", "unrecorded", rows[lost].completion_tokens,
                                        None)
    fast = {t["tenant"]: t for t in report["tenants"]}["fast"]
    assert (fast["unrecorded_requests"], fast["drift"]) == (1, -rows[lost].completion_tokens)
    table = reconcile(gateway, t0)
    assert table.returncode == 1 and lost in table.stdout and "unrecorded" in table.stdout


def _stream_until_cut(url: str, path: str, body: dict[str, Any], ids: dict[str, str],
                      chunks: dict[str, int], name: str) -> None:
    """Read a stream of the paced tenant until the gateway dies under it."""
    try:
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=60,
                          headers={"authorization": f"Bearer {KEY_SLOW}"}) as resp:
            ids[name] = resp.headers["x-request-id"]
            for _ in resp.iter_lines():
                chunks[name] = chunks.get(name, 0) + 1
    except httpx.HTTPError:
        pass  # the gateway was killed: the connection breaks


def test_requests_in_flight_when_the_gateway_is_sigkilled_are_charged_what_the_engine_generated(
        gateway: GatewayProcess, engine: Server) -> None:
    """Streams of the paced tenant (20 tok/s, so each runs for seconds) on chat,
    completions and Responses, and a non-streamed chat request, are at the engine when
    the gateway dies by SIGKILL. The journal written before each was sent names them;
    the restarted gateway asks the engine what each generated (the engine aborted them
    when the connections closed) and writes one row each, ``interrupted``, with exactly the
    engine's counts of the prompt and of the tokens it generated (its book of ended
    requests; its event log agrees within the one step that may have been running at the
    abort), not an estimate. Before the journal, the ledger had no row for any of them."""
    import threading

    events = engine.log_path.parent / "events.jsonl"
    since = time.monotonic()
    ids: dict[str, str] = {}
    chunks: dict[str, int] = {}
    streams = {
        "chat": ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "stream": True,
                                          "max_tokens": 400, "ignore_eos": True}),
        "completion": ("/v1/completions", {"model": "tiny", "prompt": "Once upon",
                                           "stream": True, "max_tokens": 400,
                                           "ignore_eos": True}),
        "responses": ("/v1/responses", {"model": "tiny", "input": "Hello", "stream": True,
                                        "max_output_tokens": 400, "ignore_eos": True}),
    }
    threads = [threading.Thread(target=_stream_until_cut, daemon=True,
                                args=(gateway.url, path, body, ids, chunks, name))
               for name, (path, body) in streams.items()]
    plain: dict[str, Any] = {}

    def non_streamed() -> None:
        try:
            resp = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60,
                              headers={"authorization": f"Bearer {KEY_SLOW}"},
                              json={"model": "tiny", "messages": CHAT, "max_tokens": 400,
                                    "ignore_eos": True})
            plain["status"] = resp.status_code
        except httpx.HTTPError:
            plain["cut"] = True

    threads.append(threading.Thread(target=non_streamed, daemon=True))
    for thread in threads:
        thread.start()
    # All four at the engine, each with some tokens generated.
    deadline = time.monotonic() + 30
    while True:
        at_engine = engine_requests(events, {"slow"}, since)
        if len(at_engine) >= 4 and len(ids) == 3 and all(len(r.times) >= 3 for r in at_engine):
            break
        assert time.monotonic() < deadline, (at_engine, ids, chunks)
        time.sleep(0.1)
    assert gateway.server is not None
    os.kill(gateway.server.proc.pid, signal.SIGKILL)
    gateway.server.proc.wait(10)
    gateway.stop()
    for thread in threads:
        thread.join(10)
    assert "status" not in plain  # the non-streamed request never got an answer
    time.sleep(0.6)  # the engine writes its event log every 200 ms: the aborts' last tokens
    at_engine = engine_requests(events, {"slow"}, since)
    assert len(at_engine) == 4, at_engine
    gateway.start()
    deadline = time.monotonic() + 30
    while True:
        rows = [r for r in gateway.rows(0, timeout_s=0) if r.finish_reason == "interrupted"
                and any(r.request_id in e.request_id for e in at_engine)]
        if len(rows) >= 4:
            break
        assert time.monotonic() < deadline, gateway.log()
        time.sleep(0.2)
    assert len({r.request_id for r in rows}) == 4  # each once
    assert set(ids.values()) <= {r.request_id for r in rows}
    book = engine_book(engine, [e.request_id for e in at_engine])
    for row in rows:
        [request] = [e for e in at_engine if row.request_id in e.request_id]
        assert not row.estimated and row.served, row
        # The engine's own count of what it generated; its event log may hold one charge
        # more, for a step that was running when the abort came (computed, not delivered).
        assert row.completion_tokens == book["output_tokens"][request.request_id] > 0, (
            row, request, book)
        assert 0 <= len(request.times) - row.completion_tokens <= 1, (row, request)
        assert row.prompt_tokens == book["prompt_tokens"][request.request_id] > 0
        assert row.cost == row.prompt_tokens * 1.0 + row.completion_tokens * 2.0


def test_a_batch_survives_the_gateway_killed_with_sigkill(gateway: GatewayProcess,
                                                         engine: Server) -> None:
    """Lines of the paced tenant (20 tok/s, so the batch takes seconds) run, the gateway
    dies by SIGKILL mid-batch, starts again with the same ledger and batch store, and
    resumes: every custom_id once in the output, lines written before the kill not sent
    to the engine again (the event log counts the tenant's requests). Last in this
    module: it restarts the module's gateway."""
    slow = api(gateway, KEY_SLOW)
    events = engine.log_path.parent / "events.jsonl"
    since = time.monotonic()
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": f"Count {i}", "max_tokens": 12,
                       "ignore_eos": True}} for i in range(8)]
    batch = slow.batches.create(input_file_id=_batch_file(slow, lines),
                                endpoint="/v1/completions", completion_window="24h")
    store = Path(gateway.config["ledger"].removeprefix("sqlite:///")).with_name(
        "usage.batches.db")

    def written() -> int:
        import sqlite3
        with sqlite3.connect(store) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM batch_results WHERE batch_id = ?",
                                    (batch.id,)).fetchone()[0])

    deadline = time.monotonic() + 60
    while written() < 2:
        assert time.monotonic() < deadline, "no line of the paced batch was written"
        time.sleep(0.05)
    assert gateway.server is not None
    os.kill(gateway.server.proc.pid, signal.SIGKILL)
    gateway.server.proc.wait(10)
    at_kill = written()
    gateway.stop()
    assert at_kill < 8, "the batch ended before the kill: make its lines longer"
    gateway.start()
    done = _finished(slow, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 8
    assert sorted(_custom_ids(slow, done.output_file_id)) == sorted(f"line-{i}" for i in range(8))
    assert done.usage.output_tokens == 8 * 12
    # Each request of the tenant at the engine: the 8 lines, plus those in flight at the
    # kill (at most the 8 - at_kill unwritten), never again the ones written before it.
    time.sleep(0.5)  # the engine writes its event log every 200 ms
    sent = len(engine_requests(events, {"slow"}, since))
    assert 8 <= sent <= 16 - at_kill, (sent, at_kill)


def test_the_engine_tells_an_exchange_that_ended_before_its_scheduler_had_it(
        engine: Server) -> None:
    """``exchange`` in the aborted question, on the real server: an exchange answered is
    ended and its id known; an id never sent is not ended. Requests cut at once by their
    client (a few milliseconds after sending, often before vLLM hands them to the
    scheduler): each is either known to the scheduler or ended and unknown, and one that
    is ended and unknown stays unknown (it never reached the scheduler: nothing later
    makes it run)."""
    def aborted(exchange: str, ids: list[str]) -> dict[str, Any]:
        return httpx.post(f"{engine.base_url}/tokenpace/v1/aborted", timeout=10,
                          json={"request_ids": ids, "exchange": exchange}).json()

    done = httpx.post(f"{engine.base_url}/v1/completions", timeout=60,
                      headers={"x-request-id": "tpg-exchange-done"},
                      json={"model": "tiny", "prompt": "Hello world", "max_tokens": 3})
    assert done.status_code == 200
    answer = aborted("tpg-exchange-done", ["cmpl-tpg-exchange-done-0"])
    assert answer["exchange_ended"] is True
    assert answer["output_tokens"] == {"cmpl-tpg-exchange-done-0": 3}
    assert aborted("tpg-exchange-never", ["cmpl-tpg-exchange-never-0"]) == {
        "output_tokens": {}, "prompt_tokens": {}, "running": [], "exchange_ended": False}

    async def cut(i: int) -> str:
        """The whole request written on a socket, closed 0-8 ms later."""
        rid = f"tpg-exchange-cut-{i}"
        body = json.dumps({"model": "tiny", "prompt": "Hello world " * 200,
                           "max_tokens": 64}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", engine.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: engine\r\n"
                     b"content-type: application/json\r\n"
                     + f"x-request-id: {rid}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                     + body)
        await writer.drain()
        await asyncio.sleep(0.002 * (i % 5))
        writer.close()
        await writer.wait_closed()
        return rid

    async def cut_all() -> list[str]:
        return [await cut(i) for i in range(20)]

    never = []
    for rid in asyncio.run(cut_all()):
        ids = [f"cmpl-{rid}-0"]
        deadline = time.monotonic() + 10
        while True:  # the exchange ends once the server saw the client go
            answer = aborted(rid, ids)
            known = ids[0] in answer["output_tokens"] or ids[0] in answer["running"]
            if known or answer["exchange_ended"]:
                break
            assert time.monotonic() < deadline, f"{rid}: neither known nor ended in 10 s"
            time.sleep(0.05)
        if not known:
            never.append(rid)
    time.sleep(1.0)
    for rid in never:
        answer = aborted(rid, [f"cmpl-{rid}-0"])
        assert answer["output_tokens"] == {} and answer["running"] == [], (rid, answer)
    print(f"cut at once: {len(never)} of 20 never reached the scheduler")


def test_recovery_charges_an_exchange_the_engine_ended_unscheduled_for_nothing_generated(
        engine: Server) -> None:
    """The restarted gateway's recovery (``server._recovery``) of two requests its killed
    predecessor had sent: one whose connection closed while the engine was still reading
    its body (the exchange began and ended, the scheduler never had it) is recorded with
    nothing generated and its admitted prompt, exact, not its reservation as an estimate;
    one the engine answered is recorded with the engine's counts."""
    from types import SimpleNamespace

    from tokenpace.gateway.server._recovery import recover_in_flight

    cut, done = "tpg-recover-cut", "tpg-recover-done"

    async def half_sent() -> None:
        body = json.dumps({"model": "tiny", "messages": CHAT, "max_tokens": 64}).encode()
        _, writer = await asyncio.open_connection("127.0.0.1", engine.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: engine\r\n"
                     b"content-type: application/json\r\n"
                     + f"x-request-id: {cut}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                     + body[:len(body) // 2])
        await writer.drain()
        await asyncio.sleep(0.2)  # the engine's guard has begun the exchange
        writer.close()
        await writer.wait_closed()

    asyncio.run(half_sent())
    answered = httpx.post(f"{engine.base_url}/v1/chat/completions", timeout=60,
                          headers={"x-request-id": done},
                          json={"model": "tiny", "messages": CHAT, "max_tokens": 5,
                                "ignore_eos": True})
    assert answered.status_code == 200

    def orphan(request_id: str) -> dict[str, Any]:
        """A journal's open entry: prompt 20 and max_tokens 64 reserved, 148 at 1 and 2."""
        return {"open": {"request_id": request_id, "tenant": "acme", "model": "tiny",
                         "lane": "default", "prompt_tokens": 20, "completion_tokens": 64,
                         "cost": 148.0, "queue_ms": None, "ttft_ms": None, "e2e_ms": 1.0,
                         "finish_reason": "interrupted", "started_at": time.time(),
                         "ended_at": time.time(), "served": 1,
                         "route": "/v1/chat/completions", "application": "",
                         "cached_prompt_tokens": 0, "batch_id": "", "estimated": 1},
                "engine": engine.base_url, "kind": "chat", "cost": [1.0, 2.0, 1.0],
                "prompt_bound": False, "holders": [], "reserved_at": time.time()}

    rows: list[Any] = []

    async def recover() -> None:
        async with httpx.AsyncClient(base_url=engine.base_url) as client:
            rt = SimpleNamespace(clients={engine.base_url: client}, tenants={}, store=None,
                                 ledger=SimpleNamespace(record=rows.append), clock=time.time)
            await recover_in_flight(rt, [orphan(cut), orphan(done)])  # type: ignore[arg-type]

    asyncio.run(recover())
    by_id = {row.request_id: row for row in rows}
    assert set(by_id) == {cut, done}
    never = by_id[cut]
    assert (never.completion_tokens, never.prompt_tokens, never.cost, never.estimated,
            never.finish_reason) == (0, 20, 20.0, False, "interrupted"), never
    usage = answered.json()["usage"]
    finished = by_id[done]
    assert (finished.completion_tokens, finished.prompt_tokens, finished.estimated) == (
        5, usage["prompt_tokens"], False), finished
