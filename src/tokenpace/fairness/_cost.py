"""The service cost of a request, in cost units:
``prompt x uncached prompt tokens + cached_prompt x cached prompt tokens + completion x
completion tokens``.

Budgets and the fair queue count in these units rather than in requests, because one long
generation can cost as much engine time as a hundred short answers. The coefficients are
the operator's approximation of relative cost, not a price list.

Prompt tokens the engine found in its prefix cache were not computed again, so they may
be priced apart (``cached_prompt``, as OpenAI bills cached input at a discount). It
defaults to the prompt coefficient: nothing changes unless it is configured. Any value
>= 0 is accepted, also one above ``prompt`` (an operator who wants to discourage reuse of
a shared cache may say so); docs/gateway/admission.md says what each choice does. Whether a prompt
hit the cache is known only after the engine ran it, so a reservation prices the whole
prompt at ``prompt`` and the settlement applies the cached price (``gateway.exchange``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    prompt: float = 1.0
    completion: float = 1.0
    cached_prompt: float | None = None  # None: the prompt coefficient (set in __post_init__)

    def __post_init__(self) -> None:
        if self.cached_prompt is None:
            object.__setattr__(self, "cached_prompt", self.prompt)
        for name in ("prompt", "completion", "cached_prompt"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost.{name} must be a number >= 0, got {value!r}")

    def of(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        """The cost of a request; ``cached_tokens`` of its ``prompt_tokens`` came from the
        prefix cache (clamped to [0, prompt_tokens]: an engine's count is not trusted to
        make a cost negative or to price more tokens than the prompt had)."""
        cached = cached_part(prompt_tokens, cached_tokens)
        return (self.prompt * (prompt_tokens - cached) + self.cached_price * cached
                + self.completion * completion_tokens)

    def cache_credit(self, prompt_tokens: int, cached_tokens: int) -> float:
        """What a cache hit takes off a prompt charged in full: ``(prompt - cached_prompt)
        x cached tokens`` (negative when ``cached_prompt`` is the higher)."""
        return (self.prompt - self.cached_price) * cached_part(prompt_tokens, cached_tokens)

    @property
    def cached_price(self) -> float:
        """``cached_prompt`` as a float for the type checker (never None after init)."""
        assert self.cached_prompt is not None
        return self.cached_prompt


def cached_part(prompt_tokens: int, cached_tokens: int) -> int:
    """``cached_tokens`` clamped to [0, ``prompt_tokens``]."""
    return min(max(cached_tokens, 0), max(prompt_tokens, 0))
