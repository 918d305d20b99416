"""The gateway configuration a bench writes: engines, tenants and a SQLite ledger as YAML.

Each bench states only what it measures (routing, lanes, rates, limits); the entries here
carry what every bench gateway has in common. The output is ``yaml.safe_dump`` of plain
lists and dicts, keys sorted, so the same arguments give the same file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def engine_entry(url: str, max_inflight: int, **fields: Any) -> dict[str, Any]:
    """One ``engines`` entry: ``url`` with at most ``max_inflight`` requests on it, and no
    slots reserved for light tenants unless ``fields`` says otherwise: each bench that uses
    it measures one mechanism (the fair queue, a rate split, batch headroom, locality,
    the relay's cost) with every slot usable; ``bench hostile`` runs the defaults. A field
    given as None is left out (the gateway's default; a config older trees accept)."""
    entry = {"url": url, "max_inflight": max_inflight, "reserved_slots": 0, **fields}
    return {k: v for k, v in entry.items() if v is not None}


def tenant_entry(tenant_id: str, *api_keys: str, **fields: Any) -> dict[str, Any]:
    """One ``tenants`` entry: ``tenant_id`` known by ``api_keys``."""
    return {"id": tenant_id, "api_keys": list(api_keys), **fields}


def gateway_yaml(engines: Sequence[dict[str, Any]], tenants: Sequence[dict[str, Any]],
                 ledger: Path, **sections: Any) -> str:
    """The configuration file's text: ``engines``, ``tenants``, the ledger in the SQLite
    file ``ledger``, and any other top-level ``sections`` as given."""
    import yaml

    return yaml.safe_dump({"engines": list(engines), "ledger": f"sqlite:///{ledger}",
                           "tenants": list(tenants), **sections})
