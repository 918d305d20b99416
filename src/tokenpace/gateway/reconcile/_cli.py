"""``tokenpace usage reconcile``: the ledger against the engines' books, per tenant.

Asks each engine of the gateway's configuration (with its ``api_key``) for the requests
it ended (``GET /tokenpace/v1/ended``, ``_books``), reads the ledger rows of those
requests, and prints per tenant the engines' output tokens, the ledger's, the drift
(ledger minus engines), the requests without a row and the rows that differ, then each
request at fault (``_compare``). Exit status: 0 no drift, 1 drift (a request without a
row, or a row whose tokens differ: for a cron), 2 bad arguments, 3 nothing could be
checked (the configuration or the ledger cannot be read, or no engine answered).

What it cannot see, said in its output: requests older than the engines' books (each
engine keeps its last 65,536 ended requests, per data-parallel rank), engines that are
not tokenpace's (plain vLLM keeps no book: 404) or do not answer, requests sent to an
engine directly (no gateway id), rows of requests no engine lists, and requests not due
yet (ended within ``--grace``; without a row and possibly still running, within
``request_timeout`` and the grace).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from ..config import APPLICATION_SEPARATOR, ConfigError, GatewayConfig, load_config
from ..fleet import Discovery
from ..ledger import LedgerError, format_table, open_ledger, parse_since
from ._books import TIMEOUT_S, BookRead, read_book
from ._compare import Reconciliation, compare, group

SHOWN = 50
"""Requests at fault listed in the table output at most (``--json`` lists all)."""

_GRACE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)?")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_grace(text: str) -> float:
    """Seconds from ``30s``, ``2m``, ``500ms``, ``0`` (a number alone: seconds)."""
    match = _GRACE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"expected a duration such as 30s, 2m or 0, got {text!r}")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _arg(parse: Any) -> Any:
    def check(value: str) -> Any:
        try:
            return parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return check


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenpace usage reconcile",
        description="Compare the usage ledger with what the engines generated, per request, "
        "and print the drift per tenant. Exit status: 0 no drift, 1 drift, 2 bad "
        "arguments, 3 nothing could be checked.")
    parser.add_argument("--config", type=Path, required=True,
                        help="gateway config file: its engines (and their api_key), its "
                        "ledger, its request_timeout")
    parser.add_argument("--since", type=_arg(parse_since), metavar="T",
                        help="only requests the engines ended at or after T: an ISO-8601 "
                        "date or time (naive = UTC), or a duration ago: 90s, 15m, 2h, 7d "
                        "(default: all the engines' books hold)")
    parser.add_argument("--grace", type=_arg(parse_grace), default=None, metavar="D",
                        help="requests that ended less than D ago are not compared yet: "
                        "their rows may be on their way (default: the config's "
                        "reconcile_grace, 30s unless set)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return parser


@dataclass
class Report:
    """One reconciliation: what each engine's book gave, and the comparison."""

    reads: list[BookRead]
    result: Reconciliation
    other: int  # engine requests without a gateway id
    since: float | None

    @property
    def checked(self) -> bool:
        return any(r.problem is None for r in self.reads)


async def _read_all(config: GatewayConfig) -> list[BookRead]:
    engines = await Discovery().engines(config.engines)

    async def one(url: str, headers: dict[str, str]) -> BookRead:
        async with httpx.AsyncClient(base_url=url, headers=headers,
                                     timeout=TIMEOUT_S) as client:
            return await read_book(client, url, None, max_pages=1_000)

    return list(await asyncio.gather(*(one(e.url, e.auth_headers()) for e in engines)))


def reconcile(config: GatewayConfig, since: float | None, grace_s: float,
              now: float | None = None) -> Report:
    """Read the engines' books and the ledger's rows of their requests, and compare.
    Raises ``LedgerError`` when the ledger cannot be read."""
    reads = asyncio.run(_read_all(config))
    entries = [e for r in reads for e in r.entries if since is None or e.ended_at >= since]
    requests, other = group(entries)
    ledger = open_ledger(config.ledger, create=False)
    try:
        rows = ledger.rows_of(list(requests))
    finally:
        ledger.close()
    result = compare(requests, rows, now=time.time() if now is None else now,
                     grace_s=grace_s, hold_s=config.request_timeout_s + grace_s,
                     tenant_of=lambda user: user.partition(APPLICATION_SEPARATOR)[0])
    return Report(reads, result, other, since)


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _engine_notes(report: Report) -> list[dict[str, Any]]:
    """Per engine: what was read, and what it could not show."""
    notes = []
    for read in report.reads:
        note: dict[str, Any] = {"engine": read.engine, "requests": len(read.entries)}
        if read.problem is not None:
            note["problem"] = read.problem
        elif read.full and read.entries:
            first = min(e.ended_at for e in read.entries)
            if report.since is None or report.since < first:
                note["forgotten_before"] = first  # its book holds nothing older
        if not read.complete:
            note["incomplete"] = True
        notes.append(note)
    return notes


def _json(report: Report) -> str:
    result = report.result
    return json.dumps({
        "drift": result.drifted,
        "tenants": [{**asdict(t), "drift": t.drift} for t in
                    sorted(result.tenants.values(), key=lambda t: t.tenant)],
        "requests": [asdict(d) for d in result.discrepancies],
        "engines": _engine_notes(report),
        "pending": len(result.pending),
        "other": report.other,
    }, indent=2)


def _text(report: Report) -> str:
    result = report.result
    tenants = sorted(result.tenants.values(), key=lambda t: t.tenant)
    columns = ("requests", "engine_tokens", "ledger_tokens", "drift", "unrecorded_requests",
               "differing_rows", "estimated_rows")
    lines = [[t.tenant or "(none)", *(str(getattr(t, c)) for c in columns)] for t in tenants]
    total = ["total", *(str(sum(getattr(t, c) for t in tenants)) for c in columns)]
    out = [format_table(["tenant", *columns], lines, total)]
    if result.discrepancies:
        shown = result.discrepancies[:SHOWN]
        out += ["", format_table(
            ["request_id", "tenant", "kind", "engine_tokens", "ledger_tokens", "ended_at"],
            [[d.request_id, d.tenant or "(none)", d.kind + (" (estimated)" if d.estimated
                                                             and d.kind != "estimated" else ""),
              str(d.engine_tokens), "-" if d.ledger_tokens is None else str(d.ledger_tokens),
              _when(d.ended_at)] for d in shown], names=3)]
        if len(result.discrepancies) > SHOWN:
            out.append(f"... and {len(result.discrepancies) - SHOWN} more (--json lists all)")
    out += ["", "engines:"]
    for note in _engine_notes(report):
        text = f"  {note['engine']}: "
        if "problem" in note:
            text += f"not compared: {note['problem']}"
        else:
            text += f"{note['requests']} ended requests read"
            if "forgotten_before" in note:
                text += (f"; requests it ended before {_when(note['forgotten_before'])} "
                         "are no longer in its book (it keeps its last 65,536)")
            if note.get("incomplete"):
                text += "; more than could be read in one run (run again)"
        out.append(text)
    out.append(f"not compared: {len(result.pending)} requests not due yet (ended within "
               "the grace, or without a row and possibly still running); "
               f"{report.other} engine requests sent without a gateway; rows of requests "
               "no engine's book lists")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """Run ``tokenpace usage reconcile`` with ``argv`` (the arguments after ``reconcile``)
    and return its exit status (see the module)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        config = load_config(args.config)
        grace_s = config.reconcile_grace_s if args.grace is None else args.grace
        report = reconcile(config, args.since, grace_s)
    except (ConfigError, LedgerError) as exc:
        print(f"tokenpace usage reconcile: error: {exc}", file=sys.stderr)
        return 3
    print(_json(report) if args.json else _text(report))
    if not report.checked:
        print("tokenpace usage reconcile: error: no engine's book could be read",
              file=sys.stderr)
        return 3
    return 1 if report.result.drifted else 0
