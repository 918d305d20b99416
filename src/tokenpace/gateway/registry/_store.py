"""Where API tenants, API keys and the audit of every change live: the ledger's own
database (its SQLite file, or its Postgres), in four tables of their own.

Every change is one transaction: it takes the next value of the one-row change counter
(``admin_version``: the row's lock, or SQLite's ``BEGIN IMMEDIATE``, orders the changes of
all replicas), writes the tenant or key rows stamped with it, and the audit row numbered
by it. A replica that has applied everything up to version V reads the rows stamped after
V (``changes``): each row holds its whole current state, so applying a row twice, or a
newer one first, ends in the same state. Nothing is deleted: a deleted tenant and a
revoked key keep their rows (a deletion stamp), so every replica sees the deletion, and
the audit keeps the history.

Keys are stored as their SHA-256 digest only. Every method blocks for one short
transaction (a few statements) behind the store's lock; the gateway calls them in a
worker thread. ``touch`` writes ``last_used_at`` of many keys in one transaction.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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
from ._records import ApiKey, ApiTenant, AuditRow, RegistryConflict

_SQLITE_BUSY_TIMEOUT_S = 5.0
_PG_STATEMENT_TIMEOUT_MS = 10_000
"""Server-side bound on one statement, a lock wait and an idle transaction: a change is a
few single-row statements; the start-up read of every key the largest read."""

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS admin_version (one {integer} PRIMARY KEY, "
    "version {integer} NOT NULL)",
    "INSERT INTO admin_version (one, version) VALUES (1, 0) ON CONFLICT DO NOTHING",
    """CREATE TABLE IF NOT EXISTS admin_tenants (
        id TEXT PRIMARY KEY, spec TEXT NOT NULL, salt TEXT NOT NULL,
        created_at {real} NOT NULL, updated_at {real} NOT NULL, deleted_at {real},
        version {integer} NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS admin_tenants_version ON admin_tenants (version)",
    """CREATE TABLE IF NOT EXISTS admin_keys (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, application TEXT,
        digest TEXT NOT NULL UNIQUE, name TEXT, created_at {real} NOT NULL,
        expires_at {real}, revoked_at {real}, replaced_by TEXT, last_used_at {real},
        version {integer} NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS admin_keys_version ON admin_keys (version)",
    "CREATE INDEX IF NOT EXISTS admin_keys_tenant ON admin_keys (tenant)",
    """CREATE TABLE IF NOT EXISTS admin_audit (
        seq {integer} PRIMARY KEY, at {real} NOT NULL, admin TEXT NOT NULL,
        action TEXT NOT NULL, target TEXT NOT NULL, before TEXT, after TEXT)""",
)

_TENANT_COLUMNS = "id, spec, salt, created_at, updated_at, deleted_at, version"
_KEY_COLUMNS = ("id, tenant, application, digest, name, created_at, expires_at, revoked_at, "
                "replaced_by, last_used_at, version")


@dataclass(frozen=True)
class Changes:
    """The rows stamped after a version, and the counter read before them: once applied,
    everything up to ``version`` is (rows newer than it may be in too: harmless)."""

    version: int
    tenants: list[ApiTenant]
    keys: list[ApiKey]


class RegistryStore:
    """The admin store in the database of ledger URL ``url``."""

    def __init__(self, url: str) -> None:
        kind, where = parse_ledger_url(url)
        self._lock = threading.Lock()
        self._conn: Any = None
        if kind == "sqlite":
            import sqlite3

            self._errors: tuple[type[BaseException], ...] = (sqlite3.Error,)
            self._sqlite = True
            if where != ":memory:":
                Path(where).parent.mkdir(parents=True, exist_ok=True)
            try:
                self._conn = sqlite3.connect(where, timeout=_SQLITE_BUSY_TIMEOUT_S,
                                             isolation_level=None, check_same_thread=False)
                self._conn.execute("PRAGMA journal_mode=WAL")
            except sqlite3.Error as exc:
                raise LedgerError(f"cannot open the admin store {where}: {exc}") from exc
            types = {"integer": "INTEGER", "real": "REAL"}
        else:
            psycopg = import_psycopg("the admin store in Postgres")
            self._errors = (psycopg.Error,)
            self._sqlite = False
            self._psycopg, self._where = psycopg, where
            types = {"integer": "BIGINT", "real": "DOUBLE PRECISION"}
        try:
            with self._transaction():
                for statement in _SCHEMA:
                    self._execute(statement.format(**types))
        except self._errors as exc:
            raise LedgerError(f"cannot create the admin tables: {exc}") from exc

    # -- plumbing ----------------------------------------------------------------------

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        """The driver's exceptions (the database does not answer, a statement failed)."""
        return self._errors

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        if not self._sqlite:
            sql = sql.replace("?", "%s")
        return self._conn.execute(sql, tuple(params))

    def _ready(self) -> None:
        """Under the lock: a Postgres connection made, or made again once broken
        (``ledger.usable``: bounded in time, keepalives, the URL's own settings win)."""
        if not self._sqlite:
            self._conn = usable(self._conn, lambda: connect_postgres(
                self._psycopg, self._where, _PG_STATEMENT_TIMEOUT_MS))

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One transaction under the lock (SQLite: ``BEGIN IMMEDIATE``, the write lock at
        once, so replicas on one file serialize here)."""
        with self._lock:
            self._ready()
            with write_transaction(self._conn, self._sqlite):
                yield

    @contextmanager
    def _snapshot(self) -> Iterator[None]:
        """Reads that see one state of the database (SQLite: a deferred transaction;
        Postgres: ``REPEATABLE READ``)."""
        with self._lock:
            self._ready()
            if self._sqlite:
                self._conn.execute("BEGIN")
                try:
                    yield
                finally:
                    self._conn.execute("COMMIT")
            else:
                with self._conn.transaction():
                    self._conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    yield

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return list(self._execute(sql, params).fetchall())

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _next_version(self) -> int:
        """In a write transaction: the change's version (the counter row locked until
        commit, so versions commit in order)."""
        self._execute("UPDATE admin_version SET version = version + 1 WHERE one = 1")
        return int(self._rows("SELECT version FROM admin_version WHERE one = 1")[0][0])

    def _audit(self, version: int, now: float, admin: str, action: str, target: str,
               before: Any, after: Any) -> None:
        self._execute("INSERT INTO admin_audit (seq, at, admin, action, target, before, after)"
                      " VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (version, now, admin, action, target, _json(before), _json(after)))

    # -- reads ---------------------------------------------------------------------------

    def version(self) -> int:
        """The last change's version: one single-row read (what replicas poll)."""
        with self._lock:
            self._ready()
            return int(self._rows("SELECT version FROM admin_version WHERE one = 1")[0][0])

    def changes(self, since: int, live_at: float | None = None) -> Changes:
        """The rows changed after version ``since``; with ``live_at`` (start-up) only the
        tenants not deleted and the keys still working at that time."""
        tenant_filter = " AND deleted_at IS NULL" if live_at is not None else ""
        key_filter = (" AND (revoked_at IS NULL OR revoked_at > ?)"
                      " AND (expires_at IS NULL OR expires_at > ?)") if live_at is not None else ""
        key_params: tuple[Any, ...] = (since,) if live_at is None else (since, live_at, live_at)
        with self._snapshot():
            version = int(self._rows("SELECT version FROM admin_version WHERE one = 1")[0][0])
            tenants = [_tenant(r) for r in self._rows(
                f"SELECT {_TENANT_COLUMNS} FROM admin_tenants WHERE version > ?{tenant_filter}",
                (since,))]
            keys = [_key(r) for r in self._rows(
                f"SELECT {_KEY_COLUMNS} FROM admin_keys WHERE version > ?{key_filter}",
                key_params)]
        return Changes(version, tenants, keys)

    def tenant(self, tenant_id: str) -> ApiTenant | None:
        with self._lock:
            self._ready()
            return self._tenant_locked(tenant_id)

    def _tenant_locked(self, tenant_id: str) -> ApiTenant | None:
        rows = self._rows(f"SELECT {_TENANT_COLUMNS} FROM admin_tenants WHERE id = ?",
                          (tenant_id,))
        return _tenant(rows[0]) if rows else None

    def _live_tenant(self, tenant_id: str) -> ApiTenant:
        tenant = self._tenant_locked(tenant_id)
        if tenant is None or tenant.deleted_at is not None:
            raise RegistryConflict(404, f"no tenant {tenant_id!r} made through the admin API",
                                   "id")
        return tenant

    def key(self, key_id: str) -> ApiKey | None:
        with self._lock:
            self._ready()
            return self._key_locked(key_id)

    def _key_locked(self, key_id: str) -> ApiKey | None:
        rows = self._rows(f"SELECT {_KEY_COLUMNS} FROM admin_keys WHERE id = ?", (key_id,))
        return _key(rows[0]) if rows else None

    def keys_of(self, tenant_id: str, now: float) -> list[ApiKey]:
        """The tenant's keys still working at ``now`` (those in a rotation's grace
        included), oldest first."""
        with self._lock:
            self._ready()
            rows = self._rows(
                f"SELECT {_KEY_COLUMNS} FROM admin_keys WHERE tenant = ? "
                "AND (revoked_at IS NULL OR revoked_at > ?) ORDER BY created_at, id",
                (tenant_id, now))
        return [_key(r) for r in rows]

    def audit(self, limit: int, before: int | None = None) -> list[AuditRow]:
        """The newest ``limit`` changes (older than ``before`` when given), newest first."""
        where, params = ("WHERE seq < ? ", (before, limit)) if before is not None else ("", (limit,))
        with self._lock:
            self._ready()
            rows = self._rows("SELECT seq, at, admin, action, target, before, after FROM "
                              f"admin_audit {where}ORDER BY seq DESC LIMIT ?", params)
        return [AuditRow(int(r[0]), float(r[1]), r[2], r[3], r[4], _unjson(r[5]),
                         _unjson(r[6])) for r in rows]

    # -- changes -------------------------------------------------------------------------

    def create_tenant(self, tenant_id: str, spec: dict[str, Any], salt: bytes, admin: str,
                      now: float) -> ApiTenant:
        """A new tenant (a deleted one's id may be used again); 409 if the id exists."""
        with self._transaction():
            old = self._tenant_locked(tenant_id)
            if old is not None and old.deleted_at is None:
                raise RegistryConflict(409, f"tenant {tenant_id!r} already exists", "id")
            version = self._next_version()
            tenant = ApiTenant(tenant_id, spec, salt, now, now, None, version)
            if old is None:
                self._execute(f"INSERT INTO admin_tenants ({_TENANT_COLUMNS}) "
                              "VALUES (?, ?, ?, ?, ?, ?, ?)", _tenant_row(tenant))
            else:
                self._execute("UPDATE admin_tenants SET spec = ?, salt = ?, created_at = ?, "
                              "updated_at = ?, deleted_at = NULL, version = ? WHERE id = ?",
                              (json.dumps(spec), salt.hex(), now, now, version, tenant_id))
            self._audit(version, now, admin, "tenant.create", tenant_id, None, tenant.public())
        return tenant

    def update_tenant(self, tenant_id: str, spec: dict[str, Any], admin: str,
                      now: float, expected: int) -> ApiTenant:
        """The tenant's new body; 409 if it changed since version ``expected`` (read
        before the new body was checked), so a check never passes a body it did not see."""
        with self._transaction():
            old = self._live_tenant(tenant_id)
            if old.version != expected:
                raise RegistryConflict(409, f"tenant {tenant_id!r} changed meanwhile; "
                                       "send the change again", "id")
            version = self._next_version()
            self._execute("UPDATE admin_tenants SET spec = ?, updated_at = ?, version = ? "
                          "WHERE id = ?", (json.dumps(spec), now, version, tenant_id))
            new = ApiTenant(tenant_id, spec, old.salt, old.created_at, now, None, version)
            self._audit(version, now, admin, "tenant.update", tenant_id, old.public(),
                        new.public())
        return new

    def delete_tenant(self, tenant_id: str, admin: str, now: float) -> int:
        """The tenant deleted and its keys revoked now, in one change; the number of keys
        revoked."""
        with self._transaction():
            old = self._live_tenant(tenant_id)
            version = self._next_version()
            self._execute("UPDATE admin_tenants SET deleted_at = ?, updated_at = ?, "
                          "version = ? WHERE id = ?", (now, now, version, tenant_id))
            revoked = self._execute(
                "UPDATE admin_keys SET revoked_at = ?, version = ? WHERE tenant = ? "
                "AND (revoked_at IS NULL OR revoked_at > ?)",
                (now, version, tenant_id, now)).rowcount
            self._audit(version, now, admin, "tenant.delete", tenant_id, old.public(),
                        {"keys_revoked": revoked})
        return int(revoked)

    def create_key(self, key_id: str, tenant_id: str, application: str | None,
                   digest: bytes, name: str | None, expires_at: float | None, admin: str,
                   now: float) -> ApiKey:
        with self._transaction():
            self._live_tenant(tenant_id)
            version = self._next_version()
            key = ApiKey(key_id, tenant_id, application, digest, name, now, expires_at,
                         None, None, None, version)
            self._insert_key(key)
            self._audit(version, now, admin, "key.create", key_id, None, key.public())
        return key

    def _insert_key(self, key: ApiKey) -> None:
        self._execute(f"INSERT INTO admin_keys ({_KEY_COLUMNS}) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                      (key.id, key.tenant, key.application, key.digest.hex(), key.name,
                       key.created_at, key.expires_at, key.revoked_at, key.replaced_by,
                       key.last_used_at, key.version))

    def _working_key(self, key_id: str, now: float) -> ApiKey:
        key = self._key_locked(key_id)
        if key is None or (key.revoked_at is not None and key.revoked_at <= now):
            raise RegistryConflict(404, f"no key {key_id!r} (or it is revoked)", "id")
        return key

    def rotate_key(self, key_id: str, grace_s: float, new_id: str, digest: bytes,
                   admin: str, now: float) -> tuple[ApiKey, ApiKey]:
        """A new key for the same tenant, application, name and expiry; the old one works
        until ``now + grace_s`` (or its earlier revocation). (old, new)."""
        with self._transaction():
            old = self._working_key(key_id, now)
            version = self._next_version()
            ends = now + grace_s if old.revoked_at is None else min(old.revoked_at, now + grace_s)
            self._execute("UPDATE admin_keys SET revoked_at = ?, replaced_by = ?, version = ? "
                          "WHERE id = ?", (ends, new_id, version, key_id))
            new = ApiKey(new_id, old.tenant, old.application, digest, old.name, now,
                         old.expires_at, None, None, None, version)
            self._insert_key(new)
            after_old = ApiKey(old.id, old.tenant, old.application, old.digest, old.name,
                               old.created_at, old.expires_at, ends, new_id,
                               old.last_used_at, version)
            self._audit(version, now, admin, "key.rotate", key_id, old.public(),
                        {"old": after_old.public(), "new": new.public()})
        return after_old, new

    def revoke_key(self, key_id: str, admin: str, now: float) -> ApiKey:
        with self._transaction():
            old = self._working_key(key_id, now)
            version = self._next_version()
            self._execute("UPDATE admin_keys SET revoked_at = ?, version = ? WHERE id = ?",
                          (now, version, key_id))
            new = ApiKey(old.id, old.tenant, old.application, old.digest, old.name,
                         old.created_at, old.expires_at, now, old.replaced_by,
                         old.last_used_at, version)
            self._audit(version, now, admin, "key.revoke", key_id, old.public(), new.public())
        return new

    def touch(self, used: dict[str, float]) -> None:
        """``last_used_at`` of many keys in one transaction (not a change: no version, no
        audit row; a later time never goes back)."""
        if not used:
            return
        with self._transaction():
            for key_id, at in used.items():
                self._execute("UPDATE admin_keys SET last_used_at = ? WHERE id = ? AND "
                              "(last_used_at IS NULL OR last_used_at < ?)", (at, key_id, at))


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def _unjson(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _tenant_row(t: ApiTenant) -> tuple[Any, ...]:
    return (t.id, json.dumps(t.spec), t.salt.hex(), t.created_at, t.updated_at, t.deleted_at,
            t.version)


def _tenant(r: Sequence[Any]) -> ApiTenant:
    return ApiTenant(r[0], json.loads(r[1]), bytes.fromhex(r[2]), float(r[3]), float(r[4]),
                     None if r[5] is None else float(r[5]), int(r[6]))


def _key(r: Sequence[Any]) -> ApiKey:
    return ApiKey(r[0], r[1], r[2], bytes.fromhex(r[3]), r[4], float(r[5]),
                  _float(r[6]), _float(r[7]), r[8], _float(r[9]), int(r[10]))


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
