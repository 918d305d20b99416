"""The ``batch`` section: the Batch API's lane, cost and bounds, checked against the lanes
and each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._fields import ConfigError, _batch_cost, _duration, _int, _known, _mapping
from ._values import BatchConfig, LaneConfig


def _batch(value: Any, lanes: tuple[LaneConfig, ...], base_dir: Path | None) -> BatchConfig:
    if value is None:
        return BatchConfig()
    m = _mapping(value, "batch")
    where = "batch"
    _known(m, where, ("lane", "cost", "max_file_bytes", "max_lines", "max_files",
                      "max_batches", "expire_after", "headroom", "concurrency", "store",
                      "max_stored_bytes", "max_uploads", "max_tenant_uploads",
                      "upload_memory", "max_output_bytes", "shutdown_wait"))
    lane = m.get("lane")
    if lane is not None and lane not in {x.name for x in lanes}:
        raise ConfigError(f"batch.lane: unknown lane {lane!r}; lanes are "
                          f"{', '.join(x.name for x in lanes)}")
    cost = _batch_cost(m, "batch", "cost")
    store = m.get("store")
    if store is not None:
        if not isinstance(store, str) or not store:
            raise ConfigError("batch.store: expected a URL such as 'sqlite:///batches.db' "
                              "or 'postgresql://...'")
        from ..ledger import LedgerError, parse_ledger_url, resolve_ledger_url

        try:
            parse_ledger_url(store)
        except LedgerError as exc:
            raise ConfigError(f"batch.store: {exc}") from None
        if base_dir is not None:
            store = resolve_ledger_url(store, base_dir)
    defaults = BatchConfig()
    max_file_bytes = _int(m, "max_file_bytes", where, defaults.max_file_bytes, minimum=1) or 0
    upload_memory = _int(m, "upload_memory", where, max(defaults.upload_memory,
                                                        max_file_bytes), minimum=1) or 0
    if upload_memory < max_file_bytes:
        raise ConfigError(f"batch.upload_memory: {upload_memory} is less than "
                          f"batch.max_file_bytes ({max_file_bytes}): a file of the largest "
                          "size allowed could never be uploaded")
    max_uploads = _int(m, "max_uploads", where, defaults.max_uploads, minimum=1) or 0
    return BatchConfig(
        lane=lane, cost=defaults.cost if cost is None else cost,
        max_file_bytes=max_file_bytes,
        max_stored_bytes=_int(m, "max_stored_bytes", where, defaults.max_stored_bytes,
                              minimum=1) or 0,
        max_uploads=max_uploads,
        max_tenant_uploads=_int(m, "max_tenant_uploads", where,
                                min(defaults.max_tenant_uploads, max_uploads), minimum=1) or 0,
        upload_memory=upload_memory,
        max_lines=_int(m, "max_lines", where, defaults.max_lines, minimum=1) or 0,
        max_files=_int(m, "max_files", where, defaults.max_files, minimum=1) or 0,
        max_batches=_int(m, "max_batches", where, defaults.max_batches, minimum=1) or 0,
        expire_after_s=_duration(m, "expire_after", where, defaults.expire_after_s),
        headroom=_int(m, "headroom", where, defaults.headroom, minimum=0) or 0,
        concurrency=_int(m, "concurrency", where, defaults.concurrency, minimum=1) or 0,
        store=store,
        max_output_bytes=_int(m, "max_output_bytes", where, defaults.max_output_bytes,
                              minimum=1024) or 0,
        shutdown_wait_s=_duration(m, "shutdown_wait", where, defaults.shutdown_wait_s))
