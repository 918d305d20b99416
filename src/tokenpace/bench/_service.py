"""Service received per tenant over time, as the VTC paper measures fairness.

Service is counted in the gateway's cost units: ``cost.prompt`` per prompt token, credited
when the request's first token arrives (the prompt is processed then), and
``cost.completion`` per output token, credited when that token arrives. Fairness is judged
only where it is defined: between tenants that are both *backlogged*, i.e. have a request
that was sent and is still waiting for its first token. A tenant asking for less than its
share is not backlogged and is rightly served less; comparing it would measure demand,
not the scheduler.

Pure code over client-side timestamps: no HTTP, no vLLM, so it is tested with made-up
records.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class Request:
    """One request as the client saw it (times in seconds on one monotonic clock)."""

    tenant: str
    sent: float
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list)

    @property
    def first(self) -> float | None:
        return self.token_times[0] if self.token_times else None


@dataclass(frozen=True)
class Windows:
    """Service per tenant in consecutive windows of ``width`` seconds from ``start``."""

    start: float
    width: float
    rates: dict[str, list[float]]  # cost units per second, per window
    backlogged: dict[str, list[float]]  # fraction of each window the tenant was backlogged

    @property
    def count(self) -> int:
        return len(next(iter(self.rates.values()), []))

    def midpoints(self) -> list[float]:
        return [self.start + (i + 0.5) * self.width for i in range(self.count)]


def service_windows(requests: Sequence[Request], tenants: Sequence[str], start: float,
                    end: float, width: float, prompt_cost: float,
                    completion_cost: float) -> Windows:
    """Bucket every tenant's service into windows over ``[start, end)``."""
    if width <= 0 or end <= start:
        raise ValueError("need width > 0 and end > start")
    count = max(1, math.floor((end - start) / width + 1e-9))
    served = {t: [0.0] * count for t in tenants}

    def credit(tenant: str, at: float, amount: float) -> None:
        i = math.floor((at - start) / width)
        if 0 <= i < count:
            served[tenant][i] += amount

    for req in requests:
        if req.tenant not in served or req.first is None:
            continue
        credit(req.tenant, req.first, prompt_cost * req.prompt_tokens)
        for t in req.token_times:
            credit(req.tenant, t, completion_cost)
    rates = {t: [s / width for s in values] for t, values in served.items()}
    backlogged = {}
    for tenant in tenants:
        spans = _merge([(r.sent, r.first if r.first is not None else math.inf)
                        for r in requests if r.tenant == tenant])
        backlogged[tenant] = [
            _covered(spans, start + i * width, start + (i + 1) * width) / width
            for i in range(count)
        ]
    return Windows(start, width, rates, backlogged)


def service_difference(windows: Windows, weights: Mapping[str, float],
                       min_backlogged: float = 0.9) -> dict[str, float | int | None]:
    """Max and mean of the weighted service-rate gap between two tenants, over the windows
    in which both were backlogged at least ``min_backlogged`` of the time.

    Absolute figures are in cost units per second; ``relative`` ones divide each window's
    gap by the two tenants' total service in it (0: equal shares, 1: one got everything).
    """
    a, b = list(weights)
    gaps: list[float] = []
    relative: list[float] = []
    for i in range(windows.count):
        if min(windows.backlogged[a][i], windows.backlogged[b][i]) < min_backlogged:
            continue
        ra, rb = windows.rates[a][i], windows.rates[b][i]
        gap = abs(ra / weights[a] - rb / weights[b])
        gaps.append(gap)
        total = ra / weights[a] + rb / weights[b]
        relative.append(gap / total if total > 0 else 0.0)
    if not gaps:
        return {"windows": 0, "max": None, "mean": None, "max_relative": None,
                "mean_relative": None}
    return {
        "windows": len(gaps),
        "max": max(gaps),
        "mean": statistics.fmean(gaps),
        "max_relative": max(relative),
        "mean_relative": statistics.fmean(relative),
    }


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _covered(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in spans)
