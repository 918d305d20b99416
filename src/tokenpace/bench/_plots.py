"""matplotlib, headless; an optional dependency (``pip install tokenpace[bench]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "plots need matplotlib: pip install 'tokenpace[bench]' (or pass --no-plot)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    """Lay out, write the PNG and free the figure (pyplot keeps every open one)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
