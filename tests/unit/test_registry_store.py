"""The admin store on a real SQLite file (two stores on one file, as two replicas), the
key table's end times, and the merge of API tenants with the file's."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tokenpace.gateway import parse_config
from tokenpace.gateway.registry import (
    ApiTenants,
    KeyTable,
    RegistryConflict,
    RegistryStore,
    new_salt,
)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@pytest.fixture
def stores(tmp_path: Path) -> list[RegistryStore]:
    url = f"sqlite:///{tmp_path / 'usage.db'}"
    out = [RegistryStore(url), RegistryStore(url)]
    yield out
    for store in out:
        store.close()


FILE = parse_config({"engines": ["http://127.0.0.1:9"], "ledger": "sqlite:///unused.db",
                     "lanes": [{"name": "gold"}, {"name": "bronze", "priority": 5}],
                     "tenants": [{"id": "file-t", "api_keys": ["sk-file"]}]})


def test_two_stores_on_one_file_order_their_changes(stores: list[RegistryStore]) -> None:
    a, b = stores
    t = a.create_tenant("acme", {"lane": "gold"}, new_salt(), "sha256:x", 100.0)
    with pytest.raises(RegistryConflict) as info:
        b.create_tenant("acme", {}, new_salt(), "sha256:y", 101.0)
    assert info.value.status == 409 and info.value.param == "id"
    k = b.create_key("key_1", "acme", None, digest("sk-1"), "n", None, "sha256:y", 102.0)
    assert (t.version, k.version) == (1, 2) and a.version() == b.version() == 2
    changes = a.changes(1)
    assert changes.version == 2 and [x.id for x in changes.keys] == ["key_1"]
    assert changes.tenants == []
    with pytest.raises(RegistryConflict):
        a.create_key("key_2", "ghost", None, digest("sk-2"), None, None, "sha256:x", 103.0)
    old, new = a.rotate_key("key_1", 60.0, "key_3", digest("sk-3"), "sha256:x", 110.0)
    assert old.revoked_at == 170.0 and old.replaced_by == "key_3" and new.name == "n"
    # A revocation inside the grace ends it now; a revoked key cannot be revoked again.
    assert b.revoke_key("key_1", "sha256:y", 120.0).revoked_at == 120.0
    with pytest.raises(RegistryConflict) as gone:
        b.revoke_key("key_1", "sha256:y", 121.0)
    assert gone.value.status == 404
    assert [k.id for k in a.keys_of("acme", 121.0)] == ["key_3"]
    # Deleting the tenant revokes its keys in the same change; the id can be used again.
    assert a.delete_tenant("acme", "sha256:x", 130.0) == 1
    assert a.keys_of("acme", 131.0) == []
    again = b.create_tenant("acme", {"lane": "bronze"}, new_salt(), "sha256:y", 140.0)
    assert again.deleted_at is None and again.spec == {"lane": "bronze"}
    live = a.changes(0, live_at=141.0)
    assert [t.id for t in live.tenants] == ["acme"] and live.keys == []
    actions = [r.action for r in a.audit(100)]
    assert actions == ["tenant.create", "tenant.delete", "key.revoke", "key.rotate",
                       "key.create", "tenant.create"]
    assert [r.seq for r in a.audit(2, before=4)] == [3, 2]


def test_an_update_checked_against_an_old_version_is_refused(stores: list[RegistryStore]) -> None:
    a, b = stores
    t = a.create_tenant("acme", {"weight": 1}, new_salt(), "x", 1.0)
    b.update_tenant("acme", {"weight": 2}, "y", 2.0, expected=t.version)
    with pytest.raises(RegistryConflict) as info:
        a.update_tenant("acme", {"weight": 3}, "x", 3.0, expected=t.version)
    assert info.value.status == 409
    assert a.tenant("acme").spec == {"weight": 2}  # type: ignore[union-attr]


def test_touch_never_moves_last_use_back(stores: list[RegistryStore]) -> None:
    a, _ = stores
    a.create_tenant("acme", {}, new_salt(), "x", 1.0)
    a.create_key("key_1", "acme", None, digest("sk-1"), None, None, "x", 2.0)
    a.touch({"key_1": 50.0})
    a.touch({"key_1": 40.0})
    assert a.key("key_1").last_used_at == 50.0  # type: ignore[union-attr]
    assert a.version() == 2  # a use is not a change


def test_key_table_ends_and_tenants(stores: list[RegistryStore]) -> None:
    a, _ = stores
    tenants = ApiTenants()
    tenants.apply(a.create_tenant("acme", {"applications": [{"id": "app"}]}, new_salt(),
                                  "x", 1.0))
    config, served, problems = tenants.merged(FILE)
    assert served == {"acme"} and problems == []
    table = KeyTable()
    table.apply(a.create_key("k1", "acme", None, digest("sk-1"), None, 100.0, "x", 2.0), 2.0)
    table.apply(a.create_key("k2", "acme", "app", digest("sk-2"), None, None, "x", 3.0), 3.0)
    assert table.identity(digest("sk-1"), config, 50.0) is None  # not served yet
    table.tenants = served
    tenant, app = table.identity(digest("sk-2"), config, 50.0)  # type: ignore[misc]
    assert tenant.id == "acme" and app is not None and app.id == "app"
    assert table.identity(digest("sk-1"), config, 99.9) is not None
    assert table.identity(digest("sk-1"), config, 100.0) is None  # expired
    assert set(table.take_used()) == {"k1", "k2"} and table.take_used() == {}
    assert table.sweep(100.0) == 1 and len(table) == 1
    table.apply(a.revoke_key("k2", "x", 60.0), 60.0)
    assert table.identity(digest("sk-2"), config, 61.0) is None and len(table) == 0


def test_the_file_wins_an_id_and_a_body_it_no_longer_accepts_is_left_out(
        stores: list[RegistryStore]) -> None:
    a, _ = stores
    tenants = ApiTenants()
    tenants.apply(a.create_tenant("file-t", {}, new_salt(), "x", 1.0))
    tenants.apply(a.create_tenant("bronzed", {"lane": "bronze"}, new_salt(), "x", 2.0))
    config, served, problems = tenants.merged(FILE)
    assert served == {"bronzed"} and len(problems) == 1 and "file-t" in problems[0]
    assert config.tenant("file-t") is FILE.tenant("file-t")
    fewer_lanes = parse_config({"engines": ["http://127.0.0.1:9"], "ledger": "sqlite:///u.db",
                                "tenants": [{"id": "file-t", "api_keys": ["sk-file"]}]})
    config, served, problems = tenants.merged(fewer_lanes)
    assert served == frozenset() and any("lane" in p for p in problems)
    assert config.tenant("bronzed") is None
