"""The ledger against the engines: does every request an engine ended have its row, with
the engine's count?

tokenpace's engine lists every request it ended, in order, with its pacing user and the
tokens it generated (``GET /tokenpace/v1/ended``); the ledger has one row per gateway
request. ``_compare`` sets one against the other, per request and per tenant (pure);
``_books`` reads an engine's book page by page from a cursor; ``_check`` is the check a
gateway runs every ``reconcile_interval`` (``Reconciler``: metrics
``tokenpace_gateway_ledger_unrecorded_tokens``, ``..._overcharged_tokens``,
``..._unrecorded_requests``); ``_cli`` is ``tokenpace usage reconcile``.
"""

from ._books import BookRead, read_book
from ._check import Reconciler
from ._cli import main as reconcile_main, parse_grace
from ._compare import (
    DIFFERS,
    ESTIMATED,
    UNRECORDED,
    Discrepancy,
    EngineEntry,
    EngineRequests,
    Reconciliation,
    TenantDrift,
    compare,
    gateway_id,
    group,
    tenant_of_user,
)

__all__ = [
    "BookRead",
    "DIFFERS",
    "Discrepancy",
    "ESTIMATED",
    "EngineEntry",
    "EngineRequests",
    "Reconciler",
    "Reconciliation",
    "TenantDrift",
    "UNRECORDED",
    "compare",
    "gateway_id",
    "group",
    "parse_grace",
    "read_book",
    "reconcile_main",
    "tenant_of_user",
]
