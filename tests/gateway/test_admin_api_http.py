"""Tenants and keys made at runtime through the admin API: two real gateway processes over
one database (a SQLite file; once a real Postgres; once with their state in a real
redis-server), the fake engine behind them.

A change made at one replica works at the other within a second (its poll), a rotated
key keeps working through its grace then gets 401, a revoked key gets 401 on both, a
restart keeps everything; bad bodies get a 400 naming the field and change nothing; the
audit names each change and never a secret; the openai SDK and ``tokenpace admin`` use
what the API made.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import ADMIN_HEADERS, ADMIN_KEY, KEY_A, GatewayProcess, base_config

PROPAGATION_BOUND_S = 2.0
"""A change must work at the other replica within 1 s (a 250 ms poll); the bound leaves
room for a loaded 2-core CI box."""

TENANT = {"id": "acme", "lane": "interactive", "weight": 3,
          "budgets": [{"tokens": 100000, "per": "1h"}], "max_concurrency": 4,
          "applications": [{"id": "portal", "max_concurrency": 2}]}


def replica(tmp_path: Path, name: str, engine: EngineServer, ledger: str,
            **sections: Any) -> GatewayProcess:
    home = tmp_path / name
    home.mkdir(exist_ok=True)
    config = base_config(engine.url, home / "unused.db")
    config["ledger"] = ledger
    config["ledger_journal"] = str(home / "journal")  # each replica its own journal
    config.update(sections)
    return GatewayProcess(home, config)


@pytest.fixture
def two(engine: EngineServer, tmp_path: Path) -> Iterator[list[GatewayProcess]]:
    ledger = f"sqlite:///{tmp_path / 'shared.db'}"
    gws = [replica(tmp_path, n, engine, ledger).start() for n in ("a", "b")]
    yield gws
    for gw in gws:
        gw.stop()


def admin(gw: GatewayProcess, method: str, path: str, body: Any = None,
          key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, gw.url + path, json=body, headers=headers, timeout=30)


def complete(gw: GatewayProcess, key: str) -> int:
    return httpx.post(f"{gw.url}/v1/completions", timeout=30,
                      json={"model": "fake", "prompt": "hello", "max_tokens": 2},
                      headers={"authorization": f"Bearer {key}"}).status_code


def until(gw: GatewayProcess, key: str, status: int, bound_s: float = PROPAGATION_BOUND_S) -> float:
    """Seconds until a request with ``key`` at ``gw`` answers ``status``; fails past the bound."""
    started = time.monotonic()
    while (got := complete(gw, key)) != status:
        assert time.monotonic() - started < bound_s, (got, status, gw.log())
        time.sleep(0.02)
    return time.monotonic() - started


def lifecycle(a: GatewayProcess, b: GatewayProcess) -> None:
    """Create at A, use at B; rotate with a grace; revoke; the audit of it all."""
    made = admin(a, "POST", "/admin/tenants", TENANT)
    assert made.status_code == 201, made.text
    assert made.json()["source"] == "api" and made.json()["weight"] == 3
    created = admin(a, "POST", "/admin/tenants/acme/keys", {"name": "ci"})
    assert created.status_code == 201, created.text
    first = created.json()
    assert first["key"].startswith("sk-") and first["id"].startswith("key_")
    assert set(first) >= {"id", "key", "name", "created_at", "expires_at"}
    assert complete(a, first["key"]) == 200  # applied at A before the answer
    until(b, first["key"], 200)
    app_key = admin(b, "POST", "/admin/tenants/acme/keys", {"application": "portal"}).json()
    until(a, app_key["key"], 200)
    listed = admin(b, "GET", "/admin/tenants/acme/keys").json()["data"]
    assert {k["id"] for k in listed} == {first["id"], app_key["id"]}
    assert not any("key" in k or "digest" in k for k in listed)

    rotated = admin(b, "POST", f"/admin/keys/{first['id']}/rotate", {"grace": "5s"})
    assert rotated.status_code == 201, rotated.text
    second = rotated.json()
    assert second["id"] != first["id"] and second["key"] != first["key"]
    assert complete(b, first["key"]) == 200  # in its grace, where the rotation was made
    until(a, second["key"], 200)
    assert complete(a, first["key"]) == 200  # in its grace, where the rotation arrived
    assert time.time() < second["old_key_works_until"], "the box was too slow to see the grace"
    time.sleep(max(0.0, second["old_key_works_until"] - time.time()))
    assert complete(a, first["key"]) == 401 and complete(b, first["key"]) == 401

    assert admin(a, "DELETE", f"/admin/keys/{second['id']}").status_code == 200
    assert complete(a, second["key"]) == 401
    until(b, second["key"], 401)

    rows = admin(b, "GET", "/admin/audit").json()["data"]
    assert [r["action"] for r in rows] == ["key.revoke", "key.rotate", "key.create",
                                           "key.create", "tenant.create"]
    assert all(r["admin"].startswith("sha256:") and len(r["admin"]) == 19 for r in rows)
    text = json.dumps(rows)
    for secret in (first["key"], second["key"], app_key["key"], ADMIN_KEY):
        assert secret not in text
    assert rows[1]["before"]["id"] == first["id"] and rows[1]["after"]["new"]["id"] == second["id"]
    assert rows[-1]["after"]["budgets"] == TENANT["budgets"]


def test_two_replicas_on_one_sqlite_file(two: list[GatewayProcess]) -> None:
    a, b = two
    lifecycle(a, b)
    # A change of the tenant itself reaches B: its lane, then its deletion.
    patched = admin(a, "PATCH", "/admin/tenants/acme", {"lane": "batch"})
    assert patched.status_code == 200 and patched.json()["lane"] == "batch"
    deadline = time.monotonic() + PROPAGATION_BOUND_S
    while admin(b, "GET", "/admin/tenants/acme").json()["lane"] != "batch":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    made = admin(a, "POST", "/admin/tenants/acme/keys", {}).json()
    kept = made["key"]
    assert "last_used_at" not in made
    until(b, kept, 200)
    # A restart keeps the tenant and its keys; B wrote the key's use on its way out.
    b.stop()
    b.start()
    assert complete(b, kept) == 200
    listed = {k["id"]: k for k in admin(a, "GET", "/admin/tenants/acme/keys").json()["data"]}
    assert listed[made["id"]]["last_used_at"] >= made["created_at"]
    names = [t["id"] for t in admin(b, "GET", "/admin/tenants").json()["data"]]
    assert names == ["team-a", "team-b", "acme"]
    # Deleting the tenant revokes its keys everywhere; its ledger rows stay.
    gone = admin(b, "DELETE", "/admin/tenants/acme")
    assert gone.status_code == 200 and gone.json()["keys_revoked"] == 2, gone.text  # + app's
    until(a, kept, 401)
    assert admin(a, "GET", "/admin/tenants/acme").status_code == 404
    assert any(r.tenant == "acme" for r in a.rows(1))


@pytest.mark.redis
def test_an_api_tenants_budget_is_shared_by_replicas_in_redis(
        engine: EngineServer, tmp_path: Path, redis_server: Any) -> None:
    """With ``state`` in a real redis-server, a tenant made at runtime has one budget for
    both replicas, as a file tenant has: spent at A, refused at B. (Replicas of separate
    processes would each keep a budget of their own.)"""
    ledger = f"sqlite:///{tmp_path / 'shared.db'}"
    state = {"url": redis_server.url, "replicas": 2}
    a, b = (replica(tmp_path, n, engine, ledger, state=state).start() for n in ("a", "b"))
    try:
        made = admin(a, "POST", "/admin/tenants", {"id": "metered", "lane": "interactive",
                                                   "budgets": [{"tokens": 40, "per": "1h"}]})
        assert made.status_code == 201, made.text
        key = admin(a, "POST", "/admin/tenants/metered/keys", {}).json()["key"]
        until(b, key, 200)  # known at B; one request of the budget spent there
        spent = 0
        while complete(a, key) == 200:
            spent += 1
            assert spent < 40, "the budget never ran out at A"
        assert complete(a, key) == 429
        assert complete(b, key) == 429, b.log()  # the same budget, in Redis
    finally:
        a.stop()
        b.stop()


def test_bad_inputs_change_nothing(gateway: GatewayProcess) -> None:
    gw = gateway
    assert admin(gw, "POST", "/admin/tenants", TENANT, key=None).status_code == 401
    assert admin(gw, "POST", "/admin/tenants", TENANT, key=KEY_A).status_code == 403
    cases = [
        ({**TENANT, "bogus": 1}, "bogus"),
        ({**TENANT, "budgets": [{"tokens": 10, "per": "fortnight"}]}, "budgets[0].per"),
        ({**TENANT, "lane": "nope"}, "lane"),
        ({**TENANT, "api_keys": ["sk-mine"]}, "api_keys"),
        ({**TENANT, "applications": [{"id": "x", "api_keys": ["k"]}]},
         "applications[0].api_keys"),
        ({**TENANT, "weight": -1}, "weight"),
        ({k: v for k, v in TENANT.items() if k != "id"}, "id"),
    ]
    for body, param in cases:
        answer = admin(gw, "POST", "/admin/tenants", body)
        assert answer.status_code == 400, (param, answer.text)
        assert answer.json()["error"]["param"] == param, answer.text
    file_clash = admin(gw, "POST", "/admin/tenants", {"id": "team-a"})
    assert file_clash.status_code == 409 and file_clash.json()["error"]["param"] == "id"
    assert admin(gw, "PATCH", "/admin/tenants/team-a", {"weight": 5}).status_code == 409
    assert admin(gw, "POST", "/admin/tenants/team-a/keys", {}).status_code == 409
    assert admin(gw, "POST", "/admin/tenants", TENANT).status_code == 201
    assert admin(gw, "POST", "/admin/tenants", TENANT).status_code == 409  # id in use
    bad_patch = admin(gw, "PATCH", "/admin/tenants/acme",
                      {"weight": 9, "budgets": [{"tokens": 1, "per": "2x"}]})
    assert bad_patch.status_code == 400 and bad_patch.json()["error"]["param"] == "budgets[0].per"
    assert admin(gw, "GET", "/admin/tenants/acme").json()["weight"] == 3  # nothing applied
    for body, param in [({"colour": "red"}, "colour"), ({"application": "nope"}, "application"),
                        ({"expires_at": 1}, "expires_at"), ({"name": 7}, "name")]:
        answer = admin(gw, "POST", "/admin/tenants/acme/keys", body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert admin(gw, "POST", "/admin/tenants/ghost/keys", {}).status_code == 404
    key = admin(gw, "POST", "/admin/tenants/acme/keys", {}).json()
    bad_grace = admin(gw, "POST", f"/admin/keys/{key['id']}/rotate", {"grace": "soon"})
    assert bad_grace.status_code == 400 and bad_grace.json()["error"]["param"] == "grace"
    assert admin(gw, "DELETE", "/admin/keys/key_unknown").status_code == 404
    assert admin(gw, "GET", "/admin/audit?limit=0").status_code == 400
    # Only the two changes that passed are in the audit.
    assert [r["action"] for r in admin(gw, "GET", "/admin/audit").json()["data"]] == [
        "key.create", "tenant.create"]
    # An expired key: 401.
    soon = admin(gw, "POST", "/admin/tenants/acme/keys", {"expires_at": time.time() + 1.0})
    assert complete(gw, soon.json()["key"]) == 200
    time.sleep(max(0.0, soon.json()["expires_at"] + 1 - time.time()))
    assert complete(gw, soon.json()["key"]) == 401


def test_openai_sdk_and_the_cli(gateway: GatewayProcess) -> None:
    env_cli = [sys.executable, "-m", "tokenpace.cli", "admin", "--url", gateway.url,
               "--admin-key", ADMIN_KEY]

    def cli(*args: str) -> Any:
        done = subprocess.run([*env_cli, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    made = cli("tenants", "create", "sdk-co", "--json", '{"lane": "interactive"}')
    assert made["id"] == "sdk-co" and made["source"] == "api"
    key = cli("keys", "create", "sdk-co", "--name", "laptop")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key["key"], max_retries=0)
    answer = client.completions.create(model="fake", prompt="hi", max_tokens=3)
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == ["fake"]
    assert [k["name"] for k in cli("keys", "list", "sdk-co")["data"]] == ["laptop"]
    new = cli("rotate", key["id"], "--grace", "0s")
    cli("revoke", new["id"])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=new["key"],
                      max_retries=0).models.list()
    actions = [r["action"] for r in cli("audit", "--limit", "10")["data"]]
    assert actions == ["key.revoke", "key.rotate", "key.create", "tenant.create"]
    refused = subprocess.run([*env_cli, "tenants", "create", "sdk-co"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 1 and "409" in refused.stderr


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[Any]:
    from tests._postgres import PostgresServer

    server = PostgresServer()
    try:
        yield server.start()
    finally:
        server.remove()


def test_two_replicas_on_one_postgres_and_its_outage(engine: EngineServer, tmp_path: Path,
                                                     postgres_server: Any) -> None:
    gws = [replica(tmp_path, n, engine, postgres_server.url).start() for n in ("a", "b")]
    a, b = gws
    try:
        lifecycle(a, b)
        kept = admin(a, "POST", "/admin/tenants/acme/keys", {}).json()["key"]
        b.stop()
        b.start()
        assert complete(b, kept) == 200
        # The database down: both replicas serve what they applied; changes answer 503.
        postgres_server.stop()
        assert complete(a, kept) == 200 and complete(b, kept) == 200
        refused = admin(a, "POST", "/admin/tenants/acme/keys", {})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "admin_store_unavailable"
        # The usage API reads the ledger: a 503 to retry, never a page of missing buckets.
        since = int(time.time()) - 3600
        usage = admin(b, "GET", f"/v1/organization/usage/completions?start_time={since}")
        assert usage.status_code == 503, usage.text
        assert usage.json()["error"]["code"] == "ledger_unavailable"
        assert usage.headers["retry-after"] == "5"
        postgres_server.start()
        deadline = time.monotonic() + 20
        while (made := admin(a, "POST", "/admin/tenants/acme/keys", {})).status_code != 201:
            assert made.status_code == 503 and time.monotonic() < deadline, made.text
            time.sleep(0.2)
        until(b, made.json()["key"], 200, bound_s=10)
    finally:
        for gw in gws:
            gw.stop()
