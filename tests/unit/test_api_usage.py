"""The Responses and Messages APIs' usage, read from vLLM 0.32's own bytes (captured from
``/v1/responses`` and ``/v1/messages`` on the tiny model), and their request bodies."""

from __future__ import annotations

import json

import pytest

from tokenpace.gateway.engines import EngineInstructions, engine_body
from tokenpace.gateway.wire import (
    ChunkRewriter,
    EventScanner,
    EventSplitter,
    GatewayError,
    answer_cached,
    answer_usage,
    count_calls,
    parse_request,
    responses_as_chat,
)

RESPONSES_STREAM = (
    b'event: response.created\ndata: {"response":{"id":"resp_1","status":"in_progress",'
    b'"usage":null},"sequence_number":0,"type":"response.created"}\n\n'
    b'event: response.output_text.delta\ndata: {"content_index":0,"delta":"Pac","item_id":"m",'
    b'"logprobs":[],"output_index":0,"sequence_number":4,"type":"response.output_text.delta"}\n\n'
    b'event: response.output_text.delta\ndata: {"content_index":0,"delta":"ho\\"}type\\":\\"x",'
    b'"item_id":"m","logprobs":[],"output_index":0,"sequence_number":5,'
    b'"type":"response.output_text.delta"}\n\n'
    b'event: response.output_text.done\ndata: {"content_index":0,"item_id":"m","logprobs":[],'
    b'"output_index":0,"sequence_number":7,"text":"Pacho","type":"response.output_text.done"}\n\n'
    b'event: response.completed\ndata: {"response":{"id":"resp_1","incomplete_details":'
    b'{"reason":"max_output_tokens"},"output":[{"content":[{"type":"output_text"}],'
    b'"type":"message"}],"status":"incomplete","usage":{"input_tokens":23,"input_tokens_details":'
    b'{"cached_tokens":0},"output_tokens":5,"output_tokens_details":{"reasoning_tokens":0},'
    b'"total_tokens":28}},"sequence_number":10,"type":"response.completed"}\n\n'
)

MESSAGES_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"chatcmpl-1",'
    b'"type":"message","role":"assistant","content":[],"model":"tiny","stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":23,"output_tokens":0}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","content_block":'
    b'{"type":"text","text":""},"index":0}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":'
    b'"text_delta","text":" many"},"index":0}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":'
    b'"text_delta","text":"\xef\xbf\xbd0123"},"index":0}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens",'
    b'"stop_sequence":null},"usage":{"input_tokens":23,"output_tokens":4}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


def scan(stream: bytes, cut: int) -> list[tuple[int | None, int, bool]]:
    """Feed ``stream`` in pieces of ``cut`` bytes; the progress after each event."""
    scanner, splitter, seen = EventScanner(), EventSplitter(), []
    for at in range(0, len(stream), cut):
        for payload in splitter.feed(stream[at:at + cut]):
            scanner.event(payload)
            p = scanner.progress
            seen.append((p.prompt_tokens, p.completion_tokens, p.done))
    return seen


@pytest.mark.parametrize("cut", [1, 7, 100_000])
def test_a_responses_stream_counts_deltas_then_takes_the_final_usage(cut: int) -> None:
    seen = scan(RESPONSES_STREAM, cut)
    # One token per delta until response.completed gives the engine's counts; a delta's
    # text that looks like a "type" key does not confuse the event's type.
    assert seen == [(None, 0, False), (None, 1, False), (None, 2, False), (None, 2, False),
                    (23, 5, True)]


@pytest.mark.parametrize("cut", [1, 13, 100_000])
def test_a_messages_stream_takes_the_prompt_at_once_and_the_output_at_the_end(cut: int) -> None:
    seen = scan(MESSAGES_STREAM, cut)
    assert seen[0] == (23, 0, False)  # message_start: the prompt, before any output
    assert seen[-2:] == [(23, 4, False), (23, 4, True)]
    assert [s[1] for s in seen] == [0, 0, 1, 2, 2, 4, 4]


def test_finish_reasons_are_the_ledgers_usual_ones() -> None:
    scanner = EventScanner()
    for payload in EventSplitter().feed(MESSAGES_STREAM):
        scanner.event(payload)
    assert scanner.progress.finish_reason == "length"
    assert answer_usage("messages", {"stop_reason": "end_turn", "usage": {
        "input_tokens": 3, "output_tokens": 2}}) == (3, 2, "stop")
    assert answer_usage("responses", {"status": "completed", "usage": {
        "input_tokens": 3, "output_tokens": 2}}) == (3, 2, "stop")
    assert answer_usage("responses", {"status": "incomplete", "incomplete_details": {
        "reason": "max_output_tokens"}, "usage": {"input_tokens": 3, "output_tokens": 9}}) \
        == (3, 9, "length")


def test_errors_end_a_stream_with_an_error() -> None:
    scanner = EventScanner()
    scanner.event(b'{"type":"error","error":{"type":"overloaded_error","message":"busy"}}')
    assert scanner.progress.error == {"type": "overloaded_error", "message": "busy"}
    scanner = EventScanner()
    scanner.event(b'{"response":{"status":"failed","error":{"code":"server_error"}},'
                  b'"sequence_number":3,"type":"response.failed"}')
    assert scanner.progress.done and scanner.progress.error == {"code": "server_error"}


def test_batched_completion_chunks_sum_each_prompts_count() -> None:
    """vLLM's per-chunk usage counts its own prompt: choice i of n belongs to prompt i // n."""
    rewriter = ChunkRewriter(False, False, n=2, prompts=2)
    for index, prompt, done in ((0, 5, 1), (2, 6, 1), (3, 6, 1), (1, 5, 1), (0, 5, 2)):
        rewriter.event(json.dumps({"choices": [{"index": index, "text": "x"}], "usage": {
            "prompt_tokens": prompt, "completion_tokens": done}}).encode())
    assert rewriter.progress.prompt_tokens == 11 and rewriter.progress.completion_tokens == 5


def body(kind: str, **fields: object) -> dict[str, object]:
    return {"model": "tiny", **fields}


def test_each_api_names_its_own_output_limit() -> None:
    req = parse_request("responses", body("responses", input="hi", max_output_tokens=7))
    assert (req.max_tokens, req.max_tokens_field, req.n) == (7, "max_output_tokens", 1)
    req = parse_request("messages", body("messages", messages=[{"role": "user", "content": "x"}],
                                         max_tokens=5))
    assert (req.max_tokens, req.max_tokens_field) == (5, "max_tokens")
    with pytest.raises(GatewayError, match="'max_tokens' is required"):
        parse_request("messages", body("messages", messages=[{"role": "user", "content": "x"}]))
    req = parse_request("completion", body("completion", prompt=["a", "b", "c"], n=2))
    assert (req.prompts, req.sequences) == (3, 6)


@pytest.mark.parametrize("fields, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": ""}, "input"),
    ({}, "input"),
])
def test_responses_that_need_a_stored_response_are_refused(fields: dict, param: str) -> None:
    with pytest.raises(GatewayError) as info:
        parse_request("responses", body("responses", **fields))
    assert info.value.status == 400 and info.value.param == param


def test_the_engine_gets_the_tenants_identity_and_no_store() -> None:
    req = parse_request("responses", body("responses", input="hi", store=True, priority=-5,
                                          request_id="resp_theirs",
                                          vllm_xargs={"output_rate_user": "other"}))
    sent = json.loads(engine_body(req, EngineInstructions(user="acme", rate=20.0, priority=10, max_tokens=9,
                                  request_id="tpg-1")))
    assert sent["vllm_xargs"]["output_rate_user"] == "acme"
    assert (sent["store"], sent["priority"], sent["max_output_tokens"], sent["request_id"]) \
        == (False, 10, 9, "resp_tpg-1")
    assert "stream_options" not in sent
    req = parse_request("messages", body("messages", messages=[{"role": "user", "content": "x"}],
                                         max_tokens=5, stream=True, priority=-5))
    sent = json.loads(engine_body(req, EngineInstructions(user="acme", rate=None, priority=10, max_tokens=5)))
    assert "priority" not in sent and "stream_options" not in sent
    assert sent["vllm_xargs"] == {"output_rate_user": "acme"}


def test_prompts_are_counted_as_the_engine_renders_them() -> None:
    req = parse_request("responses", body("responses", instructions="Be terse.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"}],
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}]))
    [(path, sent)] = count_calls(req)
    assert path == "/tokenize" and sent == responses_as_chat("tiny", req.body)
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "tool"]
    assert sent["messages"][1]["content"] == [{"type": "text", "text": "hi"}]
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]
    req = parse_request("messages", body("messages", system="s", max_tokens=3,
                                         messages=[{"role": "user", "content": "x"}]))
    [(path, sent)] = count_calls(req)
    assert path == "/v1/messages/count_tokens" and "max_tokens" not in sent
    req = parse_request("completion", body("completion", prompt=["a", "b"]))
    assert [c[1]["prompt"] for c in count_calls(req)] == ["a", "b"]


def test_a_body_nested_deeper_than_the_encoder_goes_is_a_400_not_a_crash() -> None:
    """Parsed on a shallow stack, encoded on a deeper one: ``json.dumps`` can hit the
    recursion limit where ``json.loads`` did not (seen once in the hostile-body battery)."""
    import pytest

    from tokenpace.gateway.engines import EngineInstructions, engine_body
    from tokenpace.gateway.wire import parse_request
    from tokenpace.gateway.wire import GatewayError

    deep: list = []
    node = deep
    for _ in range(100_000):  # far past any recursion limit, built without recursion
        node.append([])
        node = node[0]
    req = parse_request("completion", {"model": "m", "prompt": "hi", "max_tokens": 2, "x": deep})
    with pytest.raises(GatewayError) as info:
        engine_body(req, EngineInstructions(user="t", rate=None, priority=0, max_tokens=2))
    assert (info.value.status, info.value.code) == (400, "invalid_json")
    assert "nested too deeply" in info.value.message


def test_the_end_user_is_the_openai_user_field_or_the_messages_metadata() -> None:
    import pytest

    from tokenpace.gateway.wire import end_user_of, parse_request
    from tokenpace.gateway.engines import EngineInstructions, engine_body
    from tokenpace.gateway.wire import GatewayError

    chat = parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 2, "user": "alice",
                                  "vllm_xargs": {"output_rate_end_user": "mallory",
                                                 "output_rate_end_user_tokens_per_second": 1e9}})
    assert end_user_of(chat) == "alice"
    sent = json.loads(engine_body(chat, EngineInstructions(user="t", rate=None, priority=0, max_tokens=2,
                                  end_user="alice", end_user_rate=4.0)))["vllm_xargs"]
    assert (sent["output_rate_end_user"], sent["output_rate_end_user_tokens_per_second"]) \
        == ("alice", 4.0)
    # Without an end-user rate for the tenant, a client's own end-user fields are dropped.
    plain = json.loads(engine_body(chat, EngineInstructions(user="t", rate=None, priority=0, max_tokens=2)))
    assert "output_rate_end_user" not in plain["vllm_xargs"]
    assert "output_rate_end_user_tokens_per_second" not in plain["vllm_xargs"]
    messages = parse_request("messages", {"model": "m", "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "hi"}],
                                          "metadata": {"user_id": "bob"}})
    assert end_user_of(messages) == "bob"
    assert end_user_of(parse_request("completion", {"model": "m", "prompt": "x"})) is None
    for bad in ("", 7, "u" * 257):
        req = parse_request("completion", {"model": "m", "prompt": "x", "user": bad})
        with pytest.raises(GatewayError) as info:
            end_user_of(req)
        assert (info.value.status, info.value.param) == (400, "user")


def test_safety_identifier_names_the_end_user_before_user() -> None:
    """OpenAI is replacing ``user`` with ``safety_identifier``: a client sending the new
    field (alone or beside the old one) is paced as that end user."""
    import pytest

    from tokenpace.gateway.wire import end_user_of, parse_request
    from tokenpace.gateway.wire import GatewayError

    def chat(**fields: object) -> object:
        return parse_request("chat", {"model": "m", "max_tokens": 2, **fields,
                                      "messages": [{"role": "user", "content": "hi"}]})

    assert end_user_of(chat(safety_identifier="alice")) == "alice"
    assert end_user_of(chat(safety_identifier="alice", user="legacy")) == "alice"
    assert end_user_of(chat(safety_identifier=None, user="legacy")) == "legacy"
    responses = parse_request("responses", {"model": "m", "input": "hi",
                                            "safety_identifier": "carol"})
    assert end_user_of(responses) == "carol"
    with pytest.raises(GatewayError) as info:
        end_user_of(chat(safety_identifier=""))
    assert (info.value.status, info.value.param, info.value.code) \
        == (400, "safety_identifier", "invalid_end_user")


def test_an_applications_rate_goes_to_the_engine_and_a_clients_own_is_dropped() -> None:
    from tokenpace.gateway.engines import EngineInstructions, engine_body
    from tokenpace.gateway.wire import parse_request

    req = parse_request("completion", {
        "model": "m", "prompt": "x", "max_tokens": 2,
        "vllm_xargs": {"output_rate_application": "other",
                       "output_rate_application_tokens_per_second": 1e9}})
    sent = json.loads(engine_body(req, EngineInstructions(user="t", rate=20.0, priority=0, max_tokens=2,
                                  application="bot", application_rate=5.0)))["vllm_xargs"]
    assert (sent["output_rate_user"], sent["output_rate_application"],
            sent["output_rate_application_tokens_per_second"]) == ("t", "bot", 5.0)
    # An application without a rate (or a tenant's own key): nothing of the client's goes.
    for application in ("bot", None):
        plain = json.loads(engine_body(req, EngineInstructions(user="t", rate=None, priority=0, max_tokens=2,
                                       application=application)))["vllm_xargs"]
        assert "output_rate_application" not in plain
        assert "output_rate_application_tokens_per_second" not in plain


def test_an_applications_own_end_user_rate_goes_with_the_end_user() -> None:
    """An application with its own end-user rate: the end user is named, the rate goes in
    the application's field (its end users are its own), the tenant's end-user rate not."""
    from tokenpace.gateway.engines import EngineInstructions, engine_body
    from tokenpace.gateway.wire import parse_request

    req = parse_request("completion", {"model": "m", "prompt": "x", "max_tokens": 2,
                                       "user": "alice"})
    sent = json.loads(engine_body(req, EngineInstructions(user="t", rate=None, priority=0, max_tokens=2,
                                  end_user="alice", end_user_rate=6.0, application="bot",
                                  application_end_user_rate=3.0)))["vllm_xargs"]
    assert sent["output_rate_end_user"] == "alice"
    assert sent["output_rate_application"] == "bot"
    assert sent["output_rate_application_end_user_tokens_per_second"] == 3.0
    assert "output_rate_end_user_tokens_per_second" not in sent
    assert "output_rate_application_tokens_per_second" not in sent  # bot has no rate itself
    # The tenant's end-user rate for a request of its own key: as before.
    sent = json.loads(engine_body(req, EngineInstructions(user="t", rate=None, priority=0, max_tokens=2,
                                  end_user="alice", end_user_rate=6.0)))["vllm_xargs"]
    assert (sent["output_rate_end_user"], sent["output_rate_end_user_tokens_per_second"]) \
        == ("alice", 6.0)
    assert "output_rate_application_end_user_tokens_per_second" not in sent
    # No end user in the request: nothing about end users goes.
    sent = json.loads(engine_body(req, EngineInstructions(user="t", rate=None, priority=0, max_tokens=2,
                                  application="bot", application_end_user_rate=3.0)))["vllm_xargs"]
    assert not any("end_user" in key for key in sent)


# -- cached prompt tokens (cost.cached_prompt) ---------------------------------------------
# The layouts vLLM 0.32 writes with --enable-prompt-tokens-details (its pydantic models,
# dumped with exclude_unset): chat and completions carry prompt_tokens_details in the final
# usage chunk only; Messages carries cache_read_input_tokens in message_delta only, with
# input_tokens the prompt *less* its cached tokens; Responses always reports them.

CHAT_STREAM_CACHED = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}],'
    b'"usage":{"prompt_tokens":40,"total_tokens":40,"completion_tokens":0}}\n\n'
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny",'
    b'"choices":[{"index":0,"delta":{"content":"ab"},"finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":40,"total_tokens":42,"completion_tokens":2}}\n\n'
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny",'
    b'"choices":[],"usage":{"prompt_tokens":40,"total_tokens":42,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":32,"created_cache_tokens":null,'
    b'"multimodal_tokens":null}}}\n\n'
    b'data: [DONE]\n\n'
)


@pytest.mark.parametrize("wants_usage", [False, True])
@pytest.mark.parametrize("cut", [1, 17, 100_000])
def test_a_chat_stream_reads_cached_tokens_from_the_final_usage(cut: int,
                                                                 wants_usage: bool) -> None:
    rewriter, splitter, out = ChunkRewriter(wants_usage, False), EventSplitter(), []
    seen = []
    for at in range(0, len(CHAT_STREAM_CACHED), cut):
        for payload in splitter.feed(CHAT_STREAM_CACHED[at:at + cut]):
            event = rewriter.event(payload)
            seen.append(rewriter.progress.cached_tokens)
            if event is not None:
                out.append(event)
    assert seen == [None, None, 32, 32]  # known from the final usage chunk on
    p = rewriter.progress
    assert (p.prompt_tokens, p.cached_tokens, p.completion_tokens, p.done) == (40, 32, 2, True)
    # The final usage chunk goes to the client whole when it asked for usage, else not at all.
    assert any(b'"cached_tokens":32' in e for e in out) == wants_usage


def test_a_chat_stream_without_details_reports_no_cached_count() -> None:
    rewriter = ChunkRewriter(False, False)
    rewriter.event(b'{"choices":[],"usage":{"prompt_tokens":40,"total_tokens":42,'
                   b'"completion_tokens":2}}')
    assert rewriter.progress.prompt_tokens == 40 and rewriter.progress.cached_tokens is None


MESSAGES_STREAM_CACHED = MESSAGES_STREAM.replace(
    b'"usage":{"input_tokens":23,"output_tokens":4}',
    b'"usage":{"input_tokens":7,"output_tokens":4,"cache_read_input_tokens":16}')


@pytest.mark.parametrize("cut", [1, 13, 100_000])
def test_a_messages_stream_adds_the_cache_read_back_to_the_prompt(cut: int) -> None:
    scanner, splitter = EventScanner(), EventSplitter()
    for at in range(0, len(MESSAGES_STREAM_CACHED), cut):
        for payload in splitter.feed(MESSAGES_STREAM_CACHED[at:at + cut]):
            scanner.event(payload)
    p = scanner.progress
    # input_tokens (7) is what was not cached: the prompt is 7 + 16, as message_start said.
    assert (p.prompt_tokens, p.cached_tokens, p.completion_tokens, p.done) == (23, 16, 4, True)


RESPONSES_STREAM_CACHED = RESPONSES_STREAM.replace(b'{"cached_tokens":0}', b'{"cached_tokens":16}')


@pytest.mark.parametrize("cut", [1, 100_000])
def test_a_responses_stream_reads_input_tokens_details(cut: int) -> None:
    scanner, splitter = EventScanner(), EventSplitter()
    for at in range(0, len(RESPONSES_STREAM_CACHED), cut):
        for payload in splitter.feed(RESPONSES_STREAM_CACHED[at:at + cut]):
            scanner.event(payload)
    p = scanner.progress
    assert (p.prompt_tokens, p.cached_tokens, p.completion_tokens) == (23, 16, 5)
    scanner = EventScanner()
    for payload in EventSplitter().feed(RESPONSES_STREAM):
        scanner.event(payload)
    assert scanner.progress.cached_tokens == 0  # Responses report a miss as 0


def test_non_streamed_answers_report_their_cached_tokens() -> None:
    chat = {"choices": [{"finish_reason": "stop"}], "usage": {
        "prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
        "prompt_tokens_details": {"cached_tokens": 32, "created_cache_tokens": None}}}
    assert answer_usage("chat", chat) == (40, 2, "stop")
    assert answer_cached("chat", chat) == 32
    assert answer_cached("completion", chat) == 32
    del chat["usage"]["prompt_tokens_details"]  # type: ignore[attr-defined]
    assert answer_cached("chat", chat) is None  # the engine runs without the flag
    messages = {"stop_reason": "end_turn", "usage": {
        "input_tokens": 7, "output_tokens": 2, "cache_read_input_tokens": 16,
        "cache_creation_input_tokens": 1}}
    assert answer_usage("messages", messages) == (24, 2, "stop")
    assert answer_cached("messages", messages) == 16
    responses = {"status": "completed", "usage": {
        "input_tokens": 23, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 16}}}
    assert answer_cached("responses", responses) == 16
    assert answer_cached("responses", {"usage": None}) is None
