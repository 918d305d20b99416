"""The slow-client keys: their defaults, and a bad value refused with the key named."""

from __future__ import annotations

from typing import Any

import pytest

from tokenpace.gateway.config import ConfigError, parse_config


def _config(**top: Any) -> dict[str, Any]:
    return {"engines": [{"url": "http://127.0.0.1:9"}], "ledger": "sqlite:///unused.db",
            "tenants": [{"id": "a", "api_keys": ["sk-a"]},
                        {"id": "b", "api_keys": ["sk-b"], "max_queued": 0}], **top}


def test_defaults_suit_a_gateway_on_the_internet() -> None:
    config = parse_config(_config())
    assert config.header_timeout_s == 20.0 and config.body_timeout_s == 30.0
    assert config.body_min_rate == 64 * 1024 and config.max_connections == 1000
    assert config.stream_buffer_bytes == 1 << 20
    assert config.tenant_stream_buffer_bytes == 16 << 20
    assert [t.max_queued for t in config.tenants] == [64, 0]


def test_each_can_be_raised() -> None:
    config = parse_config(_config(header_timeout="1m", body_timeout=120, body_min_rate=0,
                                  max_connections=20000, stream_buffer_bytes=8 << 20,
                                  tenant_stream_buffer_bytes=0))
    assert (config.header_timeout_s, config.body_timeout_s, config.body_min_rate,
            config.max_connections, config.stream_buffer_bytes,
            config.tenant_stream_buffer_bytes) == (60.0, 120.0, 0, 20000, 8 << 20, 0)


@pytest.mark.parametrize("key, value", [
    ("header_timeout", "soon"), ("body_timeout", -1), ("body_min_rate", -1),
    ("max_connections", 0), ("stream_buffer_bytes", "1MB"),
    ("tenant_stream_buffer_bytes", -5)])
def test_a_bad_value_names_its_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_config(_config(**{key: value}))
