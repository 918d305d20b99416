"""No secret of the configuration in a gateway's log: a real gateway process at debug level
with passwords in its Postgres ledger's, batch store's and Redis state store's URLs, an
engine key and an engine URL with credentials, through start-up, a request and a Redis
outage; and the redaction of records (messages, tracebacks) in process."""

from __future__ import annotations

import io
import logging
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests._postgres import PostgresServer, require_postgres
from tests._redis import RedisServer, require_redis_client
from tests._servers import Server, free_port
from tests.gateway._engine import EngineServer
from tokenpace._redact import add_secrets, install_log_redaction, redact

PG_PASSWORD = "pg-Pa55word-ledger"
REDIS_PASSWORD = "redis-Pa55word-state"
ENGINE_KEY = "sk-engine-Pa55word-key"
URL_PASSWORD = "url-Pa55word-engine"
SECRETS = (PG_PASSWORD, REDIS_PASSWORD, ENGINE_KEY, URL_PASSWORD)


@pytest.mark.postgres
@pytest.mark.redis
def test_a_gateway_logs_no_password_or_key(engine: EngineServer, tmp_path: Path) -> None:
    require_postgres()
    require_redis_client()
    pg = PostgresServer().start()
    redis = RedisServer(tmp_path / "redis", password=REDIS_PASSWORD).start()
    assert REDIS_PASSWORD in redis.url
    port = free_port()
    server = None
    try:
        ledger = pg.database("ledger").replace("postgres@", f"postgres:{PG_PASSWORD}@")
        batches = pg.database("batches").replace("postgres@", f"postgres:{PG_PASSWORD}@")
        config = {
            "engines": [{"url": engine.url, "api_key": ENGINE_KEY},
                        {"url": engine.url.replace("://", f"://probe:{URL_PASSWORD}@")
                                          .replace("127.0.0.1", "localhost")}],
            "ledger": ledger, "batch": {"store": batches},
            "state": {"url": redis.url, "timeout": "1s"},
            "tenants": [{"id": "team-a", "api_keys": ["sk-team-a"]}],
        }
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        log = tmp_path / "gateway.log"
        server = Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config",
                         str(path), "--port", str(port), "--log-level", "debug"], port, log)
        server.wait_ready(timeout_s=30)
        def chat() -> httpx.Response:
            return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                              headers={"authorization": "Bearer sk-team-a"},
                              json={"model": "fake", "max_tokens": 2,
                                    "messages": [{"role": "user", "content": "hi"}]})

        assert chat().status_code == 200
        redis.stop()  # the state store's outage is logged with its URL
        deadline = time.monotonic() + 15
        while "unreachable" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, server.log_tail(50)
            chat()  # refused or served: the store is asked, and found down
            time.sleep(0.2)
        redis.start()
    finally:
        if server is not None:
            server.stop()
        redis.stop()
        pg.stop()
    text = log.read_text(errors="replace")
    assert "ledger postgresql://postgres:***@" in text  # the start-up line, redacted
    assert f"redis://:***@" in text and f"http://probe:***@localhost" in text
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, [line for line in text.splitlines() if any(s in line for s in leaked)]


def test_records_come_out_redacted_messages_and_tracebacks() -> None:
    install_log_redaction()
    add_secrets(["sk-literal-engine-key"])
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("tests.redaction")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("store %s down", "postgresql://u:p@ss/w@db.internal:5432/x")
        try:
            raise RuntimeError("engine refused key sk-literal-engine-key (password=hunter22)")
        except RuntimeError:
            logger.exception("call failed with 'Authorization: Bearer sk-tenant-777'")
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    for secret in ("p@ss/w", "ss/w@", "sk-literal-engine-key", "hunter22", "sk-tenant-777"):
        assert secret not in out, out
    assert "RuntimeError" in out and "postgresql://u:***@db.internal" in out
    assert redact("sqlite:////var/lib/usage.db") == "sqlite:////var/lib/usage.db"
