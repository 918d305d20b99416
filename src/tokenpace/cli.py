"""The ``tokenpace`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from .tiny_model import TinyModelError, write_tiny_model

    try:
        written = write_tiny_model(args.dir, force=args.force)
    except TinyModelError as exc:
        print(f"tokenpace tiny-model: error: {exc}", file=sys.stderr)
        return 2
    print(f"{'wrote' if written else 'up to date:'} tiny model in {args.dir}")
    return 0


def _int_list(value: str) -> list[int]:
    try:
        items = [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}")
    if not items or any(x <= 0 for x in items):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return items


def _fraction_list(value: str) -> list[float]:
    try:
        items = [float(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {value!r}")
    if not items or any(not 0.0 <= x <= 1.0 for x in items):
        raise argparse.ArgumentTypeError(f"fractions must lie in [0, 1], got {value!r}")
    return items


def _default_model_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenpace" / "tiny-model"


def _cmd_bench_scheduler(args: argparse.Namespace) -> int:
    from .bench import scheduler
    from .tiny_model import write_tiny_model

    model = args.model or _default_model_dir()
    if args.model is None:
        write_tiny_model(model)
    if args.quick:
        args.running, args.throttled, args.steps, args.repeats = [64], [0.0, 1.0], 20, 1
    result = scheduler.run(model, args.running, args.throttled, args.steps, args.repeats)
    if args.json:
        scheduler.write_json(result, Path(args.json))
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenpace",
        description="Per-user output-token pacing for vLLM, and a fair multi-tenant gateway.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser(
        "serve",
        help="vLLM's OpenAI server with per-user output pacing (tokenpace serve --help)",
        add_help=False,
    )

    tiny = sub.add_parser(
        "tiny-model",
        help="write a deterministic tiny Llama model that vLLM loads on the CPU",
        description="Write a tiny random-weight Llama model (byte-level BPE tokenizer, chat "
        "template) into DIR. Does nothing if DIR already holds it; refuses a DIR that holds "
        "anything else.",
    )
    tiny.add_argument("dir", metavar="DIR")
    tiny.add_argument("--force", action="store_true", help="rewrite a previous tiny model")
    tiny.set_defaults(func=_cmd_tiny_model)

    bench = sub.add_parser("bench", help="measurements against stock vLLM in the same run")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    sched = bench_sub.add_parser(
        "scheduler",
        help="CPU time per step of schedule() + update_from_output(), stock vs paced",
        description="Times vLLM's real scheduler with R resident decoding requests, stock "
        "and paced, with a fraction of the users throttled.",
    )
    sched.add_argument("--model", type=Path, default=None,
                       help="model directory (default: the tiny model in the user cache)")
    sched.add_argument("--running", type=_int_list, default=[64, 256, 1024],
                       help="resident request counts (default 64,256,1024)")
    sched.add_argument("--throttled", type=_fraction_list, default=[0.0, 0.5, 1.0],
                       help="throttled fractions of users (default 0,0.5,1)")
    sched.add_argument("--steps", type=int, default=200, help="timed steps per run")
    sched.add_argument("--repeats", type=int, default=3, help="alternating runs per case")
    sched.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    sched.add_argument("--quick", action="store_true", help="a few seconds, for CI")
    sched.set_defaults(func=_cmd_bench_scheduler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["serve"]:
        # Not argparse: every vllm serve flag must pass through untouched.
        from . import serve

        return int(serve.main(args_list[1:]))
    parser = build_parser()
    args = parser.parse_args(args_list)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
