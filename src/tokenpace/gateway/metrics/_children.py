"""The index of bound series: every series with a ``tenant`` label is made through
``child``, so a tenant's series are found (and dropped) without looking at anyone else's."""

from __future__ import annotations

from contextlib import suppress
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from ._declare import OUTPUT_RATE, _TENANT_AT


# (metric, label values) -> bound child. ``metric.labels(...)`` validates its arguments,
# builds a key and takes the metric's lock on every call; the request path binds the same
# few children for every request of a tenant, so it binds them once here. Bounded like the
# series themselves: forget_tenant prunes a tenant's entries.
_CHILDREN: dict[tuple[Counter | Gauge | Histogram, tuple[str, ...]], Any] = {}
# tenant -> the keys of its bound series: what forget_tenant removes, without looking
# through any other tenant's series.
_OF_TENANT: dict[str, list[tuple[Counter | Gauge | Histogram, tuple[str, ...]]]] = {}


def child(metric: Counter | Gauge | Histogram, *values: str) -> Any:
    """``metric.labels(*values)``, bound once (one dict lookup per call afterwards).

    Every series with a ``tenant`` label (the metrics in ``_LABELS``) is made here, so that
    forget_tenant finds all of a tenant's series in its own index.
    """
    key = (metric, values)
    bound = _CHILDREN.get(key)
    if bound is None:
        bound = _CHILDREN[key] = metric.labels(*values)
        at = _TENANT_AT.get(metric)
        if at is not None:
            _OF_TENANT.setdefault(values[at], []).append(key)
    return bound


def forget_tenant(tenant: str) -> None:
    """Drop every series of a tenant (idle, or removed by a reload). O(its series)."""
    for key in _OF_TENANT.pop(tenant, ()):
        metric, values = key
        if _CHILDREN.pop(key, None) is not None:
            with suppress(KeyError):
                metric.remove(*values)


def has_series(tenant: str) -> bool:
    return tenant in _OF_TENANT


def publish_output_rate(tenant: str, rate: float | None) -> None:
    """Set (or, without a rate, remove) a tenant's configured-rate series."""
    if rate is not None:
        child(OUTPUT_RATE, tenant).set(rate)
        return
    key = (OUTPUT_RATE, (tenant,))
    if _CHILDREN.pop(key, None) is not None:
        with suppress(KeyError):
            OUTPUT_RATE.remove(tenant)
        keys = _OF_TENANT.get(tenant)
        if keys is not None:
            keys.remove(key)
