"""``tokenpace usage``: totals from the gateway's usage ledger.

``prompt_tokens`` counts served requests only, as the gateway's metrics do;
``unserved_prompt_tokens`` is the counted prompt size of requests that never ran (refused,
cancelled while queued, engine error), kept apart so neither total hides in the other.
``cached_prompt_tokens`` is the part of ``prompt_tokens`` the engines found in their prefix
cache (charged at ``cost.cached_prompt``; 0 where the engine did not report it).
``estimated_rows`` counts the rows whose token counts are the gateway's estimate rather
than the engine's (a request that died in flight on an engine that could not say what it
generated): how much of the totals rests on an estimate.

Reads the same ledger the gateway writes (SQLite in WAL mode can be read while the gateway
runs). Given the gateway's config file it uses that file's ``ledger:`` key and nothing
else, so it works even where the rest of the config refers to keys or engines this machine
does not have.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ._open import open_ledger
from ._records import LedgerError, UsageTotal
from ._url import parse_ledger_url, resolve_ledger_url

__all__ = ["DEFAULT_LEDGER_URL", "format_table", "main", "parse_since",
           "resolve_ledger_url"]

DEFAULT_LEDGER_URL = "sqlite:///tokenpace-usage.db"
"""The ledger when the config has no ``ledger:`` key; relative to the config's directory."""

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(value: str, now: float | None = None) -> float:
    """Unix time from an ISO-8601 date or date-time (naive means UTC) or from a duration
    ago such as ``90s``, ``15m``, ``2h``, ``7d``."""
    text = value.strip()
    match = _DURATION.fullmatch(text)
    if match:
        ago = float(match.group(1)) * _UNIT_S[match.group(2)]
        return (time.time() if now is None else now) - ago
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"expected an ISO-8601 date or time (2026-11-29, 2026-11-29T10:00:00Z) "
            f"or a duration ago (90s, 15m, 2h, 7d), got {value!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _since_arg(value: str) -> float:
    try:
        return parse_since(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ledger_arg(value: str) -> str:
    try:
        parse_ledger_url(value)
    except LedgerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def ledger_url_from_config(config: Path) -> str:
    """The resolved ``ledger:`` URL of a gateway config file, read without validating the
    rest of the file. Raises :class:`LedgerError` if the file cannot be read."""
    import yaml

    try:
        data = yaml.safe_load(config.read_text())
    except OSError as exc:
        raise LedgerError(f"cannot read {config}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise LedgerError(f"{config} is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise LedgerError(f"{config}: expected a mapping at the top level")
    url = data.get("ledger", DEFAULT_LEDGER_URL)
    if not isinstance(url, str):
        raise LedgerError(f"{config}: ledger must be a URL string, got {type(url).__name__}")
    url = resolve_ledger_url(url, config.parent)
    try:
        parse_ledger_url(url)
    except LedgerError as exc:
        raise LedgerError(f"{config}: {exc}") from None
    return url


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenpace usage",
        description="Print request and token totals from the gateway's usage ledger.",
        epilog="tokenpace usage reconcile --config gateway.yaml compares the ledger with "
        "what the engines generated (tokenpace usage reconcile --help).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--config", type=Path, help="gateway config file; only its ledger: key is read"
    )
    source.add_argument(
        "--ledger", type=_ledger_arg, help="ledger URL (sqlite:///... or postgresql://...)"
    )
    parser.add_argument(
        "--since",
        type=_since_arg,
        metavar="T",
        help="only requests that ended at or after T: an ISO-8601 date or time (naive = UTC), "
        "or a duration ago: 90s, 15m, 2h, 7d",
    )
    parser.add_argument(
        "--by",
        choices=("tenant", "model", "lane", "route", "application"),
        default="tenant",
        help="application: one row per (tenant, application), the tenant's own keys "
        "in a row of their own",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    return parser


def _number(value: float) -> str:
    """Costs without float noise: up to six decimals, trailing zeros dropped."""
    if not math.isfinite(value):
        return str(value)
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def _label_columns(by: str) -> list[str]:
    """The columns that name a row: ``by``, or tenant and application, since an application
    id is unique only inside its tenant (and either id may contain ``/``, so joining them
    into one name could make two pairs look alike)."""
    return ["tenant", "application"] if by == "application" else [by]


def _labels(t: UsageTotal) -> list[str]:
    """A total's values for :func:`_label_columns`; ``t.tenant`` is set by application only."""
    return [t.key] if t.tenant is None else [t.tenant, t.key]


def _table(totals: list[UsageTotal], by: str) -> str:
    labels = _label_columns(by)
    header = [*labels, "requests", "rejected", "prompt_tokens", "cached_prompt_tokens",
              "completion_tokens", "cost", "unserved_prompt_tokens", "estimated_rows"]
    lines: list[list[str]] = []
    for t in totals:
        lines.append(
            [
                # No tenant: rejected before authentication; no application: a tenant key.
                *(name or "(none)" for name in _labels(t)),
                str(t.requests),
                str(t.rejected),
                str(t.prompt_tokens),
                str(t.cached_prompt_tokens),
                str(t.completion_tokens),
                _number(t.cost),
                str(t.unserved_prompt_tokens),
                str(t.estimated_rows),
            ]
        )
    total = [
        "total",
        *[""] * (len(labels) - 1),
        str(sum(t.requests for t in totals)),
        str(sum(t.rejected for t in totals)),
        str(sum(t.prompt_tokens for t in totals)),
        str(sum(t.cached_prompt_tokens for t in totals)),
        str(sum(t.completion_tokens for t in totals)),
        _number(sum(t.cost for t in totals)),
        str(sum(t.unserved_prompt_tokens for t in totals)),
        str(sum(t.estimated_rows for t in totals)),
    ]
    return format_table(header, lines, total, names=len(labels))


def format_table(header: list[str], lines: list[list[str]], total: list[str] | None = None,
                 names: int = 1) -> str:
    """A text table: the first ``names`` columns left-aligned, the others (numbers)
    right-aligned, and ``total`` under a rule when given."""
    every = [header, *lines, *([total] if total is not None else [])]
    widths = [max(len(row[i]) for row in every) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        cells = [c.ljust(w) for c, w in zip(row[:names], widths[:names])]
        cells += [c.rjust(w) for c, w in zip(row[names:], widths[names:])]
        return "  ".join(cells).rstrip()

    out = [fmt(header), *(fmt(row) for row in lines)]
    if total is not None:
        out += ["  ".join("-" * w for w in widths), fmt(total)]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """Run ``tokenpace usage`` with ``argv`` (the arguments after ``usage``).

    Returns the exit status: 0, 1 when the ledger cannot be read, 2 for bad arguments
    (argparse's own exit status, returned rather than raised).
    """
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2

    try:
        url = ledger_url_from_config(args.config) if args.config is not None else args.ledger
        # create=False: a mistyped path must be an error, not a new empty ledger.
        ledger = open_ledger(url, create=False)
    except LedgerError as exc:
        print(f"tokenpace usage: error: {exc}", file=sys.stderr)
        return 1
    try:
        totals = ledger.usage(since=args.since, by=args.by)
    except LedgerError as exc:
        print(f"tokenpace usage: error: {exc}", file=sys.stderr)
        return 1
    finally:
        ledger.close()

    if args.json:
        items: list[dict[str, Any]] = [
            {
                **dict(zip(_label_columns(args.by), _labels(t))),
                "requests": t.requests,
                "rejected": t.rejected,
                "prompt_tokens": t.prompt_tokens,
                "cached_prompt_tokens": t.cached_prompt_tokens,
                "completion_tokens": t.completion_tokens,
                "cost": t.cost,
                "unserved_prompt_tokens": t.unserved_prompt_tokens,
                "estimated_rows": t.estimated_rows,
            }
            for t in totals
        ]
        print(json.dumps(items, indent=2))
    else:
        print(_table(totals, args.by))
    return 0
