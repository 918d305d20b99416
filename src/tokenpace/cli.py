"""The ``tokenpace`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from .tiny_model import TinyModelError, write_tiny_model

    try:
        written = write_tiny_model(args.dir, force=args.force)
    except TinyModelError as exc:
        print(f"tokenpace tiny-model: error: {exc}", file=sys.stderr)
        return 2
    print(f"{'wrote' if written else 'up to date:'} tiny model in {args.dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenpace",
        description="Per-user output-token pacing for vLLM, and a fair multi-tenant gateway.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
