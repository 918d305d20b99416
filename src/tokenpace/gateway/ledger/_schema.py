"""The ledger's tables, for SQLite and Postgres alike, and the one column order of a row.

Both databases get the same DDL, migrations and statements; only column type names,
placeholders and the two migration statements that need dialect features differ, and each
backend passes those in. So the two ledgers cannot drift apart, and a row is laid out (for
writing) and read back (for queries) in one place.
"""

from __future__ import annotations

from typing import Any

from ._records import UsageRecord

RECORD_COLUMNS = (
    "request_id",
    "tenant",
    "model",
    "lane",
    "prompt_tokens",
    "completion_tokens",
    "cost",
    "queue_ms",
    "ttft_ms",
    "e2e_ms",
    "finish_reason",
    "started_at",
    "ended_at",
    "served",
    "route",
    "application",
    "cached_prompt_tokens",
    "batch_id",
)


def schema(text: str, integer: str, real: str) -> list[str]:
    """DDL for both databases; only the column type names differ."""
    return [
        f"""CREATE TABLE IF NOT EXISTS requests (
            request_id {text} NOT NULL,
            tenant {text} NOT NULL,
            model {text} NOT NULL,
            lane {text} NOT NULL,
            prompt_tokens {integer} NOT NULL,
            completion_tokens {integer} NOT NULL,
            cost {real} NOT NULL,
            queue_ms {real},
            ttft_ms {real},
            e2e_ms {real} NOT NULL,
            finish_reason {text} NOT NULL,
            started_at {real} NOT NULL,
            ended_at {real} NOT NULL,
            served {integer} NOT NULL DEFAULT 1,
            route {text} NOT NULL DEFAULT '',
            application {text} NOT NULL DEFAULT '',
            cached_prompt_tokens {integer} NOT NULL DEFAULT 0,
            batch_id {text} NOT NULL DEFAULT ''
        )""",
        "CREATE INDEX IF NOT EXISTS requests_ended_at ON requests (ended_at)",
        "CREATE INDEX IF NOT EXISTS requests_tenant ON requests (tenant)",
        f"""CREATE TABLE IF NOT EXISTS budgets (
            tenant {text} NOT NULL,
            budget {text} NOT NULL,
            level {real} NOT NULL,
            at {real} NOT NULL,
            PRIMARY KEY (tenant, budget)
        )""",
    ]


_UNIQUE_ID_INDEX = "CREATE UNIQUE INDEX IF NOT EXISTS requests_request_id ON requests (request_id)"
# Rows of ledgers written before ``served`` existed: a refusal, or a row that was charged
# nothing at all, was not served (the best the old columns can tell).
_BACKFILL_SERVED = (
    "UPDATE requests SET served = 0 WHERE substr(finish_reason, 1, 9) = 'rejected:' "
    "OR (cost = 0 AND completion_tokens = 0)"
)


_ADD_ROUTE = "ALTER TABLE requests ADD COLUMN route TEXT NOT NULL DEFAULT ''"
"""Rows written before the route was kept have ``''`` (they were chat or completions)."""

_ADD_APPLICATION = "ALTER TABLE requests ADD COLUMN application TEXT NOT NULL DEFAULT ''"
"""Rows written before applications existed have ``''``: they all came with a tenant's own
key (or were refused before authentication), which is what ``''`` means in new rows too."""


def _add_cached(integer: str) -> str:
    """Rows written before cached prompt tokens were kept have 0: their prompts were
    charged in full, which is what 0 cached tokens means in new rows too."""
    return f"ALTER TABLE requests ADD COLUMN cached_prompt_tokens {integer} NOT NULL DEFAULT 0"


_ADD_BATCH = "ALTER TABLE requests ADD COLUMN batch_id TEXT NOT NULL DEFAULT ''"
"""Rows written before the Batch API existed have ``''``: they were all live requests,
which is what ``''`` means in new rows too."""


def migrations(has_served: bool, dedupe: str, add_served: str,
               has_route: bool = True, has_application: bool = True,
               has_cached: bool = True, integer: str = "INTEGER",
               has_batch: bool = True) -> list[str]:
    """Statements that bring a ledger of an older version up to this schema.

    ``requests.request_id`` became unique, so that a batch written again after its commit
    was lost in transit (the connection dropped before the acknowledgement) adds nothing;
    older ledgers may already hold such duplicates, which are removed first.
    """
    out = [] if has_served else [add_served, _BACKFILL_SERVED]
    if not has_route:
        out.append(_ADD_ROUTE)
    if not has_application:
        out.append(_ADD_APPLICATION)
    if not has_cached:
        out.append(_add_cached(integer))
    if not has_batch:
        out.append(_ADD_BATCH)
    return out + [dedupe, _UNIQUE_ID_INDEX]


def insert_sql(placeholder: str) -> str:
    """Idempotent on the request id: writing a row again is a no-op."""
    marks = ", ".join([placeholder] * len(RECORD_COLUMNS))
    return (f"INSERT INTO requests ({', '.join(RECORD_COLUMNS)}) VALUES ({marks}) "
            "ON CONFLICT (request_id) DO NOTHING")


def upsert_sql(placeholder: str) -> str:
    """One row per (tenant, budget): only the latest level is kept."""
    p = placeholder
    return (
        f"INSERT INTO budgets (tenant, budget, level, at) VALUES ({p}, {p}, {p}, {p}) "
        "ON CONFLICT (tenant, budget) DO UPDATE SET level = excluded.level, at = excluded.at"
    )


def record_row(rec: UsageRecord) -> tuple[Any, ...]:
    """``rec`` as a ``requests`` row in :data:`RECORD_COLUMNS` order, in the types the
    columns hold whatever numeric types the caller passed (``served`` as 0/1: Postgres
    does not cast a boolean to BIGINT)."""
    return (
        rec.request_id,
        rec.tenant,
        rec.model,
        rec.lane,
        int(rec.prompt_tokens),
        int(rec.completion_tokens),
        float(rec.cost),
        None if rec.queue_ms is None else float(rec.queue_ms),
        None if rec.ttft_ms is None else float(rec.ttft_ms),
        float(rec.e2e_ms),
        rec.finish_reason,
        float(rec.started_at),
        float(rec.ended_at),
        int(bool(rec.served)),
        rec.route,
        rec.application,
        int(rec.cached_prompt_tokens),
        rec.batch_id,
    )


def record_from_row(r: tuple[Any, ...]) -> UsageRecord:
    """The inverse of :func:`record_row`, for a row selected in :data:`RECORD_COLUMNS`
    order (``served`` comes back as 0/1)."""
    return UsageRecord(
        request_id=r[0],
        tenant=r[1],
        model=r[2],
        lane=r[3],
        prompt_tokens=int(r[4]),
        completion_tokens=int(r[5]),
        cost=float(r[6]),
        queue_ms=None if r[7] is None else float(r[7]),
        ttft_ms=None if r[8] is None else float(r[8]),
        e2e_ms=float(r[9]),
        finish_reason=r[10],
        started_at=float(r[11]),
        ended_at=float(r[12]),
        served=bool(r[13]),
        route=r[14],
        application=r[15],
        cached_prompt_tokens=int(r[16]),
        batch_id=r[17],
    )
