"""What every `tokenpace bench NAME` shares: argument types, the common flags, the model
directory and the outputs.

A bench module declares its own flags in ``add_cli_args(parser)`` with these helpers, and
its ``main(args)`` ends with :func:`write_outputs`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def int_list(value: str) -> list[int]:
    """An argparse type: comma-separated positive integers."""
    try:
        items = [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}")
    if not items or any(x <= 0 for x in items):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return items


def fraction_list(value: str) -> list[float]:
    """An argparse type: comma-separated numbers in [0, 1]."""
    try:
        items = [float(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {value!r}")
    if not items or any(not 0.0 <= x <= 1.0 for x in items):
        raise argparse.ArgumentTypeError(f"fractions must lie in [0, 1], got {value!r}")
    return items


def _positive(convert: Callable[[str], float], what: str) -> Callable[[str], float]:
    """An argparse type: ``convert(value)`` if it is greater than zero."""

    def parse(value: str) -> float:
        try:
            x = convert(value)
        except ValueError:
            x = 0
        if not x > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {what}, got {value!r}")
        return x

    return parse


positive_int = _positive(int, "integer")
positive_float = _positive(float, "number")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--json``, ``--plot`` and ``--quick``, which every bench takes."""
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: the tiny model in the user cache)")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    parser.add_argument("--plot", metavar="PNG", help="write the plot to PNG (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="a short run, for CI")


def check_gateway_src(src: Path | None, command: str) -> None:
    """Exit with ``command``'s error unless ``--gateway-src`` (if given) holds a tokenpace
    package."""
    if src is not None and not (src / "tokenpace" / "cli.py").is_file():
        raise SystemExit(f"{command}: error: --gateway-src: no tokenpace package "
                         f"in {src} (give the src/ directory of a checkout)")


def default_model_dir() -> Path:
    """Where the benches keep the tiny model: ``$XDG_CACHE_HOME/tokenpace/tiny-model``."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenpace" / "tiny-model"


def bench_model(args: argparse.Namespace) -> Path:
    """``--model``, or the tiny model in the user cache (written there if missing)."""
    from ..tiny_model import write_tiny_model

    if args.model is not None:
        return Path(args.model)
    model = default_model_dir()
    write_tiny_model(model)
    return model


def write_outputs(args: argparse.Namespace, result: dict[str, Any],
                  plot: Callable[[dict[str, Any], Path], None] | None = None) -> int:
    """Write ``result`` to ``--json`` and, with ``plot``, the plot to ``--plot``; 0."""
    from ._environment import write_json

    if args.json:
        write_json(result, Path(args.json))
        print(f"wrote {args.json}")
    if args.plot and plot is not None:
        plot(result, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0
