"""The scheduler simulation lives in the package (the benchmark uses it too)."""

from tokenpace.bench._simulate import NS, FakeClock, Sim, make_sim, max_in_window

__all__ = ["NS", "FakeClock", "Sim", "make_sim", "max_in_window"]
