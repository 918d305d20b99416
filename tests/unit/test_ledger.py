"""Usage ledger on real SQLite files: round trip, batching, budgets across a restart,
totals, and no lost rows while the database is locked.

The ``check_*`` helpers take a ledger URL so that test_ledger_postgres.py runs the very
same checks against a real Postgres server.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sqlite3
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tokenpace.gateway.ledger import BudgetState, LedgerError, UsageRecord, UsageTotal, open_ledger
from tokenpace.gateway.ledger._schema import (
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    RECORD_COLUMNS,
    Dialect,
    migrations,
    record_from_row,
    record_row,
)

T0 = 1_795_000_000.0  # a fixed instant in late 2026, so `since` cut-offs are exact


def record(
    i: int,
    *,
    tenant: str = "acme",
    model: str = "tiny",
    lane: str = "interactive",
    prompt: int = 10,
    completion: int = 20,
    finish: str = "stop",
    ended_at: float | None = None,
    application: str = "",
) -> UsageRecord:
    """A distinct, fully populated row; cost is 1 per prompt and 2 per completion token."""
    end = T0 + i if ended_at is None else ended_at
    return UsageRecord(
        request_id=f"req-{i}",
        tenant=tenant,
        model=model,
        lane=lane,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cost=prompt + 2.0 * completion,
        queue_ms=1.25 + i,
        ttft_ms=30.5 + i,
        e2e_ms=400.75 + i,
        finish_reason=finish,
        started_at=end - 0.5,
        ended_at=end,
        route=("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")[i % 4],
        application=application,
    )


def mixed_records() -> list[UsageRecord]:
    """Rows across tenants, models and lanes, including rejections and an unauthenticated
    one (empty tenant, no timings), ending at T0+0 .. T0+7."""
    return [
        record(0, tenant="acme", model="tiny", lane="interactive", prompt=10, completion=20),
        record(1, tenant="acme", model="big", lane="batch", prompt=5, completion=7,
               finish="length"),
        record(2, tenant="beta", model="tiny", lane="batch", prompt=3, completion=0,
               finish="cancelled"),
        record(3, tenant="beta", model="tiny", lane="interactive", prompt=0, completion=0,
               finish="rejected:budget"),
        record(4, tenant="acme", model="tiny", lane="interactive", prompt=100, completion=50,
               finish="timeout"),
        UsageRecord("req-5", "", "tiny", "interactive", 0, 0, 0.0, None, None, 0.3,
                    "rejected:unknown_key", T0 + 5, T0 + 5),
        record(6, tenant="beta", model="big", lane="interactive", prompt=8, completion=9,
               finish="upstream_error"),
        record(7, tenant="acme", model="big", lane="interactive", prompt=0, completion=0,
               finish="rejected:queue_full"),
    ]


# -- checks shared with the Postgres tests ------------------------------------------------


def check_round_trip(url: str) -> None:
    """Every field comes back exactly, in ended_at order, after close and reopen."""
    recs = mixed_records()
    recs.append(
        UsageRecord("req-ü", "tenant ü", "m/ö", "lane", 2**40, 3, 1.5e-7, 0.0, None, 1e-3,
                    "stop", T0 - 100.123456789, T0 - 99.987654321, application="app/ü 1",
                    cached_prompt_tokens=2**39, estimated=True)
    )
    ledger = open_ledger(url, flush_interval_s=60)
    for rec in reversed(recs):
        ledger.record(rec)
    ledger.close()

    ledger = open_ledger(url)
    try:
        assert ledger.rows() == sorted(recs, key=lambda r: r.ended_at)
        assert ledger.rows(since=T0 + 6) == [recs[6], recs[7]]
        assert ledger.dropped == 0
    finally:
        ledger.close()


def check_budgets_survive_restart(url: str) -> None:
    """Budget levels upsert by (tenant, budget), the latest save wins, and a new process
    (a reopened ledger) loads them."""
    ledger = open_ledger(url, flush_interval_s=60)
    assert ledger.load_budgets() == []
    ledger.save_budgets([
        BudgetState("acme", "20000/10s", 1500.5, T0),
        BudgetState("acme", "1000000/1d", 900_000.0, T0),
        BudgetState("beta", "20000/10s", 20000.0, T0),
    ])
    ledger.flush()
    ledger.save_budgets([BudgetState("acme", "20000/10s", 10.0, T0 + 1)])
    ledger.save_budgets([BudgetState("acme", "20000/10s", 7.25, T0 + 2)])  # newer snapshot
    ledger.close()

    ledger = open_ledger(url)
    try:
        assert ledger.load_budgets() == [
            BudgetState("acme", "1000000/1d", 900_000.0, T0),
            BudgetState("acme", "20000/10s", 7.25, T0 + 2),
            BudgetState("beta", "20000/10s", 20000.0, T0),
        ]
    finally:
        ledger.close()


def check_usage_totals(url: str) -> None:
    """Totals per tenant, model, lane and route, with `since` and the rejected count."""
    ledger = open_ledger(url, flush_interval_s=60)
    try:
        for rec in mixed_records():
            ledger.record(rec)
        ledger.flush()

        assert ledger.usage() == [
            UsageTotal("", 1, 0, 0, 0.0, 1),
            UsageTotal("acme", 4, 115, 77, 115 + 2 * 77.0, 1),
            UsageTotal("beta", 3, 11, 9, 11 + 2 * 9.0, 1),
        ]
        assert ledger.usage(by="model") == [
            UsageTotal("big", 3, 13, 16, 13 + 2 * 16.0, 1),
            UsageTotal("tiny", 5, 113, 70, 113 + 2 * 70.0, 2),
        ]
        assert ledger.usage(by="lane") == [
            UsageTotal("batch", 2, 8, 7, 8 + 2 * 7.0, 0),
            UsageTotal("interactive", 6, 118, 79, 118 + 2 * 79.0, 3),
        ]
        assert ledger.usage(by="route") == [
            UsageTotal("", 1, 0, 0, 0.0, 1),
            UsageTotal("/v1/chat/completions", 2, 110, 70, 110 + 2 * 70.0, 0),
            UsageTotal("/v1/completions", 1, 5, 7, 5 + 2 * 7.0, 0),
            UsageTotal("/v1/messages", 2, 0, 0, 0.0, 2),
            UsageTotal("/v1/responses", 2, 11, 9, 11 + 2 * 9.0, 0),
        ]
        # `since` is inclusive and applies to ended_at.
        assert ledger.usage(since=T0 + 4) == [
            UsageTotal("", 1, 0, 0, 0.0, 1),
            UsageTotal("acme", 2, 100, 50, 200.0, 1),
            UsageTotal("beta", 1, 8, 9, 26.0, 0),
        ]
        assert ledger.usage(since=T0 + 1000) == []
        with pytest.raises(ValueError, match="tenant, model, lane"):
            ledger.usage(by="finish_reason")
    finally:
        ledger.close()


def check_rewritten_rows_are_recorded_once(url: str) -> None:
    """A batch written again (its commit was lost in transit) adds nothing: the insert is
    idempotent on the request id."""
    ledger = open_ledger(url, flush_interval_s=60)
    try:
        ledger.record(record(0))
        ledger.flush()
        ledger.record(record(0))  # the writer's retry of a batch that had committed
        ledger.record(record(1))
        ledger.flush()
        assert ledger.rows() == [record(0), record(1)]
    finally:
        ledger.close()


def check_unserved_prompt_tokens_are_a_separate_total(url: str) -> None:
    """Served prompt tokens (the gateway metric's count) and unserved ones apart."""
    unserved = [
        UsageRecord("req-r", "acme", "tiny", "interactive", 50, 0, 0.0, None, None, 1.0,
                    "rejected:budget", T0, T0 + 1, served=False),
        UsageRecord("req-q", "acme", "tiny", "interactive", 7, 0, 0.0, 900.0, None, 900.0,
                    "cancelled", T0, T0 + 2, served=False),
    ]
    ledger = open_ledger(url, flush_interval_s=60)
    try:
        for rec in [record(0, prompt=10, completion=4), *unserved]:
            ledger.record(rec)
        ledger.flush()
        assert ledger.usage() == [UsageTotal("acme", 3, 10, 4, 18.0, 1, 57)]
        assert [r.served for r in ledger.rows()] == [True, False, False]
    finally:
        ledger.close()


OLD_REQUESTS_TABLE = """CREATE TABLE requests (
    request_id TEXT NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL, lane TEXT NOT NULL,
    prompt_tokens {integer} NOT NULL, completion_tokens {integer} NOT NULL, cost {real} NOT NULL,
    queue_ms {real}, ttft_ms {real}, e2e_ms {real} NOT NULL, finish_reason TEXT NOT NULL,
    started_at {real} NOT NULL, ended_at {real} NOT NULL)"""


def check_an_old_ledger_is_migrated(url: str, execute: Any, integer: str, real: str) -> None:
    """A ledger of the previous schema (no ``served``, request ids not unique, duplicates
    already written) opens: duplicates go, ``served`` is inferred, new rows are idempotent."""
    execute(OLD_REQUESTS_TABLE.format(integer=integer, real=real))
    old = "INSERT INTO requests VALUES ('{id}', 'acme', 'tiny', 'lane', {p}, {c}, {cost}, " \
          "NULL, NULL, 1.0, '{finish}', {t}, {t})"
    execute(old.format(id="a", p=10, c=5, cost=20.0, finish="stop", t=T0))
    execute(old.format(id="a", p=10, c=5, cost=20.0, finish="stop", t=T0))  # written twice
    execute(old.format(id="b", p=40, c=0, cost=0.0, finish="rejected:budget", t=T0 + 1))
    execute(old.format(id="c", p=9, c=0, cost=0.0, finish="cancelled", t=T0 + 2))
    ledger = open_ledger(url, flush_interval_s=60)
    try:
        assert [(r.request_id, r.served, r.route, r.application) for r in ledger.rows()] == [
            ("a", True, "", ""), ("b", False, "", ""), ("c", False, "", "")]  # unknown before
        assert ledger.usage() == [UsageTotal("acme", 3, 10, 5, 20.0, 1, 49)]
        ledger.record(record(0))
        ledger.record(record(0))
        ledger.flush()
        assert len(ledger.rows()) == 4
    finally:
        ledger.close()
    open_ledger(url).close()  # migrating again is a no-op


def check_usage_by_application(url: str) -> None:
    """Totals per (tenant, application): each application of a tenant, and the tenant's
    own keys (application ""), apart; the same application id in two tenants is two
    applications; a tenant id with a "/" cannot be confused with an application id."""
    recs = [
        record(0, tenant="acme", application="chat", prompt=10, completion=20),
        record(1, tenant="acme", application="chat", prompt=5, completion=5,
               finish="rejected:budget"),
        record(2, tenant="acme", application="batch", prompt=3, completion=4),
        record(3, tenant="acme", prompt=1, completion=2),  # a tenant-level key
        record(4, tenant="beta", application="chat", prompt=7, completion=8),
        record(5, tenant="a/b", application="c", prompt=1, completion=1),
        record(6, tenant="a", application="b/c", prompt=2, completion=2),
        UsageRecord("req-7", "", "tiny", "interactive", 0, 0, 0.0, None, None, 0.3,
                    "rejected:unknown_key", T0 + 7, T0 + 7),
    ]
    ledger = open_ledger(url, flush_interval_s=60)
    try:
        for rec in recs:
            ledger.record(rec)
        ledger.flush()
        assert ledger.usage(by="application") == [
            UsageTotal("", 1, 0, 0, 0.0, 1, tenant=""),
            UsageTotal("b/c", 1, 2, 2, 6.0, 0, tenant="a"),
            UsageTotal("c", 1, 1, 1, 3.0, 0, tenant="a/b"),
            UsageTotal("", 1, 1, 2, 5.0, 0, tenant="acme"),
            UsageTotal("batch", 1, 3, 4, 11.0, 0, tenant="acme"),
            # record() charges the refused row too; the ledger sums what it was given.
            UsageTotal("chat", 2, 15, 25, 65.0, 1, tenant="acme"),
            UsageTotal("chat", 1, 7, 8, 23.0, 0, tenant="beta"),
        ]
        assert ledger.usage(since=T0 + 4, by="application") == [
            UsageTotal("", 1, 0, 0, 0.0, 1, tenant=""),
            UsageTotal("b/c", 1, 2, 2, 6.0, 0, tenant="a"),
            UsageTotal("c", 1, 1, 1, 3.0, 0, tenant="a/b"),
            UsageTotal("chat", 1, 7, 8, 23.0, 0, tenant="beta"),
        ]
        # Every other grouping leaves `tenant` unset, and by tenant the applications merge.
        assert [t for t in ledger.usage() if t.key == "acme"] == [
            UsageTotal("acme", 4, 19, 31, 81.0, 1)]
    finally:
        ledger.close()


PREVIOUS_REQUESTS_TABLE = """CREATE TABLE requests (
    request_id TEXT NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL, lane TEXT NOT NULL,
    prompt_tokens {integer} NOT NULL, completion_tokens {integer} NOT NULL, cost {real} NOT NULL,
    queue_ms {real}, ttft_ms {real}, e2e_ms {real} NOT NULL, finish_reason TEXT NOT NULL,
    started_at {real} NOT NULL, ended_at {real} NOT NULL,
    served {integer} NOT NULL DEFAULT 1, route TEXT NOT NULL DEFAULT '')"""
"""The ``requests`` table of the version before applications: ``served`` and ``route``
already there, no ``application``."""


def check_a_ledger_without_application_is_migrated(
    url: str, execute: Any, integer: str, real: str
) -> None:
    """A ledger of the version before applications opens: the column is added, its old
    rows read back with application "", and an insert that does not name the column (a
    replica of the previous version still writing to a shared ledger) still works."""
    execute(PREVIOUS_REQUESTS_TABLE.format(integer=integer, real=real))
    execute("CREATE UNIQUE INDEX requests_request_id ON requests (request_id)")
    old = "INSERT INTO requests (request_id, tenant, model, lane, prompt_tokens, " \
          "completion_tokens, cost, queue_ms, ttft_ms, e2e_ms, finish_reason, started_at, " \
          "ended_at, served, route) VALUES ('{id}', 'acme', 'tiny', 'lane', 10, 5, 20.0, " \
          "NULL, NULL, 1.0, 'stop', {t}, {t}, 1, '/v1/responses')"
    execute(old.format(id="a", t=T0))
    ledger = open_ledger(url, flush_interval_s=60)
    try:
        assert [(r.request_id, r.route, r.application) for r in ledger.rows()] == [
            ("a", "/v1/responses", "")]
        execute(old.format(id="b", t=T0 + 1))  # the previous version's insert
        ledger.record(record(2, tenant="acme", application="chat", prompt=1, completion=1))
        ledger.flush()
        assert [(r.request_id, r.application) for r in ledger.rows()] == [
            ("a", ""), ("b", ""), ("req-2", "chat")]
        assert ledger.usage(by="application") == [
            UsageTotal("", 2, 20, 10, 40.0, 0, tenant="acme"),
            UsageTotal("chat", 1, 1, 1, 3.0, 0, tenant="acme"),
        ]
    finally:
        ledger.close()
    open_ledger(url).close()  # migrating again is a no-op
    reader = open_ledger(url)
    try:
        assert len(reader.rows()) == 3
    finally:
        reader.close()


APPLICATIONS_REQUESTS_TABLE = PREVIOUS_REQUESTS_TABLE.replace(
    "route TEXT NOT NULL DEFAULT '')",
    "route TEXT NOT NULL DEFAULT '', application TEXT NOT NULL DEFAULT '')")
"""The ``requests`` table of the version before cached prompt tokens were kept."""


def check_a_ledger_without_cached_tokens_is_migrated(
    url: str, execute: Any, integer: str, real: str
) -> None:
    """A ledger of the version before ``cached_prompt_tokens`` opens: the column is added
    with 0 for the old rows (charged in full), an insert of the previous version (which
    does not name the column) still works, and the totals count cached tokens of served
    rows only."""
    execute(APPLICATIONS_REQUESTS_TABLE.format(integer=integer, real=real))
    execute("CREATE UNIQUE INDEX requests_request_id ON requests (request_id)")
    old = "INSERT INTO requests (request_id, tenant, model, lane, prompt_tokens, " \
          "completion_tokens, cost, queue_ms, ttft_ms, e2e_ms, finish_reason, started_at, " \
          "ended_at, served, route, application) VALUES ('{id}', 'acme', 'tiny', 'lane', " \
          "10, 5, 20.0, NULL, NULL, 1.0, 'stop', {t}, {t}, 1, '/v1/chat/completions', '')"
    execute(old.format(id="a", t=T0))
    ledger = open_ledger(url, flush_interval_s=60)
    try:
        assert [(r.request_id, r.cached_prompt_tokens) for r in ledger.rows()] == [("a", 0)]
        execute(old.format(id="b", t=T0 + 1))  # the previous version's insert
        cached = UsageRecord("c", "acme", "tiny", "lane", 100, 2, 30.0, 1.0, 2.0, 3.0,
                             "stop", T0 + 2, T0 + 2, cached_prompt_tokens=80)
        refused = UsageRecord("d", "acme", "tiny", "lane", 100, 0, 0.0, None, None, 1.0,
                              "rejected:budget", T0 + 3, T0 + 3, served=False,
                              cached_prompt_tokens=7)  # not served: not in the total
        ledger.record(cached)
        ledger.record(refused)
        ledger.flush()
        assert [(r.request_id, r.cached_prompt_tokens) for r in ledger.rows()] == [
            ("a", 0), ("b", 0), ("c", 80), ("d", 7)]
        assert ledger.usage() == [UsageTotal("acme", 4, 120, 12, 70.0, 1, 100,
                                             cached_prompt_tokens=80)]
    finally:
        ledger.close()
    open_ledger(url).close()  # migrating again is a no-op
    reader = open_ledger(url)
    try:
        assert len(reader.rows()) == 4
    finally:
        reader.close()


def check_a_ledger_without_batch_id_is_migrated(url: str, execute: Any, integer: str,
                                                real: str) -> None:
    """A ledger of the version before the Batch API opens: ``batch_id`` is added with ''
    for the old rows (live requests, as '' means in new rows), an insert of the previous
    version still works, and a batch line's row keeps its batch."""
    execute(APPLICATIONS_REQUESTS_TABLE.format(integer=integer, real=real))
    execute(f"ALTER TABLE requests ADD COLUMN cached_prompt_tokens {integer} NOT NULL DEFAULT 0")
    execute("CREATE UNIQUE INDEX requests_request_id ON requests (request_id)")
    old = "INSERT INTO requests (request_id, tenant, model, lane, prompt_tokens, " \
          "completion_tokens, cost, queue_ms, ttft_ms, e2e_ms, finish_reason, started_at, " \
          "ended_at, served, route, application, cached_prompt_tokens) VALUES ('{id}', " \
          "'acme', 'tiny', 'lane', 10, 5, 20.0, NULL, NULL, 1.0, 'stop', {t}, {t}, 1, " \
          "'/v1/chat/completions', '', 3)"
    execute(old.format(id="a", t=T0))
    ledger = open_ledger(url, flush_interval_s=60)
    try:
        execute(old.format(id="b", t=T0 + 1))  # the previous version's insert
        ledger.record(UsageRecord("c", "acme", "tiny", "batch", 10, 5, 20.0, 0.1, None, 1.0,
                                  "stop", T0 + 2, T0 + 2, batch_id="batch_0123"))
        ledger.flush()
        assert [(r.request_id, r.batch_id, r.cached_prompt_tokens) for r in ledger.rows()] \
            == [("a", "", 3), ("b", "", 3), ("c", "batch_0123", 0)]
    finally:
        ledger.close()
    open_ledger(url).close()  # migrating again is a no-op


BATCH_REQUESTS_TABLE = APPLICATIONS_REQUESTS_TABLE.replace(
    "application TEXT NOT NULL DEFAULT '')",
    "application TEXT NOT NULL DEFAULT '', cached_prompt_tokens {integer} NOT NULL DEFAULT 0, "
    "batch_id TEXT NOT NULL DEFAULT '')")
"""The ``requests`` table of the version before ``estimated``."""


def check_a_ledger_without_estimated_is_migrated(url: str, execute: Any, integer: str,
                                                 real: str) -> None:
    """A ledger of the version before ``estimated`` opens: the column is added with 0 for
    the old rows (nothing marked an estimate then), an insert of the previous version
    still works, an estimated row keeps its mark and the totals count it."""
    execute(BATCH_REQUESTS_TABLE.format(integer=integer, real=real))
    execute("CREATE UNIQUE INDEX requests_request_id ON requests (request_id)")
    old = "INSERT INTO requests (request_id, tenant, model, lane, prompt_tokens, " \
          "completion_tokens, cost, queue_ms, ttft_ms, e2e_ms, finish_reason, started_at, " \
          "ended_at, served, route, application, cached_prompt_tokens, batch_id) VALUES " \
          "('{id}', 'acme', 'tiny', 'lane', 10, 5, 20.0, NULL, NULL, 1.0, 'stop', {t}, {t}, " \
          "1, '/v1/chat/completions', '', 0, '')"
    execute(old.format(id="a", t=T0))
    ledger = open_ledger(url, flush_interval_s=60)
    try:
        execute(old.format(id="b", t=T0 + 1))  # the previous version's insert
        ledger.record(UsageRecord("c", "acme", "tiny", "lane", 10, 7, 24.0, 0.1, 3.0, 9.0,
                                  "client_disconnected", T0 + 2, T0 + 2, estimated=True))
        ledger.flush()
        assert [(r.request_id, r.estimated) for r in ledger.rows()] == [
            ("a", False), ("b", False), ("c", True)]
        assert ledger.usage() == [UsageTotal("acme", 3, 30, 17, 64.0, 0, estimated_rows=1)]
    finally:
        ledger.close()
    open_ledger(url).close()  # migrating again is a no-op


def check_estimated_rows_are_counted(url: str) -> None:
    """``estimated_rows`` counts the rows marked ``estimated`` in each group, refused and
    served alike, and leaves the token totals as they are."""
    recs = [
        record(0, tenant="acme", model="tiny"),
        replace(record(1, tenant="acme", model="big", finish="cancelled"), estimated=True),
        replace(record(2, tenant="beta", model="big", finish="timeout"), estimated=True),
        record(3, tenant="beta", model="tiny"),
    ]
    ledger = open_ledger(url, flush_interval_s=60)
    try:
        for rec in recs:
            ledger.record(rec)
        ledger.flush()
        assert [r.estimated for r in ledger.rows()] == [False, True, True, False]
        assert [(t.key, t.requests, t.completion_tokens, t.estimated_rows)
                for t in ledger.usage(by="model")] == [("big", 2, 40, 2), ("tiny", 2, 40, 0)]
        assert [(t.key, t.estimated_rows) for t in ledger.usage()] == [("acme", 1), ("beta", 1)]
        assert [(t.key, t.estimated_rows) for t in ledger.usage(since=T0 + 2)] == [("beta", 1)]
    finally:
        ledger.close()


EIGHT_MIB = 8 << 20


def dirty_records() -> list[UsageRecord]:
    """Records no database takes as they are (NUL, lone surrogates, 8 MiB strings, NaN,
    infinities, integers beyond 64 bits), between clean ones, ending at T0+0 .. T0+7."""
    return [
        record(0),
        UsageRecord("req-nul", "ac\x00me", "\x00", "interactive", 10, 20, math.nan, math.inf,
                    math.nan, -math.inf, "stop\x00", T0, T0 + 1, route="/v1/\x00chat",
                    application="app\x00"),
        UsageRecord("req-surrogate", "acme", "m\ud800x", "lane\udfff", 2**70,
                    math.nan,  # type: ignore[arg-type]
                    1.0, 1.0, 2.0, 3.0, "stop", math.nan, T0 + 2, cached_prompt_tokens=-(2**70)),
        record(3),
        UsageRecord("req-big", "t" * EIGHT_MIB, "m" * EIGHT_MIB, "interactive", 1, 1, 1.0,
                    None, None, 1.0, "x" * EIGHT_MIB, T0, T0 + 4, route="/" * EIGHT_MIB,
                    application="a" * EIGHT_MIB, batch_id="b" * EIGHT_MIB),
        # Two ids equal once cut, and an id equal to another once cleaned: still three.
        replace(record(5), request_id="r" * 200 + "1"),
        replace(record(6), request_id="r" * 200 + "2"),
        replace(record(7), request_id="req-\x007"),
        replace(record(8), request_id="req-7"),
    ]


def check_dirty_rows_are_written_clean(url: str) -> None:
    """Every dirty record is written, cleaned as :func:`record_row` documents, and the
    clean rows around it too, each once."""
    recs = dirty_records()
    ledger = open_ledger(url, flush_interval_s=60)
    try:
        for rec in recs:
            ledger.record(rec)
        ledger.flush()
        back = ledger.rows()
    finally:
        ledger.close()
    assert back == [record_from_row(record_row(rec)) for rec in recs]
    assert back[0] == recs[0] and back[3] == recs[3]  # clean rows are kept as they were
    nul, surrogate, big = back[1], back[2], back[4]
    assert (nul.model, nul.finish_reason, nul.route) == ("", "stop", "/v1/chat")
    assert re.fullmatch(r"acme~[0-9a-f]{16}", nul.tenant)
    assert re.fullmatch(r"app~[0-9a-f]{16}", nul.application)
    assert (nul.cost, nul.queue_ms, nul.ttft_ms, nul.e2e_ms) == (0.0, None, None, 0.0)
    assert surrogate.model == "m\ufffdx"
    assert re.fullmatch(r"lane\ufffd~[0-9a-f]{16}", surrogate.lane)
    assert (surrogate.prompt_tokens, surrogate.completion_tokens,
            surrogate.cached_prompt_tokens, surrogate.started_at) == (
        2**63 - 1, 0, -(2**63), 0.0)
    assert (big.model, big.finish_reason, big.route) == (
        "m" * MAX_NAME_CHARS, "x" * MAX_NAME_CHARS, "/" * MAX_NAME_CHARS)
    for value, char in ((big.tenant, "t"), (big.application, "a"), (big.batch_id, "b")):
        assert re.fullmatch(rf"{char}{{{MAX_ID_CHARS - 17}}}~[0-9a-f]{{16}}", value)
    ids = [r.request_id for r in back[5:]]
    assert len(set(ids)) == 4 and ids[3] == "req-7"
    assert all(len(i) == MAX_ID_CHARS for i in ids[:2])
    assert re.fullmatch(r"req-7~[0-9a-f]{16}", ids[2])


# -- SQLite ------------------------------------------------------------------------------


def _url(path: Path) -> str:
    return f"sqlite:///{path}"


def _count(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    check_round_trip(_url(tmp_path / "usage.db"))


def test_budgets_upsert_and_survive_a_restart(tmp_path: Path) -> None:
    check_budgets_survive_restart(_url(tmp_path / "usage.db"))


def test_usage_totals_by_tenant_model_lane_and_since(tmp_path: Path) -> None:
    check_usage_totals(_url(tmp_path / "usage.db"))


def test_rewritten_rows_are_recorded_once(tmp_path: Path) -> None:
    check_rewritten_rows_are_recorded_once(_url(tmp_path / "usage.db"))


def test_unserved_prompt_tokens_are_a_separate_total(tmp_path: Path) -> None:
    check_unserved_prompt_tokens_are_a_separate_total(_url(tmp_path / "usage.db"))


def test_an_old_ledger_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"

    def execute(sql: str) -> None:
        with sqlite3.connect(path) as conn:
            conn.execute(sql)

    check_an_old_ledger_is_migrated(_url(path), execute, "INTEGER", "REAL")


def test_usage_by_application_keeps_tenants_apart(tmp_path: Path) -> None:
    check_usage_by_application(_url(tmp_path / "usage.db"))


def _executor(path: Path) -> Any:
    """Runs one statement on the SQLite file (an old ledger made by hand)."""
    def execute(sql: str) -> None:
        with sqlite3.connect(path) as conn:
            conn.execute(sql)
    return execute


def test_a_ledger_without_application_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    check_a_ledger_without_application_is_migrated(_url(path), _executor(path), "INTEGER", "REAL")
    with sqlite3.connect(path) as conn:
        column = [c for c in conn.execute("PRAGMA table_info(requests)") if c[1] == "application"]
    assert [(c[2], c[3], c[4]) for c in column] == [("TEXT", 1, "''")]  # NOT NULL DEFAULT ''


def test_a_ledger_without_cached_tokens_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    check_a_ledger_without_cached_tokens_is_migrated(_url(path), _executor(path), "INTEGER", "REAL")
    with sqlite3.connect(path) as conn:
        column = [c for c in conn.execute("PRAGMA table_info(requests)")
                  if c[1] == "cached_prompt_tokens"]
    assert [(c[2], c[3], c[4]) for c in column] == [("INTEGER", 1, "0")]  # NOT NULL DEFAULT 0


def test_a_ledger_without_batch_id_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    check_a_ledger_without_batch_id_is_migrated(_url(path), _executor(path), "INTEGER", "REAL")


def test_a_ledger_without_estimated_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    check_a_ledger_without_estimated_is_migrated(_url(path), _executor(path), "INTEGER", "REAL")
    with sqlite3.connect(path) as conn:
        column = [c for c in conn.execute("PRAGMA table_info(requests)") if c[1] == "estimated"]
    assert [(c[2], c[3], c[4]) for c in column] == [("INTEGER", 1, "0")]  # NOT NULL DEFAULT 0


def test_a_migrated_ledger_has_the_columns_of_a_new_one(tmp_path: Path) -> None:
    """The oldest ledger, migrated, has the very columns (order, type, NOT NULL, default)
    of one created now: the DDL and the list of added columns agree."""
    old, new = tmp_path / "old.db", tmp_path / "new.db"
    with sqlite3.connect(old) as conn:
        conn.execute(OLD_REQUESTS_TABLE.format(integer="INTEGER", real="REAL"))
    open_ledger(_url(old)).close()
    open_ledger(_url(new)).close()

    def columns(path: Path) -> list[tuple[Any, ...]]:
        with sqlite3.connect(path) as conn:
            return list(conn.execute("PRAGMA table_info(requests)"))

    assert columns(old) == columns(new)
    assert [c[1] for c in columns(new)] == list(RECORD_COLUMNS)


def test_migrations_take_the_columns_there_are() -> None:
    """One ALTER (and its backfill) per missing column, in the order the columns came;
    then the duplicates and the unique index, always."""
    dialect = Dialect(text="TXT", integer="INT8", real="REAL", dedupe="DEDUPE")
    tail = ["DEDUPE",
            "CREATE UNIQUE INDEX IF NOT EXISTS requests_request_id ON requests (request_id)"]
    assert migrations(set(RECORD_COLUMNS), dialect) == tail
    assert migrations(frozenset(RECORD_COLUMNS[:13]), dialect) == [
        "ALTER TABLE requests ADD COLUMN served INT8 NOT NULL DEFAULT 1",
        "UPDATE requests SET served = 0 WHERE substr(finish_reason, 1, 9) = 'rejected:' "
        "OR (cost = 0 AND completion_tokens = 0)",
        "ALTER TABLE requests ADD COLUMN route TXT NOT NULL DEFAULT ''",
        "ALTER TABLE requests ADD COLUMN application TXT NOT NULL DEFAULT ''",
        "ALTER TABLE requests ADD COLUMN cached_prompt_tokens INT8 NOT NULL DEFAULT 0",
        "ALTER TABLE requests ADD COLUMN batch_id TXT NOT NULL DEFAULT ''",
        "ALTER TABLE requests ADD COLUMN estimated INT8 NOT NULL DEFAULT 0",
        *tail,
    ]
    assert migrations([c for c in RECORD_COLUMNS if c != "estimated"], dialect) == [
        "ALTER TABLE requests ADD COLUMN estimated INT8 NOT NULL DEFAULT 0", *tail]


def test_estimated_rows_are_counted(tmp_path: Path) -> None:
    check_estimated_rows_are_counted(_url(tmp_path / "usage.db"))


def test_dirty_rows_are_written_clean(tmp_path: Path) -> None:
    check_dirty_rows_are_written_clean(_url(tmp_path / "usage.db"))


def test_a_model_the_gateway_does_not_serve_is_recorded_as_empty() -> None:
    """A request refused as ``model_not_found`` keeps the client's model string out of the
    ledger (``""``, as its metrics label), however long or odd; a routed request keeps
    its served name."""
    from tokenpace.gateway import parse_config
    from tokenpace.gateway.dispatch import Dispatcher
    from tokenpace.gateway.exchange import Exchange, Outcome, Runtime
    from tokenpace.gateway.tenants import Tenants

    config = parse_config({"engines": [{"url": "http://127.0.0.1:9", "models": ["m"]}],
                           "tenants": [{"id": "acme", "api_keys": ["k"]}]})
    clock = lambda: 0.0  # noqa: E731
    recorded: list[UsageRecord] = []

    class Recorder:  # the ledger as Exchange.finish uses it
        def record(self, rec: UsageRecord) -> None:
            recorded.append(rec)

    rt = Runtime(config, Tenants(config, clock), Dispatcher(config, clock), {},
                 Recorder(), clock=clock)  # type: ignore[arg-type]
    refused = Exchange(rt, "tpg-1", "completion", rt.tenants.get("acme"), 0.0, T0)
    refused.model = "gpt-\x00\ud800" + "x" * EIGHT_MIB  # as the client sent it
    refused.finish(Outcome.REJECTED, "model_not_found")
    routed = Exchange(rt, "tpg-2", "completion", rt.tenants.get("acme"), 0.0, T0)
    routed.model, routed.routed = "m", True
    routed.finish(Outcome.REJECTED, "budget")
    assert [(r.model, r.finish_reason) for r in recorded] == [
        ("", "rejected:model_not_found"), ("m", "rejected:budget")]


def test_record_row_cleans_only_what_needs_it() -> None:
    """A clean record's row holds the record's own strings; a dirty one's row is small
    and encodes as strict JSON and UTF-8 (what a journal line needs); None and other
    non-strings become text."""
    clean = record(1, application="app ü")
    row = record_row(clean)
    assert all(row[i] is getattr(clean, RECORD_COLUMNS[i]) for i in (0, 1, 2, 3, 10, 14, 15))
    assert record_from_row(row) == clean
    for rec in dirty_records():
        row = record_row(rec)
        json.dumps(row, allow_nan=False).encode("utf-8")  # raises for NaN or a surrogate
        texts = [v for v in row if isinstance(v, str)]
        assert sum(map(len, texts)) <= 5 * MAX_ID_CHARS + 3 * MAX_NAME_CHARS
        assert not any("\x00" in t for t in texts)
    odd = UsageRecord("req-odd", None, None, 7,  # type: ignore[arg-type]
                      1, 1, 1.0, None, None, 1.0, "stop", T0, T0,
                      route=b"/v1")  # type: ignore[arg-type]
    assert record_row(odd)[1:4] == ("", "", "7")
    assert record_row(odd)[14] == "b'/v1'"


def test_rows_wait_in_memory_until_flush(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    ledger = open_ledger(_url(path), flush_interval_s=60, max_batch=1000)
    for i in range(5):
        ledger.record(record(i))
    assert _count(path) == 0  # the writer sleeps for a minute: nothing written yet
    ledger.flush()
    assert _count(path) == 5
    ledger.record(record(5))
    ledger.close()
    assert _count(path) == 6


def test_a_full_batch_wakes_the_writer_without_flush(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    ledger = open_ledger(_url(path), flush_interval_s=60, max_batch=10)
    try:
        for i in range(25):
            ledger.record(record(i))
        deadline = time.monotonic() + 30
        while _count(path) < 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _count(path) >= 20  # two full batches went out although no flush was due
    finally:
        ledger.close()
    assert _count(path) == 25


def test_many_records_all_arrive_after_close(tmp_path: Path) -> None:
    url = _url(tmp_path / "usage.db")
    ledger = open_ledger(url, flush_interval_s=0.01, max_batch=500)
    recs = [record(i) for i in range(10_000)]
    for rec in recs:
        ledger.record(rec)
    ledger.close()
    assert ledger.dropped == 0

    reader = open_ledger(url)
    try:
        assert reader.rows() == recs
    finally:
        reader.close()


def test_record_from_many_threads(tmp_path: Path) -> None:
    url = _url(tmp_path / "usage.db")
    ledger = open_ledger(url, flush_interval_s=0.01, max_batch=50)

    def produce(offset: int) -> None:
        for i in range(offset, offset + 1000):
            ledger.record(record(i))

    threads = [threading.Thread(target=produce, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledger.close()

    reader = open_ledger(url)
    try:
        assert [r.request_id for r in reader.rows()] == [f"req-{i}" for i in range(4000)]
    finally:
        reader.close()


def test_schema_wal_and_indexes(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    open_ledger(_url(path)).close()
    open_ledger(_url(path)).close()  # creating the schema again is a no-op
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        names = {n for (n,) in conn.execute("SELECT name FROM sqlite_master")}
        columns = [c[1] for c in conn.execute("PRAGMA table_info(budgets)")]
        pk = [c[1] for c in conn.execute("PRAGMA table_info(budgets)") if c[5]]
    assert {"requests", "budgets", "requests_ended_at", "requests_tenant"} <= names
    assert columns == ["tenant", "budget", "level", "at"]
    assert pk == ["tenant", "budget"]


def test_relative_sqlite_url_is_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ledger = open_ledger("sqlite:///sub.db")
    ledger.record(record(0))
    ledger.close()
    assert _count(tmp_path / "sub.db") == 1


@pytest.mark.parametrize(
    "url",
    [
        "",
        "usage.db",
        "/tmp/usage.db",
        "sqlite://usage.db",
        "sqlite:///",
        "sqlite:///usage.db?mode=ro",
        "mysql://user@host/db",
        "file:///tmp/usage.db",
    ],
)
def test_bad_urls_name_the_accepted_forms(url: str) -> None:
    with pytest.raises(LedgerError, match="sqlite:///relative/path.db.*postgresql://"):
        open_ledger(url)


def test_password_is_not_echoed_in_errors() -> None:
    with pytest.raises(LedgerError) as info:
        open_ledger("mysql://user:hunter2@host/db")
    assert "hunter2" not in str(info.value)


def test_unopenable_sqlite_paths_raise_ledger_error(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="cannot open"):
        open_ledger(_url(tmp_path / "missing-dir" / "usage.db"))
    with pytest.raises(LedgerError, match="cannot"):
        open_ledger(_url(tmp_path))  # a directory
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database, just some bytes" * 100)
    with pytest.raises(LedgerError, match="cannot"):
        open_ledger(_url(junk))


def test_create_false_refuses_a_missing_file_and_does_not_create_it(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    with pytest.raises(LedgerError, match="does not exist"):
        open_ledger(_url(path), create=False)
    assert not path.exists()


def test_locked_database_loses_no_rows(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    ledger = open_ledger(_url(path), flush_interval_s=60)
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        for i in range(3):
            ledger.record(record(i))
        ledger.save_budgets([BudgetState("acme", "20000/10s", 42.0, T0)])
        with pytest.raises(LedgerError, match="locked"):
            ledger.flush()
        assert blocker.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 0
        blocker.execute("ROLLBACK")

        ledger.flush()
        assert ledger.rows() == [record(0), record(1), record(2)]
        assert ledger.load_budgets() == [BudgetState("acme", "20000/10s", 42.0, T0)]
    finally:
        blocker.close()
        ledger.close()


def test_background_writer_retries_after_a_lock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "usage.db"
    ledger = open_ledger(_url(path), flush_interval_s=0.05)
    blocker = sqlite3.connect(path, isolation_level=None)
    caplog.set_level(logging.ERROR, logger="tokenpace.gateway.ledger")
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        for i in range(50):
            ledger.record(record(i))
        deadline = time.monotonic() + 30
        while "will retry" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "will retry" in caplog.text  # the writer met the lock at least once
        blocker.execute("ROLLBACK")
        for i in range(50, 60):
            ledger.record(record(i))
    finally:
        blocker.close()
        ledger.close()
    assert ledger.dropped == 0
    reader = open_ledger(_url(path))
    try:
        assert reader.rows() == [record(i) for i in range(60)]  # each exactly once
    finally:
        reader.close()


def test_a_full_journal_drops_and_counts(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    ledger = open_ledger(_url(path), journal=str(tmp_path / "journal"), journal_bytes=4000,
                         flush_interval_s=60, max_batch=1000)
    for i in range(30):  # unserved rows: no reserve past the bound
        ledger.record(replace(record(i), served=False))
    assert 0 < ledger.dropped < 30
    ledger.close()
    assert _count(path) == 30 - ledger.dropped


def test_close_is_idempotent_and_later_records_count_as_dropped(tmp_path: Path) -> None:
    ledger = open_ledger(_url(tmp_path / "usage.db"))
    ledger.record(record(0))
    ledger.close()
    ledger.close()
    ledger.record(record(1))
    ledger.save_budgets([BudgetState("acme", "20000/10s", 1.0, T0)])  # ignored
    ledger.flush()  # nothing to do
    assert ledger.dropped == 1
    with pytest.raises(LedgerError, match="closed"):
        ledger.rows()


def test_bad_settings_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        open_ledger(_url(tmp_path / "a.db"), flush_interval_s=0)
    with pytest.raises(ValueError):
        open_ledger(_url(tmp_path / "b.db"), max_batch=0)
