"""Measurements behind `tokenpace bench ...`."""

from ._environment import write_json
from ._redis_server import RedisServer, redis_server_binary

__all__ = ["RedisServer", "redis_server_binary", "write_json"]
