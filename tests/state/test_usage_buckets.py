"""The usage API's query (``Ledger.usage_buckets``) on SQLite and on a real PostgreSQL:
per bucket and group, and adding up to ``tokenpace usage``'s totals over the same rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_ledger import T0, mixed_records
from tokenpace.gateway.ledger import open_ledger


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return "sqlite:///" + str(tmp_path / "usage.db")
    return str(request.getfixturevalue("pg_url"))


def test_buckets_add_up_to_the_usage_totals(ledger_url: str) -> None:
    ledger = open_ledger(ledger_url, flush_interval_s=60)
    try:
        for rec in mixed_records():  # ending at T0 + 0 .. T0 + 7
            ledger.record(rec)
        ledger.flush()
        start = T0 - 0.5
        rows = ledger.usage_buckets(start, T0 + 100, 2.0, ("project_id",))
        # (bucket, tenant, requests, rejected, prompt, cached, completion)
        assert {r[0] for r in rows} == {0, 1, 2, 3}  # 2 s buckets over 8 s of rows
        for total in ledger.usage(since=start):
            mine = [r for r in rows if r[1] == total.key]
            assert sum(r[2] for r in mine) == total.requests
            assert sum(r[3] for r in mine) == total.rejected
            assert sum(r[4] for r in mine) == total.prompt_tokens
            assert sum(r[5] for r in mine) == total.cached_prompt_tokens
            assert sum(r[6] for r in mine) == total.completion_tokens
        by_model = ledger.usage_buckets(start, T0 + 100, 86400.0, ("project_id", "model"))
        assert all(r[0] == 0 for r in by_model)
        for total in ledger.usage(since=start, by="model"):
            assert sum(r[7] for r in by_model if r[2] == total.key) == total.completion_tokens
        # The window is [start, end) on ended_at; filters keep only what they name.
        assert ledger.usage_buckets(T0 + 1, T0 + 2, 60.0) == \
            [(0, 1, 0, 5, 0, 7)]  # only the row that ended at T0 + 1
        only = ledger.usage_buckets(start, T0 + 100, 60.0, ("project_id",), tenants=("beta",))
        assert {r[1] for r in only} == {"beta"}
        none = ledger.usage_buckets(start, T0 + 100, 60.0, (), models=("nothing",))
        assert none == []
    finally:
        ledger.close()
