"""``tokenpace admin``: each subcommand's HTTP call (the calls themselves run against a
gateway in tests/gateway/test_admin_api_http.py)."""

from __future__ import annotations

import pytest

from tokenpace.admin_cli import build_parser, main, request_of


@pytest.mark.parametrize(("argv", "expected"), [
    (["tenants", "list"], ("GET", "/admin/tenants", None, None)),
    (["tenants", "get", "a b"], ("GET", "/admin/tenants/a%20b", None, None)),
    (["tenants", "create", "acme", "--json", '{"weight": 2}'],
     ("POST", "/admin/tenants", {"weight": 2, "id": "acme"}, None)),
    (["tenants", "update", "acme", "--json", '{"weight": null}'],
     ("PATCH", "/admin/tenants/acme", {"weight": None}, None)),
    (["tenants", "delete", "acme"], ("DELETE", "/admin/tenants/acme", None, None)),
    (["keys", "list", "acme"], ("GET", "/admin/tenants/acme/keys", None, None)),
    (["keys", "create", "acme", "--name", "ci", "--expires-at", "2000000000"],
     ("POST", "/admin/tenants/acme/keys", {"name": "ci", "expires_at": 2e9}, None)),
    (["rotate", "key_1", "--grace", "1h"], ("POST", "/admin/keys/key_1/rotate",
                                            {"grace": "1h"}, None)),
    (["revoke", "key_1"], ("DELETE", "/admin/keys/key_1", None, None)),
    (["audit", "--limit", "5", "--before", "9"], ("GET", "/admin/audit", None,
                                                  {"limit": 5, "before": 9})),
])
def test_each_subcommand_is_one_call(argv: list[str], expected: tuple[object, ...]) -> None:
    assert request_of(build_parser().parse_args(["--admin-key", "k", *argv])) == expected


def test_bad_json_and_a_missing_key_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit, match="not JSON"):
        request_of(build_parser().parse_args(["tenants", "create", "a", "--json", "{"]))
    monkeypatch.delenv("TOKENPACE_ADMIN_KEY", raising=False)
    assert main(["--admin-key", "", "tenants", "list"]) == 2
