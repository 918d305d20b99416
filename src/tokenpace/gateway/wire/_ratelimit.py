"""OpenAI's rate-limit headers: on a refusal (429) and on every admitted response.

A client that paces itself (OpenAI's cookbook, LangChain's and many SDK users' retry
logic) reads ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``: the limit, what is
left of it and how long until it is whole again. A tenant (and its application) may have
several budgets and request limits; a response reports the one with the least left, which
is the one the client must respect. Limits in observe mode refuse nothing and are not
reported. Without a limit of a kind no header of that kind is sent.
"""

from __future__ import annotations

import math

from ...fairness import BudgetRefusal, Headroom

UNITS = ("requests", "tokens")


def refusal_headers(refusal: BudgetRefusal, unit: str, limit: int) -> dict[str, str]:
    """``retry-after`` and the ``x-ratelimit-*-<unit>`` headers of a refusal."""
    return {
        "retry-after": str(max(1, math.ceil(refusal.retry_after_s))),
        "retry-after-ms": str(max(1, math.ceil(refusal.retry_after_s * 1000))),
        f"x-ratelimit-limit-{unit}": str(limit),
        f"x-ratelimit-remaining-{unit}": str(math.floor(max(0.0, refusal.remaining))),
        f"x-ratelimit-reset-{unit}": go_duration(refusal.reset_s),
    }


def headroom_headers(requests: Headroom | None, tokens: Headroom | None) -> dict[str, str]:
    """The headers of an admitted request: per kind of limit, the tightest once this
    request took its share. Cost: six string formats per request with both kinds of
    limit, nothing without."""
    out: dict[str, str] = {}
    for unit, headroom in zip(UNITS, (requests, tokens)):
        if headroom is not None:
            out[f"x-ratelimit-limit-{unit}"] = str(int(headroom.budget.tokens))
            out[f"x-ratelimit-remaining-{unit}"] = str(math.floor(max(0.0, headroom.remaining)))
            out[f"x-ratelimit-reset-{unit}"] = go_duration(headroom.reset_s)
    return out


def go_duration(seconds: float) -> str:
    """OpenAI's reset format: ``0s`` (whole now), ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text
