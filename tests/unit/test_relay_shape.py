"""The shape of a request cut short (its ``n`` and prompts) read from its engine body with
the configured request bounds, so a raised bound is read as admission read it."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tokenpace.gateway.relay._relay import _shape


def _exchange(max_prompts: int) -> SimpleNamespace:
    config = SimpleNamespace(max_model_name_chars=256, max_prompts_per_request=max_prompts)
    return SimpleNamespace(kind="completion", rt=SimpleNamespace(config=config))


def test_a_batch_past_the_default_bound_is_read_with_the_configured_one() -> None:
    body = json.dumps({"model": "m", "n": 2, "prompt": ["p"] * 3000}).encode()
    assert _shape(_exchange(4096), body) == (2, 3000)  # type: ignore[arg-type]
    assert _shape(_exchange(2048), body) == (None, None)  # type: ignore[arg-type]
