"""Measurements behind `tokenpace bench ...`.

Each ``tokenpace.bench.NAME`` module is one benchmark: ``run(...)`` measures and returns a
JSON-ready dict, ``add_cli_args(parser)`` and ``main(args)`` make it ``tokenpace bench
NAME``. The names below are the building blocks the tools in ``tools/`` reuse: servers in
their own process groups, the canned fast upstream and the byte relay, the SSE reader and
the pair order of the paired measurements and their ratio with its interval.
"""

from .._process import Server, free_port, start_all, tokenpace_serve_argv, vllm_server_argv
from ._control import PATH as CONTROL_PATH
from ._control import server as byte_proxy_server
from ._environment import write_json
from ._fast_upstream import server as fast_upstream_server
from ._load import StreamRecord, record_chunk, sse_payloads
from ._paired import pair_order, ratio_summary
from ._redis_server import RedisServer, redis_server_binary

__all__ = [
    "CONTROL_PATH",
    "RedisServer",
    "Server",
    "StreamRecord",
    "byte_proxy_server",
    "fast_upstream_server",
    "free_port",
    "pair_order",
    "ratio_summary",
    "record_chunk",
    "redis_server_binary",
    "sse_payloads",
    "start_all",
    "tokenpace_serve_argv",
    "vllm_server_argv",
    "write_json",
]
