"""``tokenpace admin``: the gateway's admin API (tenants, keys, audit) from a shell.

Every subcommand is one HTTP call to a running gateway (``--url``, or ``TOKENPACE_URL``)
with an admin key (``--admin-key``, or ``TOKENPACE_ADMIN_KEY``); the answer's JSON is
printed on stdout. A refusal prints the gateway's error on stderr and exits 1; a gateway
that cannot be reached exits 2.

    tokenpace admin tenants list | get ID | delete ID
    tokenpace admin tenants create ID [--json BODY]      # BODY: the tenant's fields
    tokenpace admin tenants update ID --json BODY
    tokenpace admin keys list TENANT
    tokenpace admin keys create TENANT [--name N] [--application A] [--expires-at UNIX]
    tokenpace admin rotate KEY_ID [--grace 60s]
    tokenpace admin revoke KEY_ID
    tokenpace admin audit [--limit N] [--before ID]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import httpx

TIMEOUT_S = 30.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenpace admin",
        description="Tenants, keys and the audit of a running gateway, through its admin API.")
    parser.add_argument("--url", default=os.environ.get("TOKENPACE_URL", "http://127.0.0.1:8000"),
                        help="the gateway (default $TOKENPACE_URL or http://127.0.0.1:8000)")
    parser.add_argument("--admin-key", default=os.environ.get("TOKENPACE_ADMIN_KEY"),
                        help="one of the gateway's admin_api_keys (default "
                             "$TOKENPACE_ADMIN_KEY)")
    sub = parser.add_subparsers(dest="command", required=True)

    tenants = sub.add_parser("tenants", help="list, show, create, update, delete tenants")
    tsub = tenants.add_subparsers(dest="action", required=True)
    tsub.add_parser("list", help="every tenant (the file's and the API's)")
    for action in ("get", "delete"):
        tsub.add_parser(action, help=f"{action} one tenant").add_argument("id")
    for action, required in (("create", False), ("update", True)):
        p = tsub.add_parser(action, help=f"{action} an API tenant")
        p.add_argument("id")
        p.add_argument("--json", dest="body", required=required, default="{}",
                       help="the tenant's fields as JSON, as in the configuration file "
                            "(lane, weight, budgets, ...; no api_keys)")

    keys = sub.add_parser("keys", help="list or create a tenant's keys")
    ksub = keys.add_subparsers(dest="action", required=True)
    ksub.add_parser("list", help="a tenant's keys (never the secrets)").add_argument("tenant")
    create = ksub.add_parser("create", help="a new key; its secret is printed this once")
    create.add_argument("tenant")
    create.add_argument("--name")
    create.add_argument("--application")
    create.add_argument("--expires-at", type=float, metavar="UNIX",
                        help="when it stops working (unix seconds)")

    rotate = sub.add_parser("rotate", help="a new key in place of KEY_ID")
    rotate.add_argument("key_id")
    rotate.add_argument("--grace", default="0s",
                        help="how long the old key keeps working (e.g. 60s, 1h; default 0s)")
    sub.add_parser("revoke", help="a key stops working on every replica").add_argument("key_id")
    audit = sub.add_parser("audit", help="the changes, newest first")
    audit.add_argument("--limit", type=int, default=100)
    audit.add_argument("--before", type=int, help="only changes older than this id")
    return parser


def request_of(args: argparse.Namespace) -> tuple[str, str, Any, dict[str, Any] | None]:
    """(method, path, JSON body or None, query) of the parsed command."""
    q = lambda s: quote(s, safe="")  # noqa: E731
    if args.command == "tenants":
        if args.action == "list":
            return "GET", "/admin/tenants", None, None
        if args.action == "get":
            return "GET", f"/admin/tenants/{q(args.id)}", None, None
        if args.action == "delete":
            return "DELETE", f"/admin/tenants/{q(args.id)}", None, None
        try:
            body = json.loads(args.body)
        except ValueError as exc:
            raise SystemExit(f"tokenpace admin: --json: not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise SystemExit("tokenpace admin: --json: expected a JSON object")
        if args.action == "create":
            return "POST", "/admin/tenants", {**body, "id": args.id}, None
        return "PATCH", f"/admin/tenants/{q(args.id)}", body, None
    if args.command == "keys":
        if args.action == "list":
            return "GET", f"/admin/tenants/{q(args.tenant)}/keys", None, None
        body = {k: v for k, v in (("name", args.name), ("application", args.application),
                                  ("expires_at", args.expires_at)) if v is not None}
        return "POST", f"/admin/tenants/{q(args.tenant)}/keys", body, None
    if args.command == "rotate":
        return "POST", f"/admin/keys/{q(args.key_id)}/rotate", {"grace": args.grace}, None
    if args.command == "revoke":
        return "DELETE", f"/admin/keys/{q(args.key_id)}", None, None
    query = {"limit": args.limit, **({"before": args.before} if args.before else {})}
    return "GET", "/admin/audit", None, query


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.admin_key:
        print("tokenpace admin: an admin key is needed (--admin-key or TOKENPACE_ADMIN_KEY)",
              file=sys.stderr)
        return 2
    method, path, body, query = request_of(args)
    try:
        answer = httpx.request(method, args.url.rstrip("/") + path, json=body, params=query,
                               headers={"authorization": f"Bearer {args.admin_key}"},
                               timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        print(f"tokenpace admin: {args.url}: {exc}", file=sys.stderr)
        return 2
    try:
        shown: Any = answer.json()
    except ValueError:
        shown = answer.text
    text = json.dumps(shown, indent=2) if not isinstance(shown, str) else shown
    if answer.status_code >= 400:
        print(f"tokenpace admin: HTTP {answer.status_code}: {text}", file=sys.stderr)
        return 1
    print(text)
    return 0
