"""The admin store's values: an API tenant, an API key, an audit row, and the error of a
change the store refuses."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Any


class RegistryConflict(Exception):
    """A change refused for what is stored (an id in use, a missing tenant or key): the
    admin API answers ``status`` with ``param`` named."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class ApiTenant:
    """A tenant made through the admin API: its body as given (``spec``, the fields of a
    configuration file's tenant but ``api_keys``) and its random ``salt`` (see
    ``config.parse_api_tenant``). ``deleted_at``: None while it exists."""

    id: str
    spec: dict[str, Any]
    salt: bytes
    created_at: float
    updated_at: float
    deleted_at: float | None
    version: int

    def public(self) -> dict[str, Any]:
        """What ``GET /admin/tenants`` shows (no salt)."""
        return {**self.spec, "id": self.id, "source": "api",
                "created_at": int(self.created_at), "updated_at": int(self.updated_at)}


@dataclass(frozen=True)
class ApiKey:
    """A key made through the admin API, kept as its SHA-256 ``digest`` only. It works
    while ``now < expires_at`` (None: no expiry) and ``now < revoked_at`` (a revocation
    at once, or a rotation's grace end; None: not revoked)."""

    id: str
    tenant: str
    application: str | None
    digest: bytes
    name: str | None
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    replaced_by: str | None
    last_used_at: float | None
    version: int

    @property
    def not_after(self) -> float | None:
        """When it stops working (the earlier of expiry and revocation); None: never."""
        ends = [t for t in (self.expires_at, self.revoked_at) if t is not None]
        return min(ends) if ends else None

    def works_at(self, now: float) -> bool:
        end = self.not_after
        return end is None or now < end

    def public(self) -> dict[str, Any]:
        """What the admin API shows of it: never the digest."""
        out: dict[str, Any] = {"id": self.id, "tenant": self.tenant,
                               "application": self.application, "name": self.name,
                               "created_at": int(self.created_at),
                               "expires_at": _int_or_none(self.expires_at)}
        if self.revoked_at is not None:
            out["revoked_at"] = int(self.revoked_at)
        if self.replaced_by is not None:
            out["replaced_by"] = self.replaced_by
        if self.last_used_at is not None:
            out["last_used_at"] = int(self.last_used_at)
        return out


@dataclass(frozen=True)
class AuditRow:
    """One change: ``seq`` is the change's version (every change has its own)."""

    seq: int
    at: float
    admin: str
    action: str
    target: str
    before: Any
    after: Any

    def public(self) -> dict[str, Any]:
        return {"id": self.seq, "at": round(self.at, 3), "admin": self.admin,
                "action": self.action, "target": self.target, "before": self.before,
                "after": self.after}


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def new_secret() -> str:
    """A new API key: ``sk-`` and 256 random bits (URL-safe base64)."""
    return "sk-" + secrets.token_urlsafe(32)


def new_key_id() -> str:
    """A key's id (not secret): ``key_`` and 96 random bits."""
    return "key_" + os.urandom(12).hex()


def new_salt() -> bytes:
    return os.urandom(32)
