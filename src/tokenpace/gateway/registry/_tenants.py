"""The API tenants a replica knows, and the configuration it serves: the file's tenants
and the API's together.

The file wins: an API tenant whose id the file also defines is left out on this replica
(with a problem to log), and so is one whose body the file no longer accepts (a lane it
names was removed). A body is parsed once per version of its row and per file
configuration.
"""

from __future__ import annotations

import dataclasses

from ..config import ConfigError, GatewayConfig, TenantConfig, parse_api_tenant
from ._records import ApiTenant


class ApiTenants:
    """Tenant id -> its latest row (deleted ones dropped)."""

    def __init__(self) -> None:
        self.rows: dict[str, ApiTenant] = {}
        self._parsed: dict[str, tuple[int, TenantConfig]] = {}
        self._base: GatewayConfig | None = None

    def apply(self, tenant: ApiTenant) -> bool:
        """A tenant's current row; whether it changed what this replica knows."""
        old = self.rows.get(tenant.id)
        if tenant.deleted_at is not None:
            return self.rows.pop(tenant.id, None) is not None
        if old is not None and old.version >= tenant.version:
            return False
        self.rows[tenant.id] = tenant
        return True

    def merged(self, file_config: GatewayConfig,
               ) -> tuple[GatewayConfig, frozenset[str], list[str]]:
        """The configuration with the API tenants after the file's, the ids of those
        served, and a line for each left out. O(tenants); the bodies parsed again only
        when their row or the file changed."""
        if file_config is not self._base:
            self._parsed.clear()
            self._base = file_config
        file_ids = {t.id for t in file_config.tenants}
        served: list[TenantConfig] = []
        problems: list[str] = []
        for tenant_id, row in sorted(self.rows.items()):
            if tenant_id in file_ids:
                problems.append(f"API tenant {tenant_id!r} is left out: the configuration "
                                "file defines a tenant of that id")
                continue
            cached = self._parsed.get(tenant_id)
            if cached is not None and cached[0] == row.version:
                served.append(cached[1])
                continue
            try:
                parsed = parse_api_tenant({**row.spec, "id": tenant_id}, file_config, row.salt)
            except ConfigError as exc:
                problems.append(f"API tenant {tenant_id!r} is left out: {exc}")
                continue
            self._parsed[tenant_id] = (row.version, parsed)
            served.append(parsed)
        config = dataclasses.replace(file_config, tenants=file_config.tenants + tuple(served))
        return config.build_indexes(), frozenset(t.id for t in served), problems
