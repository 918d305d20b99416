"""The cost model's arithmetic: cached prompt tokens priced apart, clamped, validated."""

from __future__ import annotations

import math

import pytest

from tokenpace.fairness import CostModel


def test_cached_prompt_defaults_to_the_prompt_coefficient() -> None:
    cost = CostModel(2.0, 3.0)
    assert cost.cached_prompt == 2.0
    # Nothing changes unless cached_prompt is configured: a hit costs what a miss costs.
    assert cost.of(100, 10, cached_tokens=80) == cost.of(100, 10) == 230.0
    assert cost.cache_credit(100, 80) == 0.0
    assert CostModel(2.0, 3.0) == CostModel(2.0, 3.0, 2.0)


def test_cached_tokens_are_priced_at_the_cached_coefficient() -> None:
    cost = CostModel(prompt=1.0, completion=4.0, cached_prompt=0.1)
    # 100 prompt tokens of which 64 cached, 5 generated: 36 x 1 + 64 x 0.1 + 5 x 4.
    assert math.isclose(cost.of(100, 5, cached_tokens=64), 36 + 6.4 + 20)
    # The credit turns a full-prompt charge into the discounted one.
    assert math.isclose(cost.of(100, 5) - cost.cache_credit(100, 64),
                        cost.of(100, 5, cached_tokens=64))


def test_cached_count_is_clamped_to_the_prompt() -> None:
    cost = CostModel(prompt=1.0, completion=1.0, cached_prompt=0.0)
    assert cost.of(10, 0, cached_tokens=50) == 0.0  # never more cached than the prompt
    assert cost.of(10, 0, cached_tokens=-5) == 10.0  # a negative count is no count
    assert cost.cache_credit(10, 50) == 10.0
    assert cost.of(0, 3, cached_tokens=4) == 3.0


def test_a_cached_coefficient_above_the_prompt_is_allowed() -> None:
    # Documented: an operator may price cache reuse higher; the credit is then negative.
    cost = CostModel(prompt=1.0, completion=1.0, cached_prompt=2.0)
    assert cost.of(10, 0, cached_tokens=10) == 20.0
    assert cost.cache_credit(10, 10) == -10.0


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan, True, "0.5"])
def test_cached_prompt_must_be_a_number_at_least_zero(bad: object) -> None:
    with pytest.raises(ValueError, match="cost.cached_prompt"):
        CostModel(1.0, 1.0, bad)  # type: ignore[arg-type]
