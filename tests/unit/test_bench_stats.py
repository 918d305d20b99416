"""The overhead benchmark's interval for its median ratio."""

from __future__ import annotations

import statistics

from tokenpace.bench.overhead import median_interval


def test_identical_runs_give_no_uncertainty() -> None:
    assert median_interval([0.97] * 8) == (0.97, 0.97)


def test_the_interval_holds_the_median_and_narrows_with_more_runs() -> None:
    spread = [0.82, 0.86, 0.87, 0.89, 0.9, 0.99, 1.0, 1.03, 1.12, 1.27, 1.41, 1.42]
    low, high = median_interval(spread)
    assert low <= statistics.median(spread) <= high
    assert min(spread) <= low and high <= max(spread)
    more = spread * 5  # the same spread, five times the runs: the median is better known
    m_low, m_high = median_interval(more)
    assert high - low > m_high - m_low


def test_the_interval_is_reproducible() -> None:
    values = [1.0, 0.9, 1.1, 0.95, 1.05]
    assert median_interval(values) == median_interval(values)
