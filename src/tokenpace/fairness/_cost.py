"""The service cost of a request: ``prompt x prompt_tokens + completion x completion_tokens``.

Budgets and (later) the fair queue count in these units rather than in requests, because
one long generation can cost as much engine time as a hundred short answers. The
coefficients are the operator's approximation of relative cost, not a price list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    prompt: float = 1.0
    completion: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prompt", "completion"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost.{name} must be a number >= 0, got {value!r}")

    def of(self, prompt_tokens: int, completion_tokens: int) -> float:
        return self.prompt * prompt_tokens + self.completion * completion_tokens
