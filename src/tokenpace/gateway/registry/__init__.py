"""Tenants and keys made at runtime through the admin API, and the audit of every change.

Stored in the ledger's database (``RegistryStore``: four tables, each change one
transaction with its audit row, keys as digests only). Each replica keeps what it serves
in memory: ``ApiTenants`` (the rows, merged with the configuration file's tenants: the
file wins) and ``KeyTable`` (digest -> working key, asked per request when a key is not
the file's). Replicas learn of changes by polling the store's change counter
(``RegistryStore.version``) and reading the rows stamped after the version they applied
(``RegistryStore.changes``).
"""

from ._keys import KeyTable
from ._records import (
    ApiKey,
    ApiTenant,
    AuditRow,
    RegistryConflict,
    new_key_id,
    new_salt,
    new_secret,
)
from ._store import Changes, RegistryStore
from ._tenants import ApiTenants

__all__ = [
    "ApiKey",
    "ApiTenant",
    "ApiTenants",
    "AuditRow",
    "Changes",
    "KeyTable",
    "RegistryConflict",
    "RegistryStore",
    "new_key_id",
    "new_salt",
    "new_secret",
]
