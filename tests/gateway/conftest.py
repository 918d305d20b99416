"""Real gateway processes over real HTTP, in front of a fake engine served in-process."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests._redis import RedisServer
from tests._servers import Server, free_port
from tests.gateway._engine import EngineServer
from tokenpace.gateway import parse_config
from tokenpace.gateway.dispatch import Dispatcher
from tokenpace.gateway.ledger import UsageRecord, open_ledger

KEY_A = "sk-team-a"
KEY_B = "sk-team-b"
ADMIN_KEY = "sk-admin"


def base_config(engine_url: str, ledger: Path, **tenant_a: Any) -> dict[str, Any]:
    return {
        "engines": [{"url": engine_url, "max_inflight": 8}],
        "cost": {"prompt": 1.0, "completion": 2.0},
        "lanes": [{"name": "interactive", "priority": 0}, {"name": "batch", "priority": 10}],
        "ledger": f"sqlite:///{ledger}",
        "admin_api_keys": [ADMIN_KEY],
        "tenants": [
            {"id": "team-a", "api_keys": [KEY_A], "lane": "interactive", "weight": 2,
             "output_tokens_per_second": 100, "max_output_tokens": 64, **tenant_a},
            {"id": "team-b", "api_keys": [KEY_B], "lane": "batch"},
        ],
    }


def pinned_engine(urls: list[str], tenant: str) -> int:
    """The index in ``urls`` of the engine a gateway in front of ``urls`` pins ``tenant``
    to (all healthy), asked of the gateway's own router: tests pick tenant names per engine
    before the gateway starts, without a copy of its hash."""
    config = parse_config({"engines": urls, "tenants": [{"id": tenant, "api_keys": ["sk-x"]}],
                           "ledger": "sqlite:///unused.db"})
    dispatcher = Dispatcher(config, time.monotonic)
    return dispatcher.engines.index(dispatcher.engine_for(tenant))


ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN_KEY}"}


def health(url: str) -> httpx.Response:
    """``GET /health`` of the gateway at ``url`` with the test gateways' admin key."""
    return httpx.get(f"{url}/health", headers=ADMIN_HEADERS)


class GatewayProcess:
    """``tokenpace gateway`` as a subprocess; ``config`` is rewritten by ``write``."""

    def __init__(self, tmp: Path, config: dict[str, Any]) -> None:
        self.tmp = tmp
        self.config_path = tmp / "gateway.yaml"
        self.config = config
        self.write(config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: Server | None = None
        self._starts = 0

    def write(self, config: dict[str, Any]) -> None:
        # /health's details (engines, state store) need an admin or metrics key.
        config.setdefault("admin_api_keys", [ADMIN_KEY])
        # Every scrape renders anew: tests read a counter right after the request that
        # moved it (test_scrape_http tests the cache itself).
        config.setdefault("metrics_cache", 0)
        self.config = config
        self.config_path.write_text(yaml.safe_dump(config))

    def start(self) -> GatewayProcess:
        self._starts += 1
        self.server = Server(
            [sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(self.config_path),
             "--port", str(self.port), "--log-level", "warning"],
            self.port, self.tmp / f"gateway-{self._starts}.log")
        self.server.wait_ready(timeout_s=30)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def log(self) -> str:
        return self.server.log_tail(200) if self.server else ""

    def rows(self, expected: int, timeout_s: float = 10.0) -> list[UsageRecord]:
        """Ledger rows once at least ``expected`` are written (the gateway batches writes)."""
        ledger = open_ledger(self.config["ledger"])
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                rows = ledger.rows()
                if len(rows) >= expected or time.monotonic() > deadline:
                    return rows
                time.sleep(0.1)
        finally:
            ledger.close()

    def row(self, request_id: str, timeout_s: float = 10.0) -> UsageRecord:
        """The ledger row of request ``request_id`` once it is written (fails after
        ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            rows = [r for r in self.rows(0, timeout_s=0) if r.request_id == request_id]
            if rows or time.monotonic() > deadline:
                assert rows, f"no ledger row for {request_id}"
                return rows[0]
            time.sleep(0.05)

    def rows_since(self, t0: float, expected: int, timeout_s: float = 10.0) -> list[UsageRecord]:
        """Ledger rows of requests that started at or after ``t0`` (wall clock)."""
        deadline = time.monotonic() + timeout_s
        while True:
            rows = [r for r in self.rows(0, timeout_s=0) if r.started_at >= t0]
            if len(rows) >= expected or time.monotonic() > deadline:
                return rows
            time.sleep(0.1)

    def health(self) -> Any:
        """``/health`` with its details (the engines, the state store): the admin key's view."""
        return health(self.url).json()

    def scrape(self) -> str:
        """One ``/metrics`` page: values read from it together are of one instant."""
        return httpx.get(f"{self.url}/metrics").text

    def metric(self, name: str, page: str | None = None, **labels: str) -> float | None:
        """``name``'s value with ``labels`` on ``page`` (None: a new scrape)."""
        text = self.scrape() if page is None else page
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                return float(value)
        return None

    def wait_metric(self, name: str, value: float, timeout_s: float = 5.0, **labels: str) -> float | None:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.metric(name, **labels)
            if got == value or time.monotonic() > deadline:
                return got
            time.sleep(0.05)


@pytest.fixture
def engine() -> Iterator[EngineServer]:
    server = EngineServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A ``redis-server`` of the test's own, for replicas sharing their state."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def make_gateway(tmp_path: Path) -> Iterator[Any]:
    started: list[GatewayProcess] = []

    def make(config: dict[str, Any], start: bool = True) -> GatewayProcess:
        gw = GatewayProcess(tmp_path, config)
        started.append(gw)
        return gw.start() if start else gw

    yield make
    for gw in started:
        gw.stop()


@pytest.fixture
def gateway(engine: EngineServer, make_gateway: Any, tmp_path: Path) -> GatewayProcess:
    return make_gateway(base_config(engine.url, tmp_path / "usage.db"))
