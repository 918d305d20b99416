"""The gateway metrics that only the dashboard and the alert rules read: the tenant's
configured rate (follows reloads) and the ledger's failure counters (real SQLite)."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import replace
from pathlib import Path

from tokenpace.gateway import metrics as _metrics
from tokenpace.gateway.config import parse_config
from tokenpace.gateway.ledger import UsageRecord, open_ledger
from tokenpace.gateway.tenants import Tenants

RATE = "tokenpace_gateway_tenant_output_rate_tokens_per_second"


def value(name: str, **labels: str) -> float | None:
    return _metrics.REGISTRY.get_sample_value(name, labels)


def config(*tenants: dict) -> object:
    return parse_config({"engines": [{"url": "http://127.0.0.1:9"}], "tenants": list(tenants)})


def test_configured_rate_follows_reloads() -> None:
    fast = {"id": "mon-fast", "api_keys": ["sk-1"], "output_tokens_per_second": 250}
    slow = {"id": "mon-slow", "api_keys": ["sk-2"], "output_tokens_per_second": 0.5}
    tenants = Tenants(config(fast, slow), clock=lambda: 0.0)
    assert value(RATE, tenant="mon-fast") is None  # no traffic yet: no series
    for tenant_id in ("mon-fast", "mon-slow"):
        state = tenants.get(tenant_id)
        assert state is not None
        tenants.touch(state)
    assert value(RATE, tenant="mon-fast") == 250
    assert value(RATE, tenant="mon-slow") == 0.5

    tenants.apply(config({**fast, "output_tokens_per_second": 300},
                         {"id": "mon-slow", "api_keys": ["sk-2"]}))  # rate removed
    assert value(RATE, tenant="mon-fast") == 300
    assert value(RATE, tenant="mon-slow") is None

    tenants.apply(config({"id": "mon-other", "api_keys": ["sk-3"]}))  # mon-fast removed
    assert value(RATE, tenant="mon-fast") is None


def row(i: int) -> UsageRecord:
    return UsageRecord(request_id=f"mon-{i}", tenant="t", model="tiny", lane="l", prompt_tokens=1,
                       completion_tokens=1, cost=2.0, queue_ms=None, ttft_ms=None, e2e_ms=1.0,
                       finish_reason="stop", started_at=1.0, ended_at=2.0)


def test_ledger_failures_and_dropped_rows_are_counted(tmp_path: Path) -> None:
    failures = value("tokenpace_gateway_ledger_write_failures_total") or 0.0
    dropped = value("tokenpace_gateway_ledger_dropped_rows_total") or 0.0
    path = tmp_path / "usage.db"
    # A journal of 400 bytes (about 4 rows): refused requests' rows beyond it are dropped.
    ledger = open_ledger(f"sqlite:///{path}", journal=str(tmp_path / "journal"),
                         journal_bytes=400, flush_interval_s=0.02)
    blocker = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        blocker.execute("BEGIN EXCLUSIVE")  # every flush fails while this holds the file
        for i in range(10):
            ledger.record(replace(row(i), served=False))
        lost = ledger.dropped
        assert 0 < lost < 10
        deadline = time.monotonic() + 30
        while value("tokenpace_gateway_ledger_write_failures_total") == failures \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert value("tokenpace_gateway_ledger_write_failures_total") > failures
        assert value("tokenpace_gateway_ledger_dropped_rows_total") == dropped + lost
        assert value("tokenpace_gateway_ledger_journal_bytes") > 0
        blocker.execute("ROLLBACK")
    finally:
        blocker.close()
        ledger.close()
    assert value("tokenpace_gateway_ledger_dropped_rows_total") == dropped + lost
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 10 - lost
    conn.close()
