"""The API keys a replica accepts, by digest: what ``admission.identify`` asks when a key
is not one of the configuration file's.

Per request with an API key: one dict lookup, one comparison with the key's end time (the
caller's clock read), one set lookup (its tenant is live here), one dict store (its use,
for ``last_used_at``). A change of a key costs O(1); the table is replaced by no reload.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ApplicationConfig, GatewayConfig, TenantConfig
from ._records import ApiKey


@dataclass(frozen=True, slots=True)
class _Entry:
    key_id: str
    tenant: str
    application: str | None
    not_after: float | None


class KeyTable:
    """Digest -> working API key; only the keys of ``tenants`` (the API tenants this
    replica serves: a tenant shadowed by the file's, or deleted, is not in it) answer."""

    def __init__(self) -> None:
        self._by_digest: dict[bytes, _Entry] = {}
        self._digest_of: dict[str, bytes] = {}
        self.tenants: frozenset[str] = frozenset()
        self._used: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._by_digest)

    def apply(self, key: ApiKey, now: float) -> None:
        """A key's current row: in the table while it works, out once it does not."""
        old = self._digest_of.pop(key.id, None)
        if old is not None:
            self._by_digest.pop(old, None)
        if key.works_at(now):
            self._by_digest[key.digest] = _Entry(key.id, key.tenant, key.application,
                                                 key.not_after)
            self._digest_of[key.id] = key.digest

    def identity(self, digest: bytes, config: GatewayConfig, now: float,
                 ) -> tuple[TenantConfig, ApplicationConfig | None] | None:
        """The tenant (and application) of a working key with this digest, else None.
        The key's use is noted for ``take_used``."""
        entry = self._by_digest.get(digest)
        if entry is None or entry.tenant not in self.tenants:
            return None
        if entry.not_after is not None and now >= entry.not_after:
            return None
        tenant = config.tenant(entry.tenant)
        if tenant is None:
            return None
        application = None
        if entry.application is not None:
            application = tenant.application(entry.application)
            if application is None:  # a change removed the application
                return None
        self._used[entry.key_id] = now
        return tenant, application

    def take_used(self) -> dict[str, float]:
        """The keys used since the last call, with the time of their last use."""
        used, self._used = self._used, {}
        return used

    def sweep(self, now: float) -> int:
        """Drop the keys that stopped working (expired, a grace ended): O(keys)."""
        gone = [(d, e.key_id) for d, e in self._by_digest.items()
                if e.not_after is not None and now >= e.not_after]
        for digest, key_id in gone:
            del self._by_digest[digest]
            self._digest_of.pop(key_id, None)
        return len(gone)
