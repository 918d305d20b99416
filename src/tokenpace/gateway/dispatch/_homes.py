"""Conversation homes: the engine each conversation's last turn went to, per tenant.

A tenant keeps at most ``per_tenant`` homes (``max_conversation_homes_per_tenant``): its
conversation heard of longest ago goes first, so no tenant's new conversations evict
another's. The whole table keeps at most ``total`` (``max_conversation_homes``); when it
is full, a new home takes the place of the oldest home of the tenant that holds the most
(the one that adds it, when it is among them), so a tenant under its fair share of the
table loses nothing to others. A forgotten conversation is placed again as a new one.

Cost per operation: dict lookups and one ordered-dict move; a full table's eviction finds
the largest tenant in O(1) from the tenants grouped by their count (counts move by one).
Memory: about 150 bytes per home, plus one small dict per tenant with homes.
"""

from __future__ import annotations

from collections import OrderedDict


class HomeTable:
    """Conversation key -> engine URL, bounded per tenant and in all (see the module)."""

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total = total
        self.per_tenant = per_tenant
        self._homes: dict[str, OrderedDict[bytes, str]] = {}
        self._size = 0
        self._by_count: dict[int, set[str]] = {}  # homes held -> tenants holding that many
        self._most = 0  # the largest count with a tenant

    def __len__(self) -> int:
        return self._size

    def of(self, tenant: str) -> OrderedDict[bytes, str]:
        """``tenant``'s homes, oldest first (a view: do not change it)."""
        return self._homes.get(tenant) or OrderedDict()

    def get(self, tenant: str, key: bytes) -> str | None:
        homes = self._homes.get(tenant)
        return None if homes is None else homes.get(key)

    def put(self, tenant: str, key: bytes, url: str) -> str | None:
        """``url`` is the home of ``tenant``'s conversation ``key`` now, and its most recent;
        returns the home it had (None: new). Evicts as the module says."""
        homes = self._homes.get(tenant)
        if homes is None:
            homes = self._homes[tenant] = OrderedDict()
        previous = homes.pop(key, None)
        homes[key] = url
        if previous is not None:
            return previous
        self._moved(tenant, len(homes) - 1, len(homes))
        self._size += 1
        if len(homes) > self.per_tenant:
            self._evict(tenant)
        elif self._size > self.total:
            mine = len(homes)
            largest = tenant if mine >= self._most else next(iter(self._by_count[self._most]))
            self._evict(largest)
        return None

    def _evict(self, tenant: str) -> None:
        homes = self._homes[tenant]
        homes.popitem(last=False)
        self._size -= 1
        self._moved(tenant, len(homes) + 1, len(homes))
        if not homes:
            del self._homes[tenant]

    def _moved(self, tenant: str, before: int, after: int) -> None:
        """Move ``tenant`` from the group of ``before`` homes to that of ``after``."""
        if before:
            group = self._by_count[before]
            group.discard(tenant)
            if not group:
                del self._by_count[before]
        if after:
            self._by_count.setdefault(after, set()).add(tenant)
        if after > self._most:
            self._most = after
        while self._most and self._most not in self._by_count:
            self._most -= 1
