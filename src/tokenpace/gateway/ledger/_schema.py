"""The ledger's tables, for SQLite and Postgres alike, the one column order of a row, and
the cleaning that makes every row writable.

Both databases get the same DDL, migrations and statements; only column type names and
the one statement that needs dialect features differ, and each backend passes those in as
a :class:`Dialect`. So the two ledgers cannot drift apart, and a row is laid out (for
writing) and read back (for queries) in one place.

A row is made by :func:`record_row`, which also makes it one both databases (and a JSON
journal) accept, whatever its strings and numbers hold, and bounds its size: NUL
characters are removed (Postgres text cannot hold them), lone surrogates replaced by
U+FFFD (neither driver can encode them), text capped at :data:`MAX_ID_CHARS` or
:data:`MAX_NAME_CHARS` characters, NaN and infinities made 0 (or NULL where the column
allows it) and integers kept within 64 bits.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Collection
from dataclasses import dataclass
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
    "estimated",
)

MAX_ID_CHARS = 128
"""Longest identifier a row keeps, in characters: ``request_id``, ``tenant``, ``lane``,
``application``, ``batch_id``. Request and batch ids are under 64, configured ids usually
far shorter. A longer one (an operator's tenant id, say) is cut to ``MAX_ID_CHARS - 17``
characters followed by ``~`` and 16 hex digits of its BLAKE2b digest, so that two ids stay
two ids (and a request id stays a unique key) once cut; an id changed by the cleaning (a
NUL, a lone surrogate) gets the same suffix for the same reason."""

MAX_NAME_CHARS = 256
"""Longest name or reason a row keeps, in characters: ``model``, ``finish_reason``,
``route``. Served model names (Hugging Face paths included), the gateway's refusal
reasons and its routes fit many times over; a longer one (an engine's odd finish reason)
is cut."""

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
"""The range of Postgres' BIGINT and of SQLite's INTEGER."""

_SURROGATE = re.compile("[\ud800-\udfff]")
_DIGEST_CHARS = 16


@dataclass(frozen=True)
class Dialect:
    """What differs between the databases in the DDL and the migrations."""

    text: str
    """The type name of text columns (``TEXT`` in both)."""
    integer: str
    """The type name of 64-bit integer columns (SQLite ``INTEGER``, Postgres ``BIGINT``)."""
    real: str
    """The type name of float columns (SQLite ``REAL``, Postgres ``DOUBLE PRECISION``)."""
    dedupe: str
    """A statement that deletes every ``requests`` row whose request id an earlier row
    already has (each database names a row's physical position differently)."""


def schema(d: Dialect) -> list[str]:
    """DDL for both databases; only the column type names differ. Idempotent."""
    return [
        f"""CREATE TABLE IF NOT EXISTS requests (
            request_id {d.text} NOT NULL,
            tenant {d.text} NOT NULL,
            model {d.text} NOT NULL,
            lane {d.text} NOT NULL,
            prompt_tokens {d.integer} NOT NULL,
            completion_tokens {d.integer} NOT NULL,
            cost {d.real} NOT NULL,
            queue_ms {d.real},
            ttft_ms {d.real},
            e2e_ms {d.real} NOT NULL,
            finish_reason {d.text} NOT NULL,
            started_at {d.real} NOT NULL,
            ended_at {d.real} NOT NULL,
            served {d.integer} NOT NULL DEFAULT 1,
            route {d.text} NOT NULL DEFAULT '',
            application {d.text} NOT NULL DEFAULT '',
            cached_prompt_tokens {d.integer} NOT NULL DEFAULT 0,
            batch_id {d.text} NOT NULL DEFAULT '',
            estimated {d.integer} NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX IF NOT EXISTS requests_ended_at ON requests (ended_at)",
        "CREATE INDEX IF NOT EXISTS requests_tenant ON requests (tenant)",
        f"""CREATE TABLE IF NOT EXISTS budgets (
            tenant {d.text} NOT NULL,
            budget {d.text} NOT NULL,
            level {d.real} NOT NULL,
            at {d.real} NOT NULL,
            PRIMARY KEY (tenant, budget)
        )""",
    ]


@dataclass(frozen=True)
class _Added:
    """A column added to ``requests`` after its first version: its definition (``{text}``
    and ``{integer}`` stand for the dialect's type names) and the statements that fill it
    for the rows written before it existed, if its default does not say the truth."""

    column: str
    definition: str
    backfill: tuple[str, ...] = ()


_ADDED_COLUMNS = (
    # A refusal, or a row that was charged nothing at all, was not served (the best the
    # old columns can tell).
    _Added("served", "{integer} NOT NULL DEFAULT 1", (
        "UPDATE requests SET served = 0 WHERE substr(finish_reason, 1, 9) = 'rejected:' "
        "OR (cost = 0 AND completion_tokens = 0)",)),
    # '': they were chat or completions.
    _Added("route", "{text} NOT NULL DEFAULT ''"),
    # '': they all came with a tenant's own key (or were refused before authentication),
    # which is what '' means in new rows too.
    _Added("application", "{text} NOT NULL DEFAULT ''"),
    # 0: their prompts were charged in full, which is what 0 means in new rows too.
    _Added("cached_prompt_tokens", "{integer} NOT NULL DEFAULT 0"),
    # '': they were all live requests, which is what '' means in new rows too.
    _Added("batch_id", "{text} NOT NULL DEFAULT ''"),
    # 0: nothing marked a count as the gateway's estimate then; their counts are what
    # the gateway had seen, the engine's where it reported them.
    _Added("estimated", "{integer} NOT NULL DEFAULT 0"),
)
"""Every column added since the first version, in the order they came; each comment says
what the rows written before it hold there, and why that is the truth."""

_UNIQUE_ID_INDEX = "CREATE UNIQUE INDEX IF NOT EXISTS requests_request_id ON requests (request_id)"


def migrations(columns: Collection[str], dialect: Dialect, unique_ids: bool = False) -> list[str]:
    """Statements that bring a ``requests`` table whose columns are ``columns`` (the
    names it has now, after :func:`schema` ran) up to this schema: each missing column is
    added, with its backfill.

    ``requests.request_id`` became unique, so that a batch written again after its commit
    was lost in transit (the connection dropped before the acknowledgement) adds nothing;
    older ledgers may already hold such duplicates, which are removed first: only while
    the unique index is missing (``unique_ids`` false), since the removal reads the whole
    table.
    """
    out: list[str] = []
    for added in _ADDED_COLUMNS:
        if added.column not in columns:
            definition = added.definition.format(text=dialect.text, integer=dialect.integer)
            out.append(f"ALTER TABLE requests ADD COLUMN {added.column} {definition}")
            out.extend(added.backfill)
    return out if unique_ids else out + [dialect.dedupe, _UNIQUE_ID_INDEX]


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


def clean_text(value: object, limit: int) -> str:
    """``value`` as text any database accepts, at most ``limit`` characters: cut to
    ``limit``, NUL characters removed, lone surrogates replaced by U+FFFD; ``None`` is
    ``""``, any other non-string its ``str()``.

    Returns ``value`` itself when it needs nothing. Cost: a length compare, a ``memchr``
    for NUL and an O(1) ASCII flag test for a clean string; a non-ASCII one adds a UTF-8
    encode; anything longer is cut first, so the work is bounded by ``limit`` whatever the
    input's length."""
    s = value if type(value) is str else ("" if value is None else str(value))
    if len(s) > limit:
        s = s[:limit]
    if "\x00" in s:
        s = s.replace("\x00", "")
    if not s.isascii() and _has_surrogate(s):
        s = _SURROGATE.sub("\ufffd", s)
    return s


def _has_surrogate(s: str) -> bool:
    """Whether ``s`` holds a lone surrogate (a code point in U+D800..U+DFFF, which UTF-8
    cannot encode). Cost: one UTF-8 encode at C speed, a fifth of a regex scan's."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _ident(value: object) -> str:
    """An id column (see :data:`MAX_ID_CHARS`): clean, and when the cleaning changed it,
    cut shorter and suffixed with ``~`` and a digest of the whole, so distinct ids stay
    distinct. Cost: :func:`clean_text`'s for a clean id; the digest (linear in the id's
    length) only for an id that needed cleaning."""
    s = value if type(value) is str else ("" if value is None else str(value))
    clean = clean_text(s, MAX_ID_CHARS)
    if clean is s:
        return s
    digest = hashlib.blake2b(s.encode("utf-8", "surrogatepass"),
                             digest_size=_DIGEST_CHARS // 2).hexdigest()
    return clean[:MAX_ID_CHARS - _DIGEST_CHARS - 1] + "~" + digest


def _count(value: object) -> int:
    """An integer column: an int within 64 bits (nearer bound beyond it); NaN, infinities
    and anything ``int()`` refuses are 0. Cost: a type check and two compares."""
    if type(value) is int and _INT64_MIN <= value <= _INT64_MAX:
        return value
    try:
        n = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return 0
    return max(_INT64_MIN, min(n, _INT64_MAX))


def _real(value: object) -> float:
    """A NOT NULL float column: NaN, infinities and anything ``float()`` refuses are 0."""
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return x if math.isfinite(x) else 0.0


def _real_or_null(value: object) -> float | None:
    """A nullable float column: NaN, infinities and anything ``float()`` refuses are
    NULL (unknown), as is ``None``."""
    if value is None:
        return None
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None


def record_row(rec: UsageRecord) -> tuple[Any, ...]:
    """``rec`` as a ``requests`` row in :data:`RECORD_COLUMNS` order, one every database
    accepts whatever the record holds, in the types the columns hold whatever numeric
    types the caller passed (``served`` and ``estimated`` as 0/1: Postgres does not cast
    a boolean to BIGINT).

    Text is cleaned by :func:`clean_text` (ids with :func:`_ident`), floats made finite
    (``queue_ms`` and ``ttft_ms`` NULL instead), integers kept within 64 bits; so a row is
    at most a few kilobytes whatever the record's size.

    Cost: a clean record (the gateway's every row) is checked as a whole: one join of its
    text fields, a length compare (each field's only when the join is over
    :data:`MAX_ID_CHARS`), a ``memchr`` for NUL and an O(1) ASCII test (a UTF-8 encode of
    the join when not ASCII), one ``isfinite`` of the floats' sum and a range compare per
    integer: well under a microsecond over building the tuple. Only a record that fails
    the check is cleaned field by field (:func:`_cleaned_row`), in work linear in the caps
    (an id's digest: in its length); the join is linear in the record's size.
    """
    try:
        ids = (rec.request_id, rec.tenant, rec.lane, rec.application, rec.batch_id)
        names = (rec.model, rec.finish_reason, rec.route)
        text = "".join(ids + names)  # TypeError for a non-string
        queue_ms, ttft_ms = rec.queue_ms, rec.ttft_ms
        row = (
            ids[0],
            ids[1],
            names[0],
            ids[2],
            int(rec.prompt_tokens),
            int(rec.completion_tokens),
            float(rec.cost),
            None if queue_ms is None else float(queue_ms),
            None if ttft_ms is None else float(ttft_ms),
            float(rec.e2e_ms),
            names[1],
            float(rec.started_at),
            float(rec.ended_at),
            int(bool(rec.served)),
            names[2],
            ids[3],
            int(rec.cached_prompt_tokens),
            ids[4],
            int(bool(rec.estimated)),
        )
        if ((len(text) <= MAX_ID_CHARS  # then every field is within its cap
             or (max(map(len, ids)) <= MAX_ID_CHARS
                 and max(map(len, names)) <= MAX_NAME_CHARS))
                and "\x00" not in text
                and (text.isascii() or not _has_surrogate(text))
                # NaN and infinities survive a sum (a sum that overflows only costs the
                # slow path).
                and math.isfinite(row[6] + row[9] + row[11] + row[12]
                                  + (row[7] or 0.0) + (row[8] or 0.0))
                and _INT64_MIN <= row[4] <= _INT64_MAX
                and _INT64_MIN <= row[5] <= _INT64_MAX
                and _INT64_MIN <= row[16] <= _INT64_MAX):
            return row
    except (TypeError, ValueError, OverflowError):
        pass  # int(NaN), float(10**400), a None or other non-string as text
    return _cleaned_row(rec)


def _cleaned_row(rec: UsageRecord) -> tuple[Any, ...]:
    """:func:`record_row` for a record that needs cleaning, field by field."""
    return (
        _ident(rec.request_id),
        _ident(rec.tenant),
        clean_text(rec.model, MAX_NAME_CHARS),
        _ident(rec.lane),
        _count(rec.prompt_tokens),
        _count(rec.completion_tokens),
        _real(rec.cost),
        _real_or_null(rec.queue_ms),
        _real_or_null(rec.ttft_ms),
        _real(rec.e2e_ms),
        clean_text(rec.finish_reason, MAX_NAME_CHARS),
        _real(rec.started_at),
        _real(rec.ended_at),
        int(bool(rec.served)),
        clean_text(rec.route, MAX_NAME_CHARS),
        _ident(rec.application),
        _count(rec.cached_prompt_tokens),
        _ident(rec.batch_id),
        int(bool(rec.estimated)),
    )


def record_from_row(r: tuple[Any, ...]) -> UsageRecord:
    """The inverse of :func:`record_row`, for a row selected in :data:`RECORD_COLUMNS`
    order (``served`` and ``estimated`` come back as 0/1)."""
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
        estimated=bool(r[18]),
    )
