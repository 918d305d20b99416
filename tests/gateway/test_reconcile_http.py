"""The gateway's periodic check of its ledger against the engines' books
(``reconcile_interval``), over real HTTP in front of the fake engine's book."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_A, KEY_B, GatewayProcess, base_config
from tokenpace.gateway.reconcile import reconcile_main

UNRECORDED_REQUESTS = "tokenpace_gateway_ledger_unrecorded_requests_total"
UNRECORDED_TOKENS = "tokenpace_gateway_ledger_unrecorded_tokens_total"
OVERCHARGED_TOKENS = "tokenpace_gateway_ledger_overcharged_tokens_total"


def complete(gw: GatewayProcess, key: str, prompt: str, chat: bool = False) -> str:
    """One non-streamed completion (or chat completion) of 5 tokens; its gateway request
    id."""
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": prompt}]} if chat
                            else {"prompt": prompt})
    resp = httpx.post(f"{gw.url}/v1/{'chat/' if chat else ''}completions", timeout=30,
                      headers={"authorization": f"Bearer {key}"},
                      json={"model": "fake", "max_tokens": 5, **body})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-request-id"]


def test_the_periodic_check_counts_what_the_ledger_lost_or_got_wrong(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    """A row deleted by hand within the grace: its request and its 5 tokens are counted
    unrecorded under its tenant, the intact row is not; then a row short of the engine's
    count by 3 (unrecorded tokens, no unrecorded request), and one 2 over it
    (overcharged). The lost one is a chat request with one choice: its one engine request
    is all it has, so the grace is all it waits (a completion without a row may have
    more prompts still running: it waits ``request_timeout`` too)."""
    engine.engine.book_extra = 0
    ledger = tmp_path / "u.db"
    gw = make_gateway({**base_config(engine.url, ledger), "reconcile_interval": 0.3,
                       "reconcile_grace": 2})
    complete(gw, KEY_A, "kept")
    lost = complete(gw, KEY_B, "lost", chat=True)
    assert len(gw.rows(2)) == 2
    with sqlite3.connect(ledger) as conn:
        assert conn.execute("DELETE FROM requests WHERE request_id = ?", (lost,)).rowcount == 1
    assert gw.wait_metric(UNRECORDED_REQUESTS, 1, timeout_s=15, tenant="team-b") == 1, gw.log()
    assert gw.metric(UNRECORDED_TOKENS, tenant="team-b") == 5
    assert gw.metric(UNRECORDED_REQUESTS, tenant="team-a") is None
    assert gw.metric(OVERCHARGED_TOKENS, tenant="team-a") is None

    engine.engine.book_extra = 3  # the engine generated 3 more than the row holds
    complete(gw, KEY_A, "short")
    assert gw.wait_metric(UNRECORDED_TOKENS, 3, timeout_s=15, tenant="team-a") == 3, gw.log()
    assert gw.metric(UNRECORDED_REQUESTS, tenant="team-a") is None

    engine.engine.book_extra = -2  # the row holds 2 more than the engine generated
    complete(gw, KEY_A, "over")
    assert gw.wait_metric(OVERCHARGED_TOKENS, 2, timeout_s=15, tenant="team-a") == 2, gw.log()
    assert gw.metric(UNRECORDED_TOKENS, tenant="team-a") == 3
    assert gw.metric(UNRECORDED_REQUESTS, tenant="team-b") == 1


def test_an_engine_without_a_book_is_not_compared(engine: EngineServer, make_gateway: Any,
                                                  tmp_path: Path) -> None:
    """Plain vLLM (404): the check asks, counts nothing and the gateway serves on."""
    gw = make_gateway({**base_config(engine.url, tmp_path / "u.db"),
                       "reconcile_interval": 0.2, "reconcile_grace": 0})
    complete(gw, KEY_A, "plain")
    calls = engine.engine.ended_calls
    deadline = time.monotonic() + 10
    while engine.engine.ended_calls < calls + 2:
        assert time.monotonic() < deadline, gw.log()
        time.sleep(0.05)
    assert gw.metric(UNRECORDED_REQUESTS, tenant="team-a") is None
    assert "not tokenpace's engine" in gw.log()
    complete(gw, KEY_A, "still served")


def test_usage_reconcile_reports_per_tenant_and_exits_by_drift(
        engine: EngineServer, make_gateway: Any, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``tokenpace usage reconcile`` in process: 0 while every row matches the book, 1
    with a lost row (listed under its tenant), 3 when no engine keeps a book."""
    engine.engine.book_extra = 0
    ledger = tmp_path / "u.db"
    gw = make_gateway({**base_config(engine.url, ledger), "reconcile_interval": 0})
    complete(gw, KEY_A, "one", chat=True)
    lost = complete(gw, KEY_B, "two", chat=True)
    complete(gw, KEY_B, "three")
    assert len(gw.rows(3)) == 3
    argv = ["--config", str(gw.config_path), "--grace", "0"]
    assert reconcile_main(argv) == 0
    clean = capsys.readouterr().out
    assert "team-a" in clean and "team-b" in clean and "request_id" not in clean, clean
    with sqlite3.connect(ledger) as conn:
        conn.execute("DELETE FROM requests WHERE request_id = ?", (lost,))
    assert reconcile_main(argv) == 1
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if x.startswith(lost)]
    assert line.split()[1:5] == ["team-b", "unrecorded", "5", "-"], out
    [team_b] = [x for x in out.splitlines() if x.startswith("team-b ")]
    assert team_b.split()[1:6] == ["2", "10", "5", "-5", "1"], out
    assert reconcile_main([*argv, "--grace", "1h"]) == 0  # all ended within the hour
    capsys.readouterr()
    engine.engine.book_extra = None
    assert reconcile_main(argv) == 3
    assert "not tokenpace's engine" in capsys.readouterr().out
