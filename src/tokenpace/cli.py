"""The ``tokenpace`` command line: a table of commands, each owned by one module.

``serve``, ``gateway``, ``up``, ``usage`` and ``admin`` parse their own arguments: the
function named in ``PASS_THROUGH`` gets every argument after the command, untouched
(``serve`` hands vllm's flags on as given). ``tiny-model`` and each ``bench NAME`` are
argparse subcommands: their module declares its flags in ``add_cli_args(parser)`` and runs
in ``main(args)``, which returns the exit status. A module is imported only when its
command runs or prints its help.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

PASS_THROUGH: tuple[tuple[tuple[str, ...], str], ...] = (
    (("serve",), "tokenpace.serve:main"),
    (("gateway",), "tokenpace.gateway.server:main"),
    (("up",), "tokenpace.up:main"),
    (("usage", "reconcile"), "tokenpace.gateway.reconcile:reconcile_main"),
    (("usage",), "tokenpace.gateway.ledger:usage_main"),
    (("admin",), "tokenpace.admin_cli:main"),
)
"""Leading arguments -> ``module:function`` called with the arguments after them; the first
match wins."""

COMMANDS: tuple[tuple[str, str | None, str], ...] = (
    ("serve", None,
     "vLLM's OpenAI server with per-user output pacing (tokenpace serve --help)"),
    ("gateway", None, "the tenant gateway (tokenpace gateway --help)"),
    ("up", None, "paced engines and the gateway together (tokenpace up --help)"),
    ("usage", None, "usage totals from the gateway's ledger (tokenpace usage --help); usage "
     "reconcile: the ledger against the engines"),
    ("admin", None, "tenants, keys and the audit of a running gateway, through its admin "
     "API (tokenpace admin --help)"),
    ("tiny-model", "tokenpace.tiny_model",
     "write a deterministic tiny Llama model that vLLM loads on the CPU"),
)
"""``tokenpace COMMAND``: name, the module owning its parser (None: in ``PASS_THROUGH``),
and its line in ``tokenpace --help``."""

BENCHES: tuple[tuple[str, str], ...] = (
    ("scheduler", "CPU time per step of schedule() + update_from_output(), stock vs paced"),
    ("pacing", "the pacing experiment: measured rates and token gaps on a real server"),
    ("overhead", "output tokens/s of tokenpace serve vs stock vLLM, limits never reached"),
    ("idle", "server CPU while every request is throttled (sync, async, and without idle "
     "wait)"),
    ("gateway", "latency and throughput the gateway adds, against the engine direct"),
    ("fairness", "the VTC paper's workloads through the gateway: FCFS against VTC"),
    ("mix", "short, long-context, long-generation and agent tenants together on a 2-engine "
     "pool: shares, latency and batching under VTC, FCFS, weights and lanes"),
    ("fleet", "a 2-engine pool behind the gateway: against the engines directly, pool "
     "routing against pinned"),
    ("batch", "a large batch (/v1/batches) beside live requests on the same engine: live "
     "TTFT and req/s with and without it, the batch's throughput against the engine alone, "
     "two tenants' batches by weight"),
    ("lanes", "better-priority requests straight at a full engine: tokenpace's lanes "
     "against vLLM's own priority scheduling"),
    ("failover", "an engine of a 2-engine pool killed under load and started again"),
    ("metering", "the usage ledger against the engines' own counts, through gateway "
     "SIGKILLs and a Postgres outage"),
    ("hostile", "one hostile tenant's attacks against another tenant's ordinary requests, "
     "with the gateway's default limits"),
    ("state", "state work per request: Redis (several replicas) against in process"),
    ("tenants", "gateway cost against the number of configured tenants (fast upstream)"),
)
"""``tokenpace bench NAME``, run by ``tokenpace.bench.NAME``, and its line in
``tokenpace bench --help``."""


class _CommandParser(argparse.ArgumentParser):
    """A parser that ``module`` (if given) fills in with ``add_cli_args`` and ``main`` the
    first time it parses or formats its help."""

    def __init__(self, *args: Any, module: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._module = module

    def _fill(self) -> None:
        if self._module is not None:
            module = importlib.import_module(self._module)
            self._module = None
            module.add_cli_args(self)
            self.set_defaults(func=module.main)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._fill()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._fill()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenpace",
        description="Per-user output-token pacing for vLLM, and a fair multi-tenant gateway.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=_CommandParser)
    for name, module, help in COMMANDS:
        sub.add_parser(name, help=help, module=module, add_help=module is not None)
    bench = sub.add_parser("bench", help="measurements against stock vLLM in the same run")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, help in BENCHES:
        benches.add_parser(name, help=help, module=f"tokenpace.bench.{name}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    for prefix, target in PASS_THROUGH:
        if tuple(args_list[:len(prefix)]) == prefix:
            module, _, function = target.partition(":")
            return int(getattr(importlib.import_module(module), function)(args_list[len(prefix):]))
    args = build_parser().parse_args(args_list)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
