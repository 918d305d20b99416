"""The conversation homes' table: bounded per tenant (a tenant evicts its own oldest) and
in all (a full table takes the place of the largest tenant's oldest home)."""

from __future__ import annotations

from tokenpace.gateway.dispatch._homes import HomeTable


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_a_tenant_evicts_its_own_oldest_first() -> None:
    table = HomeTable(total=100, per_tenant=3)
    table.put("quiet", key(0), "http://e1")
    for i in range(1, 10):
        table.put("loud", key(i), "http://e2")
    assert list(table.of("loud")) == [key(7), key(8), key(9)]
    assert table.get("quiet", key(0)) == "http://e1" and len(table) == 4
    # A turn of a remembered conversation moves it, and makes it the newest.
    assert table.put("loud", key(7), "http://e1") == "http://e2"
    table.put("loud", key(10), "http://e2")
    assert list(table.of("loud")) == [key(9), key(7), key(10)]


def test_a_full_table_takes_the_place_of_the_largest_tenants_oldest() -> None:
    table = HomeTable(total=6, per_tenant=5)
    for i in range(5):
        table.put("loud", key(i), "u")
    table.put("quiet", key(100), "u")
    assert len(table) == 6
    table.put("quiet", key(101), "u")  # full: loud holds the most and loses its oldest
    assert list(table.of("loud")) == [key(1), key(2), key(3), key(4)]
    assert list(table.of("quiet")) == [key(100), key(101)] and len(table) == 6
    for i in range(102, 110):  # quiet grows past loud: then it evicts its own
        table.put("quiet", key(i), "u")
    assert len(table) == 6 and len(table.of("quiet")) == 3 and len(table.of("loud")) == 3
    assert table.get("quiet", key(109)) == "u" and table.get("quiet", key(100)) is None


def test_evicted_tenants_leave_no_trace() -> None:
    table = HomeTable(total=2, per_tenant=2)
    for tenant in ("a", "b", "c", "d"):
        table.put(tenant, key(1), "u")
    assert len(table) == 2 and sum(1 for t in "abcd" if table.of(t)) == 2
    assert len(table._homes) == 2 and sum(len(g) for g in table._by_count.values()) == 2
