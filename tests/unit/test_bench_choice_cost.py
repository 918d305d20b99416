"""The engine choice's cost per request that ``bench fleet --workload conversations`` reports
runs the dispatcher's real methods in process: it must keep up with their signatures (it is
the last figure of a full run, after minutes of measurement)."""

from __future__ import annotations

from tokenpace.bench.conversations import choice_cost


def test_choice_cost_runs_the_real_choice_on_two_and_eight_engines() -> None:
    for engines in (2, 8):  # the figure itself is the bench's, not bounded here
        assert choice_cost(32, engines) > 0
