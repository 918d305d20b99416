"""The ledger's reads: saved budget levels at start-up, rows (since a time, or by request
id), and the totals of ``tokenpace usage``.

Each takes the ledger's locked ``query`` function and the driver's placeholder rather than
a connection, so that every read goes through the one lock the writer thread also takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ._records import BudgetState, UsageRecord, UsageTotal
from ._schema import RECORD_COLUMNS, record_from_row

Query = Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]]
"""Runs one SELECT with its parameters and returns every row."""

_GROUP_COLUMNS = ("tenant", "model", "lane", "route", "application")


def load_budgets(query: Query) -> list[BudgetState]:
    """The budget levels saved by the last run."""
    saved = query("SELECT tenant, budget, level, at FROM budgets ORDER BY tenant, budget", ())
    return [BudgetState(str(t), str(b), float(lv), float(at)) for t, b, lv, at in saved]


def rows(query: Query, placeholder: str, since: float | None) -> list[UsageRecord]:
    """Rows that ended at or after ``since`` (unix seconds), oldest first."""
    where, params = _since(placeholder, since)
    selected = query(
        f"SELECT {', '.join(RECORD_COLUMNS)} FROM requests{where} "
        "ORDER BY ended_at, started_at, request_id",
        params,
    )
    return [record_from_row(r) for r in selected]


ROWS_PER_READ = 500
"""Request ids per ``SELECT`` of :func:`rows_of`: under SQLite's oldest limit on a
statement's parameters (999), a statement of some 20 KB."""


def rows_of(query: Query, placeholder: str, request_ids: Iterable[str]) -> dict[str, UsageRecord]:
    """The rows of ``request_ids`` (those the ledger has), by request id. One ``SELECT``
    per ``ROWS_PER_READ`` ids, each an index lookup per id (the request id is unique)."""
    ids = list(dict.fromkeys(request_ids))
    found: dict[str, UsageRecord] = {}
    for at in range(0, len(ids), ROWS_PER_READ):
        chunk = tuple(ids[at:at + ROWS_PER_READ])
        marks = ", ".join([placeholder] * len(chunk))
        for row in query(f"SELECT {', '.join(RECORD_COLUMNS)} FROM requests "
                         f"WHERE request_id IN ({marks})", chunk):
            rec = record_from_row(row)
            found[rec.request_id] = rec
    return found


def usage(query: Query, placeholder: str, since: float | None, by: str) -> list[UsageTotal]:
    """Totals per tenant, model, lane, route or application (``by``) for rows that ended at
    or after ``since``, ordered by key.

    By application the rows are grouped by (tenant, application) and ordered by tenant
    first: the same application id in two tenants names two applications, and each
    tenant's own keys (application ``""``) get a total of their own. The tenant comes back
    in :attr:`UsageTotal.tenant`, the application id in ``key``.
    """
    if by not in _GROUP_COLUMNS:
        raise ValueError(f"by must be one of {', '.join(_GROUP_COLUMNS)}, got {by!r}")
    group = "tenant, application" if by == "application" else by
    where, params = _since(placeholder, since)
    # substr rather than LIKE 'rejected:%': a literal % would need escaping for psycopg.
    selected = query(
        f"SELECT {group}, COUNT(*), SUM(CASE WHEN served = 1 THEN prompt_tokens ELSE 0 END), "
        "SUM(completion_tokens), SUM(cost), "
        "SUM(CASE WHEN substr(finish_reason, 1, 9) = 'rejected:' THEN 1 ELSE 0 END), "
        "SUM(CASE WHEN served = 1 THEN 0 ELSE prompt_tokens END), "
        "SUM(CASE WHEN served = 1 THEN cached_prompt_tokens ELSE 0 END), "
        "SUM(CASE WHEN estimated = 1 THEN 1 ELSE 0 END) "
        f"FROM requests{where} GROUP BY {group} ORDER BY {group}",
        params,
    )
    totals: list[UsageTotal] = []
    for row in selected:
        # The group's key is the last column before the sums (after the tenant, by
        # application). Postgres returns SUM over BIGINT as numeric (Decimal): normalise.
        k, n, p, c, cost, rej, unserved, cached, estimated = row[-9:]
        totals.append(UsageTotal(
            str(k), int(n), int(p or 0), int(c or 0), float(cost or 0.0), int(rej or 0),
            int(unserved or 0), tenant=str(row[0]) if by == "application" else None,
            cached_prompt_tokens=int(cached or 0), estimated_rows=int(estimated or 0)))
    return totals


def _since(placeholder: str, since: float | None) -> tuple[str, tuple[Any, ...]]:
    if since is None:
        return "", ()
    return f" WHERE ended_at >= {placeholder}", (float(since),)


BUCKET_GROUPS = {"project_id": "tenant", "model": "model"}
"""The usage API's ``group_by`` fields and the ledger column each groups by (a tenant is
OpenAI's project)."""


def usage_buckets(query: Query, placeholder: str, start: float, end: float, width: float,
                  group_by: tuple[str, ...] = (), tenants: tuple[str, ...] = (),
                  models: tuple[str, ...] = ()) -> list[tuple[Any, ...]]:
    """Totals per time bucket (and per ``group_by`` field) of the rows that ended in
    ``[start, end)``; bucket ``i`` is ``[start + i * width, start + (i + 1) * width)``.

    Rows ``(bucket index, *group values, requests, rejected, prompt_tokens,
    cached_prompt_tokens, completion_tokens)`` with the same sums as :func:`usage`, so
    a window's buckets add up to ``tokenpace usage`` over it. ``tenants`` and ``models``
    keep only those (empty: all). One ``SELECT``: an index range on ``ended_at``, grouped
    in the database; at most buckets x groups rows come back.
    """
    columns = [BUCKET_GROUPS[g] for g in group_by]
    offset = f"(ended_at - {placeholder}) / {placeholder}"
    # Postgres casts a float to an integer by rounding, SQLite by truncating (which is the
    # floor here: ended_at >= start).
    index = f"FLOOR({offset})" if placeholder == "%s" else f"CAST({offset} AS INTEGER)"
    where = f"ended_at >= {placeholder} AND ended_at < {placeholder}"
    params: list[Any] = [float(start), float(width), float(start), float(end)]
    for column, values in (("tenant", tenants), ("model", models)):
        if values:
            where += f" AND {column} IN ({', '.join([placeholder] * len(values))})"
            params += values
    group = ", ".join(["b", *columns])
    selected = query(
        f"SELECT {index} AS b, {''.join(c + ', ' for c in columns)}COUNT(*), "
        "SUM(CASE WHEN substr(finish_reason, 1, 9) = 'rejected:' THEN 1 ELSE 0 END), "
        "SUM(CASE WHEN served = 1 THEN prompt_tokens ELSE 0 END), "
        "SUM(CASE WHEN served = 1 THEN cached_prompt_tokens ELSE 0 END), "
        f"SUM(completion_tokens) FROM requests WHERE {where} GROUP BY {group} ORDER BY {group}",
        tuple(params),
    )
    n = len(columns)
    return [(int(r[0]), *(str(v) for v in r[1:1 + n]), *(int(v or 0) for v in r[1 + n:]))
            for r in selected]
