"""Where files, batches and their lines' results live: beside the ledger, durably.

SQLite (a file next to the ledger's, ``usage.db`` -> ``usage.batches.db``: input files
are payloads of up to ``batch.max_file_bytes``, which do not belong in the table the usage
queries scan) or the ledger's own Postgres database (three tables of their own). Nothing
of a batch is kept only in memory: a gateway killed at any point finds every batch, its
input and the result of every line that ended before the kill.

Exactly once per line: a line's result is one row keyed by (batch, line number), written
with ``ON CONFLICT DO NOTHING`` the moment the line ends. A line that was in flight when a
gateway died runs again after the restart (it has no row yet); if two runs of a line both
end (two replicas during a lease hand-over), the first row written stays and the second
changes nothing, so the output file holds each ``custom_id`` once. The output and error
files are written from these rows in the same transaction that moves the batch out of
``finalizing`` (or ``cancelling``): a crash in between leaves the batch to finalize again.

Every method is blocking (one short transaction); the gateway calls them in a worker
thread (``asyncio.to_thread``) so its event loop never waits on the disk. One connection,
behind a lock: the work is a few statements per line, far below what one connection does.

A file's content is kept in parts of ``PART_BYTES`` (``batch_file_parts``), so that
reading or uploading a file holds the lock for one part at a time: a tenant moving a large
file never keeps the other tenants' batches from the store for longer than one part's
read or write.
Rows written before parts existed keep their content in ``batch_files.content`` and are
read whole. The bounds on what a tenant stores (files, bytes, unfinished batches) are
checked in the transaction that writes, so concurrent requests cannot pass them together.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from ..ledger import (
    LedgerError,
    connect_postgres,
    import_psycopg,
    parse_ledger_url,
    usable,
    write_transaction,
)
from ._objects import (
    STAMPS,
    UNFINISHED,
    BatchRecord,
    FileRecord,
    LineResult,
    StoreLimit,
    Usage,
    check_move,
)

_SQLITE_BUSY_TIMEOUT_S = 30.0

_PG_STATEMENT_TIMEOUT_MS = 60_000
"""Server-side bound on one statement, one lock wait and an idle transaction: well above
the largest write (an output file's parts), far below a hang."""

PART_BYTES = 1024 * 1024
"""Bytes of a file's content per stored part: what one locked read copies."""

RESULTS_PAGE = 1000
"""Results read at a time when a batch's files are written from them."""

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS batch_files (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL,
        filename TEXT NOT NULL, bytes {integer} NOT NULL, created_at {integer} NOT NULL,
        content {blob} NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS batch_files_tenant ON batch_files (tenant, created_at)",
    """CREATE TABLE IF NOT EXISTS batch_file_parts (
        file_id TEXT NOT NULL, part {integer} NOT NULL, data {blob} NOT NULL,
        PRIMARY KEY (file_id, part))""",
    """CREATE TABLE IF NOT EXISTS batches (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, application TEXT NOT NULL,
        endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
        completion_window TEXT NOT NULL, status TEXT NOT NULL,
        created_at {integer} NOT NULL, expires_at {integer} NOT NULL,
        total {integer} NOT NULL DEFAULT 0, metadata TEXT, errors TEXT,
        output_file_id TEXT, error_file_id TEXT, stamps TEXT NOT NULL DEFAULT '{{}}',
        model TEXT, seq {serial})""",
    "CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, created_at)",
    "CREATE INDEX IF NOT EXISTS batches_status ON batches (status)",
    """CREATE TABLE IF NOT EXISTS batch_results (
        batch_id TEXT NOT NULL, line {integer} NOT NULL, custom_id TEXT NOT NULL,
        ok {integer} NOT NULL, text TEXT NOT NULL,
        prompt_tokens {integer} NOT NULL DEFAULT 0,
        cached_tokens {integer} NOT NULL DEFAULT 0,
        completion_tokens {integer} NOT NULL DEFAULT 0,
        PRIMARY KEY (batch_id, line))""",
)

_BATCH_COLUMNS = ("id, tenant, application, endpoint, input_file_id, completion_window, "
                  "status, created_at, expires_at, total, metadata, errors, output_file_id, "
                  "error_file_id, stamps, model")
_FILE_COLUMNS = "id, tenant, purpose, filename, bytes, created_at"


def batch_store_url(ledger_url: str) -> str:
    """Where a gateway whose ledger is ``ledger_url`` keeps its batches: a SQLite file
    beside the ledger's (``x.db`` -> ``x.batches.db``), or the ledger's Postgres."""
    kind, where = parse_ledger_url(ledger_url)
    if kind == "postgres" or where == ":memory:":
        return ledger_url
    path = Path(where)
    return "sqlite:///" + str(path.with_name(path.stem + ".batches" + (path.suffix or ".db")))


def new_id(prefix: str) -> str:
    """``file-...`` / ``batch_...``: 96 random bits, as unguessable as OpenAI's."""
    return prefix + os.urandom(12).hex()


class BatchStore:
    """The files, batches and results of every tenant (each read names its tenant: an id
    of another tenant's object is not found)."""

    def __init__(self, url: str) -> None:
        kind, where = parse_ledger_url(url)
        self.url = url
        self._lock = threading.Lock()
        if kind == "sqlite":
            import sqlite3

            self._errors: tuple[type[BaseException], ...] = (sqlite3.Error,)
            if where != ":memory:":
                Path(where).parent.mkdir(parents=True, exist_ok=True)
            try:
                self._conn: Any = sqlite3.connect(where, timeout=_SQLITE_BUSY_TIMEOUT_S,
                                                  isolation_level=None,
                                                  check_same_thread=False)
                self._conn.execute("PRAGMA journal_mode=WAL")
                # NORMAL under WAL: a process crash loses nothing (a power loss may lose
                # the last results, which then run again: still once in the output).
                self._conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.Error as exc:
                raise LedgerError(f"cannot open the batch store {where}: {exc}") from exc
            self._mark, blob, serial = "?", "BLOB", "INTEGER"
        else:
            psycopg = import_psycopg("the batch store in Postgres")
            self._errors = (psycopg.Error,)
            self._psycopg, self._where = psycopg, where
            try:
                self._conn = self._connect()
            except psycopg.Error as exc:
                raise LedgerError(f"cannot open the batch store in Postgres: {exc}") from exc
            self._mark, blob, serial = "%s", "BYTEA", "BIGSERIAL"
        try:
            with self._transaction():
                for statement in _SCHEMA:
                    self._execute(statement.format(
                        integer="BIGINT" if self._mark == "%s" else "INTEGER", blob=blob,
                        serial=serial))
        except self._errors as exc:
            raise LedgerError(f"cannot create the batch tables: {exc}") from exc
        self._drop_orphan_parts()

    # -- plumbing ----------------------------------------------------------------------

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        if self._mark != "?":
            sql = sql.replace("?", self._mark)
        return self._conn.execute(sql, tuple(params))

    def _connect(self) -> Any:
        return connect_postgres(self._psycopg, self._where, _PG_STATEMENT_TIMEOUT_MS)

    def _ready(self) -> None:
        """Under the lock: a Postgres connection that broke is replaced before the next
        statement (``ledger.usable``). SQLite's file connection never needs it."""
        if self._mark != "?":
            self._conn = usable(self._conn, self._connect)

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            self._ready()
            return list(self._execute(sql, params).fetchall())

    def ping(self) -> None:
        """One trivial read: raises the store's error (``errors``) when it does not
        answer now (a Postgres outage; a SQLite file that cannot be read)."""
        self._rows("SELECT 1")

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        """The exceptions the database's driver raises (``sqlite3.Error``,
        ``psycopg.Error``)."""
        return self._errors

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One transaction, holding the connection's lock (SQLite: ``BEGIN IMMEDIATE``, the
        write lock taken at once, so two replicas on one file serialize here)."""
        with self._lock:
            self._ready()
            with write_transaction(self._conn, self._mark == "?"):
                yield

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()

    # -- files -------------------------------------------------------------------------

    def add_file(self, tenant: str, purpose: str, filename: str,
                 content: bytes | bytearray, file_id: str | None = None, *,
                 max_files: int | None = None, max_bytes: int | None = None) -> FileRecord:
        """Keep a file. With ``max_files`` / ``max_bytes``, raise ``StoreLimit`` instead
        when the tenant already keeps that many files, or when its files' bytes (outputs
        included) plus this one would pass ``max_bytes``: counted and the file's row written
        in one transaction (one per tenant at a time in Postgres), so concurrent uploads
        cannot pass a bound together.

        A file of several parts has its parts written first, each in a transaction of its
        own (the lock held for one part at a time, so other tenants' calls pass between),
        and its row last: until then no read sees it. Parts whose row was never written
        (refused, failed, or a gateway killed meanwhile) are deleted at once, or when a
        store next opens; if that removed a part of this file, ``LedgerError``."""
        record = FileRecord(file_id or new_id("file-"), tenant, purpose, filename,
                            len(content), int(time.time()))
        view = memoryview(content)
        parts = -(-len(view) // PART_BYTES)
        if parts <= 1:
            with self._transaction():
                self._check_room(tenant, max_files, max_bytes, len(view))
                self._insert_file(record, content)
            return record
        try:
            for part in range(parts):
                with self._transaction():
                    self._insert_part(record.id, part, view[part * PART_BYTES:
                                                            (part + 1) * PART_BYTES])
            with self._transaction():
                self._check_room(tenant, max_files, max_bytes, len(view))
                kept = self._execute("SELECT COUNT(*) FROM batch_file_parts WHERE "
                                     "file_id = ?", (record.id,)).fetchall()[0][0]
                if int(kept) != parts:
                    raise LedgerError(f"file {record.id}: parts removed while it was written "
                                      "(a store opening meanwhile); write it again")
                self._insert_row(record)
        except BaseException:
            with suppress(*self._errors):
                with self._transaction():
                    self._execute("DELETE FROM batch_file_parts WHERE file_id = ?",
                                  (record.id,))
            raise
        return record

    def _check_room(self, tenant: str, max_files: int | None, max_bytes: int | None,
                    size: int) -> None:
        """``add_file``'s bounds; inside its transaction."""
        if max_files is None and max_bytes is None:
            return
        self._serialize(tenant)
        files, stored = self._stored_locked(tenant)
        if max_files is not None and files >= max_files:
            raise StoreLimit("batch.max_files", max_files, files)
        if max_bytes is not None and stored + size > max_bytes:
            raise StoreLimit("batch.max_stored_bytes", max_bytes, stored)

    def _drop_orphan_parts(self) -> None:
        """Delete the parts of files whose row was never written (an upload cut short by a
        killed gateway). One pass over the parts' index; at open."""
        try:
            with self._transaction():
                self._execute("DELETE FROM batch_file_parts WHERE file_id IN (SELECT DISTINCT "
                              "p.file_id FROM batch_file_parts p WHERE NOT EXISTS (SELECT 1 "
                              "FROM batch_files f WHERE f.id = p.file_id))")
        except self._errors as exc:
            raise LedgerError(f"cannot clean the batch store: {exc}") from exc

    def _insert_part(self, file_id: str, part: int, data: bytes | memoryview) -> None:
        self._execute("INSERT INTO batch_file_parts (file_id, part, data) VALUES (?, ?, ?)",
                      (file_id, part, data))

    def _insert_row(self, record: FileRecord) -> None:
        self._execute(f"INSERT INTO batch_files ({_FILE_COLUMNS}, content) VALUES "
                      "(?, ?, ?, ?, ?, ?, ?)",
                      (record.id, record.tenant, record.purpose, record.filename,
                       record.bytes, record.created_at, b""))

    def _insert_file(self, record: FileRecord, content: bytes | bytearray) -> None:
        """The file's row (its content column empty) and its parts; inside a transaction."""
        self._insert_row(record)
        view = memoryview(content)
        for part, start in enumerate(range(0, len(view), PART_BYTES)):
            self._insert_part(record.id, part, view[start:start + PART_BYTES])

    def _serialize(self, tenant: str) -> None:
        """In Postgres, one writer per tenant until the transaction ends (SQLite's
        ``BEGIN IMMEDIATE`` already serializes every writer)."""
        if self._mark != "?":
            self._execute("SELECT pg_advisory_xact_lock(hashtext('tokenpace.batch'), "
                          "hashtext(?))", (tenant,))

    def _stored_locked(self, tenant: str) -> tuple[int, int]:
        row = self._execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM batch_files "
                            "WHERE tenant = ?", (tenant,)).fetchall()[0]
        return int(row[0]), int(row[1])

    def stored(self, tenant: str) -> tuple[int, int]:
        """How many files the tenant keeps, and their bytes (outputs included)."""
        with self._lock:
            return self._stored_locked(tenant)

    def file(self, tenant: str, file_id: str) -> FileRecord | None:
        rows = self._rows(f"SELECT {_FILE_COLUMNS} FROM batch_files WHERE id = ? AND "
                          "tenant = ?", (file_id, tenant))
        return FileRecord(*rows[0]) if rows else None

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        """The whole content (read part by part, the lock held for one part at a time)."""
        found = self.file_parts(tenant, file_id)
        return None if found is None else b"".join(found[1])

    def file_parts(self, tenant: str, file_id: str) -> tuple[FileRecord, Iterator[bytes]] | None:
        """The file and its content as an iterator of parts of at most ``PART_BYTES``:
        each ``next`` one short locked read. A file deleted while it is read raises
        ``LedgerError`` at the first part gone."""
        rows = self._rows(f"SELECT {_FILE_COLUMNS}, length(content) FROM batch_files "
                          "WHERE id = ? AND tenant = ?", (file_id, tenant))
        if not rows:
            return None
        record, inline = FileRecord(*rows[0][:6]), int(rows[0][6] or 0)
        return record, self._parts(record, inline)

    def _parts(self, record: FileRecord, inline: int) -> Iterator[bytes]:
        if inline:  # a row written before parts: its content whole, in its own column
            rows = self._rows("SELECT content FROM batch_files WHERE id = ?", (record.id,))
            if rows:
                yield bytes(rows[0][0])
                return
        for part in range(-(-record.bytes // PART_BYTES)):
            rows = self._rows("SELECT data FROM batch_file_parts WHERE file_id = ? AND "
                              "part = ?", (record.id, part))
            if not rows:
                raise LedgerError(f"file {record.id} was deleted while it was read")
            yield bytes(rows[0][0])

    def files(self, tenant: str, purpose: str | None, limit: int, after: str | None,
              ascending: bool) -> tuple[list[FileRecord], bool]:
        """A page of the tenant's files (newest first unless ``ascending``), and whether
        more follow."""
        return self._page("batch_files", _FILE_COLUMNS, FileRecord, tenant, limit, after,
                          ascending, ("purpose", purpose) if purpose else None)

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._transaction():
            cur = self._execute("DELETE FROM batch_files WHERE id = ? AND tenant = ?",
                                (file_id, tenant))
            if not cur.rowcount:
                return False
            self._execute("DELETE FROM batch_file_parts WHERE file_id = ?", (file_id,))
            return True

    def count_files(self, tenant: str) -> int:
        return int(self._rows("SELECT COUNT(*) FROM batch_files WHERE tenant = ?",
                              (tenant,))[0][0])

    def file_in_use(self, tenant: str, file_id: str) -> bool:
        """Whether an unfinished batch of ``tenant`` reads ``file_id``."""
        marks = ", ".join("?" * len(UNFINISHED))
        return bool(self._rows(f"SELECT 1 FROM batches WHERE tenant = ? AND input_file_id "
                               f"= ? AND status IN ({marks})",
                               (tenant, file_id, *UNFINISHED)))

    # -- batches -----------------------------------------------------------------------

    def add_batch(self, batch: BatchRecord, max_unfinished: int | None = None,
                  max_bytes: int | None = None) -> None:
        """Keep a new batch. With ``max_unfinished`` / ``max_bytes``, raise ``StoreLimit``
        instead when its tenant already has that many unfinished batches, or already keeps
        ``max_bytes`` of files (its output would have no room): counted and written in one
        transaction, so concurrent creates cannot pass a bound together."""
        with self._transaction():
            if max_unfinished is not None or max_bytes is not None:
                self._serialize(batch.tenant)
            if max_unfinished is not None:
                marks = ", ".join("?" * len(UNFINISHED))
                running = int(self._execute(
                    f"SELECT COUNT(*) FROM batches WHERE tenant = ? AND status IN ({marks})",
                    (batch.tenant, *UNFINISHED)).fetchall()[0][0])
                if running >= max_unfinished:
                    raise StoreLimit("batch.max_batches", max_unfinished, running)
            if max_bytes is not None:
                stored = self._stored_locked(batch.tenant)[1]
                if stored >= max_bytes:
                    raise StoreLimit("batch.max_stored_bytes", max_bytes, stored)
            self._execute(f"INSERT INTO batches ({_BATCH_COLUMNS}) VALUES "
                          "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", _batch_row(batch))

    def batch(self, batch_id: str, tenant: str | None = None) -> BatchRecord | None:
        """The batch ``batch_id`` (of ``tenant``, when given: another's is not found)."""
        if tenant is None:
            rows = self._rows(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?",
                              (batch_id,))
        else:
            rows = self._rows(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ? AND "
                              "tenant = ?", (batch_id, tenant))
        return _batch_from_row(rows[0]) if rows else None

    def batches(self, tenant: str, limit: int, after: str | None) -> tuple[list[BatchRecord], bool]:
        """A page of the tenant's batches, newest first, and whether more follow."""
        return self._page("batches", _BATCH_COLUMNS, None, tenant, limit, after, False, None)

    def unfinished(self) -> list[BatchRecord]:
        """Every batch with work left, oldest first (all tenants: the runners' list)."""
        marks = ", ".join("?" * len(UNFINISHED))
        rows = self._rows(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE status IN ({marks}) "
                          f"ORDER BY created_at, {_rowid('batches', self._mark)}", UNFINISHED)
        return [_batch_from_row(r) for r in rows]

    def count_unfinished(self, tenant: str) -> int:
        marks = ", ".join("?" * len(UNFINISHED))
        return int(self._rows(f"SELECT COUNT(*) FROM batches WHERE tenant = ? AND status IN "
                              f"({marks})", (tenant, *UNFINISHED))[0][0])

    def move(self, batch_id: str, old: str, new: str, **fields: Any) -> BatchRecord | None:
        """Move the batch from ``old`` to ``new`` (stamping the time it entered ``new``) and
        set ``fields`` (total, errors, model), only if it is still in ``old``: None when
        another replica or a cancel moved it first. ``check_move`` guards the machine."""
        check_move(old, new)
        with self._transaction():
            return self._move(batch_id, old, new, fields)

    def _move(self, batch_id: str, old: str, new: str,
              fields: dict[str, Any]) -> BatchRecord | None:
        rows = self._execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?",
                             (batch_id,)).fetchall()
        if not rows or rows[0][6] != old:
            return None
        current = _batch_from_row(rows[0])
        stamps = dict(current.stamps)
        stamps.setdefault(STAMPS[new], int(time.time()))
        sets = {"status": new, "stamps": json.dumps(stamps), **{
            k: json.dumps(v) if k in ("errors", "metadata") and v is not None else v
            for k, v in fields.items()}}
        self._execute(f"UPDATE batches SET {', '.join(f'{k} = ?' for k in sets)} "
                      "WHERE id = ? AND status = ?", (*sets.values(), batch_id, old))
        return self.batch_locked(batch_id)

    def batch_locked(self, batch_id: str) -> BatchRecord | None:
        rows = self._execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?",
                             (batch_id,)).fetchall()
        return _batch_from_row(rows[0]) if rows else None

    def finish(self, batch: BatchRecord, new: str, output: bytes, errors: bytes) -> BatchRecord | None:
        """Write the output and error files (each only when it has lines) and move the
        batch to ``new`` in one transaction; None when it was no longer in its status."""
        check_move(batch.status, new)
        fields: dict[str, Any] = {}
        with self._transaction():
            current = self.batch_locked(batch.id)
            if current is None or current.status != batch.status:
                return None
            now = int(time.time())
            for name, content, column in ((f"batch_{batch.id}_output.jsonl", output,
                                           "output_file_id"),
                                          (f"batch_{batch.id}_error.jsonl", errors,
                                           "error_file_id")):
                if content:
                    record = FileRecord(new_id("file-"), batch.tenant, "batch_output", name,
                                        len(content), now)
                    self._insert_file(record, content)
                    fields[column] = record.id
            return self._move(batch.id, batch.status, new, fields)

    def finish_from_results(self, batch: BatchRecord, new: str,
                            extra_errors: bytes = b"") -> BatchRecord | None:
        """``finish`` with the files written from the batch's stored results, in line
        order (``extra_errors`` after the error file's results), streamed: a page of
        ``RESULTS_PAGE`` results and one part in memory at a time, whatever the files'
        sizes. One transaction (the lock held while the files are written, as ``finish``);
        None when the batch was no longer in its status."""
        check_move(batch.status, new)
        fields: dict[str, Any] = {}
        with self._transaction():
            current = self.batch_locked(batch.id)
            if current is None or current.status != batch.status:
                return None
            now = int(time.time())
            for ok, kind, column, tail in ((1, "output", "output_file_id", b""),
                                           (0, "error", "error_file_id", extra_errors)):
                file_id = new_id("file-")
                size = self._write_parts(file_id, self._result_texts(batch.id, ok), tail)
                if size:
                    self._execute(f"INSERT INTO batch_files ({_FILE_COLUMNS}, content) "
                                  "VALUES (?, ?, ?, ?, ?, ?, ?)",
                                  (file_id, batch.tenant, "batch_output",
                                   f"batch_{batch.id}_{kind}.jsonl", size, now, b""))
                    fields[column] = file_id
            return self._move(batch.id, batch.status, new, fields)

    def _result_texts(self, batch_id: str, ok: int) -> Iterator[bytes]:
        """The stored results' lines (``ok`` 1: answered 2xx), in line order, read a page
        at a time by line number; inside a transaction."""
        after = 0
        while True:
            rows = self._execute("SELECT line, text FROM batch_results WHERE batch_id = ? "
                                 "AND ok = ? AND line > ? ORDER BY line LIMIT ?",
                                 (batch_id, ok, after, RESULTS_PAGE)).fetchall()
            if not rows:
                return
            for _, text in rows:
                yield text.encode() + b"\n"
            after = int(rows[-1][0])

    def _write_parts(self, file_id: str, chunks: Iterator[bytes], tail: bytes) -> int:
        """Store ``chunks`` then ``tail`` as the parts of ``file_id`` (``PART_BYTES``
        each, the last shorter); their total bytes. Inside a transaction."""
        buffer, part, size = bytearray(), 0, 0
        for chunk in itertools.chain(chunks, (tail,)):
            buffer += chunk
            while len(buffer) >= PART_BYTES:
                self._execute("INSERT INTO batch_file_parts (file_id, part, data) VALUES "
                              "(?, ?, ?)", (file_id, part, bytes(buffer[:PART_BYTES])))
                del buffer[:PART_BYTES]
                part, size = part + 1, size + PART_BYTES
        if buffer:
            self._execute("INSERT INTO batch_file_parts (file_id, part, data) VALUES "
                          "(?, ?, ?)", (file_id, part, bytes(buffer)))
            size += len(buffer)
        return size

    # -- results -----------------------------------------------------------------------

    def add_result(self, batch_id: str, result: LineResult) -> bool:
        """Keep a line's result; False when the line already had one (it stays)."""
        with self._transaction():
            cur = self._execute(
                "INSERT INTO batch_results (batch_id, line, custom_id, ok, text, "
                "prompt_tokens, cached_tokens, completion_tokens) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (batch_id, line) DO NOTHING",
                (batch_id, result.number, result.custom_id, int(result.ok), result.text,
                 result.prompt_tokens, result.cached_tokens, result.completion_tokens))
            return bool(cur.rowcount)

    def done_lines(self, batch_id: str) -> set[int]:
        return {int(r[0]) for r in self._rows(
            "SELECT line FROM batch_results WHERE batch_id = ?", (batch_id,))}

    def results(self, batch_id: str) -> list[LineResult]:
        """Every result of the batch in line order (the output files' order)."""
        rows = self._rows("SELECT line, custom_id, ok, text, prompt_tokens, cached_tokens, "
                          "completion_tokens FROM batch_results WHERE batch_id = ? "
                          "ORDER BY line", (batch_id,))
        return [LineResult(int(r[0]), r[1], bool(r[2]), r[3], int(r[4]), int(r[5]),
                           int(r[6])) for r in rows]

    def result_bytes(self, batch_id: str) -> tuple[int, int]:
        """Bytes the output and the error file of the batch would have from its stored
        results (each result's line and its newline; the text is ASCII JSON), summed by
        the database: what finalizing would write, known before it is built."""
        size = "LENGTH(CAST(text AS BLOB))" if self._mark == "?" else "OCTET_LENGTH(text)"
        row = self._rows(f"SELECT COALESCE(SUM(CASE WHEN ok = 1 THEN {size} + 1 END), 0), "
                         f"COALESCE(SUM(CASE WHEN ok = 0 THEN {size} + 1 END), 0) "
                         "FROM batch_results WHERE batch_id = ?", (batch_id,))[0]
        return int(row[0]), int(row[1])

    def usage(self, batch_id: str) -> Usage:
        row = self._rows("SELECT COALESCE(SUM(ok), 0), COUNT(*), "
                         "COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0), "
                         "COALESCE(SUM(completion_tokens), 0) FROM batch_results "
                         "WHERE batch_id = ?", (batch_id,))[0]
        ok, count = int(row[0]), int(row[1])
        return Usage(ok, count - ok, int(row[2]), int(row[3]), int(row[4]))

    # -- pages -------------------------------------------------------------------------

    def _page(self, table: str, columns: str, kind: type[FileRecord] | None, tenant: str,
              limit: int, after: str | None, ascending: bool,
              where: tuple[str, str] | None) -> tuple[list[Any], bool]:
        """OpenAI's cursor pages: ``after`` is the id of the last object of the previous
        page; objects are ordered by creation (and insertion, for ties)."""
        order = "ASC" if ascending else "DESC"
        clauses, params = ["tenant = ?"], [tenant]
        if where is not None:
            clauses.append(f"{where[0]} = ?")
            params.append(where[1])
        if after:
            cursor = self._rows(f"SELECT created_at, rowid_ FROM (SELECT created_at, "
                                f"{_rowid(table, self._mark)} AS rowid_, id FROM {table}) t "
                                "WHERE id = ?", (after,))
            if cursor:
                created, rowid = cursor[0]
                op = ">" if ascending else "<"
                clauses.append(f"(created_at {op} ? OR (created_at = ? AND "
                               f"{_rowid(table, self._mark)} {op} ?))")
                params += [created, created, rowid]
        rows = self._rows(f"SELECT {columns} FROM {table} WHERE {' AND '.join(clauses)} "
                          f"ORDER BY created_at {order}, {_rowid(table, self._mark)} {order} "
                          f"LIMIT {int(limit) + 1}", params)
        more = len(rows) > limit
        rows = rows[:limit]
        if kind is FileRecord:
            return [FileRecord(*r) for r in rows], more
        return [_batch_from_row(r) for r in rows], more


def _rowid(table: str, mark: str) -> str:
    """The insertion order of a row: SQLite's rowid; in Postgres the batches' ``seq``
    (files are ordered by id among files created in the same second)."""
    if mark == "?":
        return "rowid"
    return "seq" if table == "batches" else "id"


def _batch_row(b: BatchRecord) -> tuple[Any, ...]:
    return (b.id, b.tenant, b.application, b.endpoint, b.input_file_id, b.completion_window,
            b.status, b.created_at, b.expires_at, b.total,
            None if b.metadata is None else json.dumps(b.metadata),
            None if b.errors is None else json.dumps(b.errors),
            b.output_file_id, b.error_file_id, json.dumps(b.stamps), b.model)


def _batch_from_row(r: Sequence[Any]) -> BatchRecord:
    return BatchRecord(
        id=r[0], tenant=r[1], application=r[2], endpoint=r[3], input_file_id=r[4],
        completion_window=r[5], status=r[6], created_at=int(r[7]), expires_at=int(r[8]),
        total=int(r[9]), metadata=None if r[10] is None else json.loads(r[10]),
        errors=None if r[11] is None else json.loads(r[11]), output_file_id=r[12],
        error_file_id=r[13], stamps=json.loads(r[14] or "{}"), model=r[15])
