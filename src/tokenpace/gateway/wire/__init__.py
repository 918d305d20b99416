"""The wire formats the gateway speaks, with clients and with engines: OpenAI's chat
completions, completions, Responses and embeddings, Anthropic's Messages, vLLM's other
pooling routes (rerank, score, pooling, classify).

Pure functions and small values over bytes and JSON, no state: reading a request body
(``ParsedRequest``), the errors in each API's own format (``GatewayError``), server-sent
events passed through (``EventSplitter``, ``ChunkRewriter``), the usage the answers report
(``EventScanner``, ``answer_usage``) and OpenAI's rate-limit headers. Every stage above
reads requests and answers through this package; it imports nothing of the gateway.
"""

from ._clip import ECHO_CHARS, clip
from ._conversation import conversation_key
from ._errors import (
    GatewayError,
    anthropic_error_body,
    error_body,
    error_response,
    stream_error_event,
)
from ._pooling import POOLING_KINDS, POOLING_PATHS, pooling_prompt_bytes, pooling_usage
from ._ratelimit import go_duration, headroom_headers, refusal_headers
from ._request import (
    MAX_MODEL_CHARS,
    MAX_PROMPTS,
    MAX_TOKENS_FIELD,
    ROUTES,
    Kind,
    ParsedRequest,
    count_calls,
    dumps,
    encode_body,
    end_user_of,
    parse_json_body,
    check_model_name,
    parse_request,
    prompt_token_ids,
    responses_as_chat,
)
from ._stream import ChunkRewriter, EventSplitter, StreamProgress
from ._usage import EventScanner, answer_cached, answer_usage

__all__ = [
    "answer_cached",
    "answer_usage",
    "clip",
    "conversation_key",
    "anthropic_error_body",
    "ChunkRewriter",
    "count_calls",
    "dumps",
    "encode_body",
    "ECHO_CHARS",
    "end_user_of",
    "error_body",
    "error_response",
    "EventScanner",
    "EventSplitter",
    "GatewayError",
    "go_duration",
    "headroom_headers",
    "Kind",
    "MAX_MODEL_CHARS",
    "MAX_PROMPTS",
    "MAX_TOKENS_FIELD",
    "parse_json_body",
    "check_model_name",
    "parse_request",
    "ParsedRequest",
    "POOLING_KINDS",
    "POOLING_PATHS",
    "pooling_prompt_bytes",
    "pooling_usage",
    "prompt_token_ids",
    "refusal_headers",
    "responses_as_chat",
    "ROUTES",
    "stream_error_event",
    "StreamProgress",
]
