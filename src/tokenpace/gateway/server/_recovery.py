"""Requests that were in flight when the process before this one died, recorded.

At start-up the ledger's journal names every request that was sent to an engine and has
no row (``Ledger.orphans``: the earlier process was SIGKILLed, lost its node's power, or
was killed after its grace period). Each is asked of its engine: tokenpace's engine keeps
what its last ended requests generated (``/tokenpace/v1/aborted``; the engine aborted them
when the gateway's connections closed), and the row is written with the engine's counts,
priced at the coefficients the request was admitted with, ``finish_reason:
interrupted``; a request whose HTTP exchange the engine ended before its scheduler had
it (the connection closed while the engine read or tokenized it) generated nothing and is
charged its prompt as admitted. Where the engine cannot tell (plain vLLM, an engine that
restarted or left, or a request it forgot: it keeps its last 65,536), the row journaled at
dispatch is written as it is: the reservation (prompt and ``max_tokens``) as the charge,
marked ``estimated``.

Budgets. The tenant's levels were restored from the last snapshot the earlier process
journaled (every second) or wrote; a request's reservation and settlement are in it or not
by their times. An orphan's reservation is replaced by what it cost (given back in part
when the snapshot holds it, its cost taken when it does not); a request journaled as
dispatched and ended after the snapshot gets its settlement again. With a shared store
(Redis), where levels never left the store, an orphan's reservation is settled there.
The same holds for the request's application's budgets. Not corrected: requests that were
only queued (no dispatch journaled), and those admitted on a prompt's byte bound whose
reservation was corrected after dispatch (off by the bound's slack).

Bound: one call per orphan to its engine, at most ``CONCURRENCY`` at once, each retried
for at most ``ASK_FOR_S``; nothing waits for it (requests are served meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from ...fairness import CostModel
from .. import metrics
from ..exchange import Runtime
from ..ledger import INTERRUPTED, RECORD_COLUMNS, BudgetState, UsageRecord, record_from_row
from ..relay import ask_engine_counts
from ..state import Reservation
from ..wire import POOLING_KINDS

logger = logging.getLogger("tokenpace.gateway")

ASK_FOR_S = 10.0
"""How long an orphan's engine is asked (it may be restarting too)."""
ASK_EVERY_S = 1.0
CONCURRENCY = 16


def snapshot_times(levels: list[BudgetState]) -> dict[str, float]:
    """Owner (a tenant, or an application under its owner name) -> when its restored
    budget levels were saved (the latest of its budgets)."""
    out: dict[str, float] = {}
    for state in levels:
        out[state.tenant] = max(out.get(state.tenant, state.at), state.at)
    return out


def correct_settled(rt: Runtime, settled: list[tuple[dict[str, Any], float, float]],
                    snapshots: dict[str, float]) -> int:
    """Apply to in-process budgets the settlements of requests the journal saw dispatched
    and ended after their tenant's (or application's) restored snapshot; returns how many
    reservations were replaced. O(entries), once at start-up."""
    if rt.store is not None:
        return 0
    applied = 0
    for entry, cost, ended_at in settled:
        applied += _settle_local(rt, entry, cost, ended_at, snapshots)
    return applied


def _holders(rt: Runtime, entry: dict[str, Any]) -> list[tuple[Any, float, bool]]:
    """(the tenant's or application's state, cost it reserved, whether in the shared
    store) for each enforced reservation the entry names and this process still has."""
    tenant = rt.tenants.get(str(entry["open"].get("tenant", "")))
    out: list[tuple[Any, float, bool]] = []
    if tenant is None:
        return out
    holders = entry.get("holders")
    for item in holders if isinstance(holders, list) else ():
        try:
            application, reserved, shared = str(item[0]), float(item[1]), bool(item[2])
        except (TypeError, ValueError, IndexError):
            continue
        level = tenant.applications.get(application) if application else tenant
        if level is not None:
            out.append((level, reserved, shared))
    return out


def _settle_local(rt: Runtime, entry: dict[str, Any], actual: float, ended_at: float | None,
                  snapshots: dict[str, float]) -> int:
    """Replace the entry's in-process reservations by ``actual`` in the levels restored
    from ``snapshots`` (owner -> when saved); returns how many were replaced."""
    try:
        reserved_at = float(entry.get("reserved_at") or 0.0)
    except (TypeError, ValueError):
        return 0
    applied = 0
    for level, reserved, shared in _holders(rt, entry):
        snapshot = snapshots.get(level.owner)
        if shared or (snapshot is not None and ended_at is not None and ended_at <= snapshot):
            continue  # in the store, or reserved and settled before the snapshot
        held = snapshot is not None and reserved_at <= snapshot
        level.settle(reserved if held else 0.0, actual, rt.clock())
        applied += 1
    return applied


async def _settle_orphan(rt: Runtime, entry: dict[str, Any], actual: float,
                         snapshots: dict[str, float]) -> None:
    _settle_local(rt, entry, actual, None, snapshots)
    if rt.store is None:
        return
    for level, reserved, shared in _holders(rt, entry):
        if not shared:
            continue
        try:
            await rt.store.settle(Reservation(level.owner, tuple(level.config.budgets),
                                              reserved, rt.store), actual)
        except Exception as exc:  # the store down: the reservation stays charged
            logger.warning("usage ledger: could not settle request %s's reservation of %r "
                           "in the shared store: %s", entry["open"].get("request_id"),
                           level.owner, exc)


async def recover_in_flight(rt: Runtime, orphans: list[dict[str, Any]],
                            snapshots: dict[str, float] | None = None) -> None:
    """Record every orphan and settle its reservation (see the module's docstring);
    returns when all are recorded."""
    if not orphans:
        return
    snapshots = snapshots or {}
    gate = asyncio.Semaphore(CONCURRENCY)
    counts = {"engine": 0, "estimate": 0}

    async def one(entry: dict[str, Any]) -> None:
        async with gate:
            source = await _recover(rt, entry, snapshots)
        counts[source] += 1
        metrics.LEDGER_RECOVERED.labels(source).inc()

    await asyncio.gather(*(one(e) for e in orphans))
    logger.warning("usage ledger: %d requests in flight when the last process stopped were "
                   "recorded (%d with the engine's counts, %d estimated from their "
                   "reservations)", len(orphans), counts["engine"], counts["estimate"])


def provisional(entry: dict[str, Any]) -> UsageRecord:
    """The row an open journal entry carries (the reservation as the charge)."""
    row = entry["open"]
    return record_from_row(tuple(row.get(c) for c in RECORD_COLUMNS))


def priced(entry: dict[str, Any], prompt: int | None, completion: int) -> UsageRecord:
    """The open entry's row with the engine's counts: ``prompt`` None keeps the entry's
    (the admission's count, or its bound: then still ``estimated``)."""
    rec = provisional(entry)
    coefficients = entry.get("cost") or [1.0, 1.0, 1.0]
    cost = CostModel(float(coefficients[0]), float(coefficients[1]), float(coefficients[2]))
    prompt_tokens = rec.prompt_tokens if prompt is None else prompt
    return replace(rec, prompt_tokens=prompt_tokens, completion_tokens=completion,
                   cost=cost.of(prompt_tokens, completion) if rec.cost else 0.0,
                   finish_reason=INTERRUPTED, estimated=prompt is None and _bounded(entry))


def _bounded(entry: dict[str, Any]) -> bool:
    """Whether the entry's prompt count was the admission's byte bound, not a count."""
    return bool(entry.get("prompt_bound"))


async def _recover(rt: Runtime, entry: dict[str, Any], snapshots: dict[str, float]) -> str:
    rec = provisional(entry)
    kind = str(entry.get("kind", "chat"))
    # An engine keeps no book of pooling requests: their entry's own count stands.
    client = None if kind in POOLING_KINDS else rt.clients.get(str(entry.get("engine", "")))
    answer = None
    if client is not None:
        deadline = time.monotonic() + ASK_FOR_S
        while True:
            answer = await ask_engine_counts(client, kind, rec.request_id, ASK_EVERY_S)
            if answer is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(ASK_EVERY_S)
    if answer is None:
        rec = replace(rec, finish_reason=INTERRUPTED, estimated=True)
        source = "estimate"
    else:
        rec = priced(entry, *answer)
        source = "engine"
    rt.ledger.record(rec)
    await _settle_orphan(rt, entry, rec.cost, snapshots)
    return source
