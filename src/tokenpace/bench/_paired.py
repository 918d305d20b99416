"""Paired comparisons of paths to one engine: run them in pairs (one call per path, the
order changing from pair to pair), compare within each pair.

On a small shared machine the engine's own latency moves in phases (tens of requests at
one level, then tens at another: CPU contention, the engine's idle naps), shared by both
paths. Comparing the medians of two independent distributions then measures the phases,
and can even give a proxy a negative cost. Within one pair both calls meet the same phase,
so the pair's difference (or ratio) keeps the proxy's cost and drops most of the machine's.
The order within a pair changes from pair to pair, so whatever an earlier call leaves
behind (a warm engine, a busy one) falls on each path equally often. A "pair" of three
paths (direct, gateway, gateway with Redis) is three calls, compared two by two.

Pure code (no HTTP): the calls are injected, so it is tested with fake ones.
"""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def pair_order(names: Sequence[str], index: int) -> list[str]:
    """The order of the calls in pair ``index``: every ordering of ``names`` in turn.

    Two paths: as given for even pairs, reversed for odd. Three: the 6 orderings, so over
    each 6 pairs every path is first, second and last twice and comes before each other
    path 3 times (reversing alone would leave the middle path always in the middle).
    Four or more: rotations (each path first once every ``len(names)`` pairs; a few rounds
    of the 24 orderings of four would put the same path first every time), reversed every
    other cycle.
    """
    if len(names) >= 4:
        k = index % len(names)
        order = list(names[k:]) + list(names[:k])
        return order[::-1] if (index // len(names)) % 2 else order
    orders = list(itertools.permutations(names))
    return list(orders[index % len(orders)])


async def run_pairs(calls: Mapping[str, Callable[[int], Awaitable[T]]],
                    pairs: int) -> dict[str, list[T]]:
    """Call each path once per pair, one after the other, the order per ``pair_order``.

    Each call gets the pair's index, so both calls of a pair can send the same work (the
    same prompt). Results are per path, in pair order: ``out[a][i]`` and ``out[b][i]`` are
    the two halves of pair ``i``.
    """
    out: dict[str, list[T]] = {name: [] for name in calls}
    for i in range(pairs):
        for name in pair_order(list(calls), i):
            out[name].append(await calls[name](i))
    return out


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile, ``q`` in [0, 100] (the same rule as ``_load.percentile``)."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def bootstrap_interval(samples: Sequence[Any], statistic: Callable[[Sequence[Any]], float],
                       resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of ``statistic`` over ``samples`` (resampled
    whole: pass pairs to keep the pairing). Seeded, so a result file can be reproduced."""
    if len(samples) < 2:
        value = statistic(samples)
        return value, value
    rng = random.Random(seed)
    stats = sorted(statistic(rng.choices(samples, k=len(samples))) for _ in range(resamples))
    return stats[int(0.025 * resamples)], stats[int(0.975 * resamples) - 1]


def paired_differences(treated: Sequence[float], control: Sequence[float]) -> list[float]:
    """``treated[i] - control[i]`` for each pair."""
    if len(treated) != len(control):
        raise ValueError(f"unpaired: {len(treated)} against {len(control)} values")
    return [t - c for t, c in zip(treated, control)]


def paired_ratios(treated: Sequence[float], control: Sequence[float]) -> list[float]:
    """``treated[i] / control[i]`` for each pair."""
    if len(treated) != len(control):
        raise ValueError(f"unpaired: {len(treated)} against {len(control)} values")
    return [t / c for t, c in zip(treated, control)]


def _with_interval(samples: Sequence[Any], statistic: Callable[[Sequence[Any]], float],
                   digits: int) -> dict[str, Any]:
    low, high = bootstrap_interval(samples, statistic)
    return {"value": round(statistic(samples), digits),
            "interval95": [round(low, digits), round(high, digits)]}


def difference_summary(treated: Sequence[float], control: Sequence[float],
                       digits: int = 3) -> dict[str, Any]:
    """What ``treated`` adds to ``control``, pair by pair.

    - ``p50``, ``p99``: quantiles of the per-pair differences, each with its bootstrap
      interval. ``p1`` is their mirror: the machine's own noise moves a difference both
      ways, so a ``p99`` no larger than ``-p1`` is noise, not cost.
    - ``p99_shift``: ``p99(treated) - p99(control)``, bootstrapped over pairs: how much
      the tail itself moved, which a phase change inside a few pairs does not dominate.
    """
    diffs = paired_differences(treated, control)
    pairs = list(zip(treated, control))
    return {
        "pairs": len(diffs),
        "p50": _with_interval(diffs, lambda d: statistics.median(d), digits),
        "p99": _with_interval(diffs, lambda d: quantile(d, 99), digits),
        "p1": round(quantile(diffs, 1), digits),
        "p99_shift": _with_interval(
            pairs, lambda p: quantile([t for t, _ in p], 99) - quantile([c for _, c in p], 99),
            digits),
        "values": [round(d, digits) for d in diffs],
    }


def ratio_summary(treated: Sequence[float], control: Sequence[float],
                  digits: int = 3) -> dict[str, Any]:
    """Median of the per-pair ratios ``treated / control``, with its bootstrap interval."""
    ratios = paired_ratios(treated, control)
    low, high = bootstrap_interval(ratios, lambda r: statistics.median(r))
    return {"pairs": len(ratios), "median": round(statistics.median(ratios), digits),
            "interval95": [round(low, digits), round(high, digits)],
            "values": [round(r, digits) for r in ratios]}
