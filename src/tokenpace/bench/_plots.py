"""matplotlib, headless; an optional dependency (``pip install tokenpace[bench]``)."""

from __future__ import annotations

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
