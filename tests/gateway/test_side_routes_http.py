"""``/tokenize``, ``/detokenize`` and ``count_tokens`` inside the tenant's limits, against a
real gateway process and the fake engine over real HTTP: a tenant's counts hold at most its
tokenize slots (the rest refused at once, another tenant's counts unaffected), bodies are
capped before they reach the engine, and each call counts against ``max_requests``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_A, KEY_B, base_config
from tokenpace.gateway.tenants import TOKENIZE_SLOTS_PER_TENANT


def _post(url: str, key: str, body: Any, path: str = "/tokenize") -> httpx.Response:
    return httpx.post(f"{url}{path}", headers={"authorization": f"Bearer {key}"},
                      content=json.dumps(body), timeout=30)


def test_a_tokenize_flood_holds_only_the_tenants_slots(engine: EngineServer, make_gateway: Any,
                                                        tmp_path: Path) -> None:
    """Eight counts of one tenant at once: its two slots reach the engine, six get 429
    ``tokenize_busy`` at once; another tenant's count meanwhile is served."""
    engine.engine.tokenize_delay_s = 3.0  # the slots stay taken while the flood arrives
    gw = make_gateway(base_config(engine.url, tmp_path / "usage.db"))
    body = {"model": "fake", "prompt": "x" * 1000}

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            a = [client.post("/tokenize", json=body, headers={"authorization": f"Bearer {KEY_A}"})
                 for _ in range(8)]
            b = client.post("/tokenize", json=body, headers={"authorization": f"Bearer {KEY_B}"})
            return await asyncio.gather(*a, b)

    *mine, other = asyncio.run(flood())
    statuses = sorted(r.status_code for r in mine)
    assert statuses == [200] * TOKENIZE_SLOTS_PER_TENANT + [429] * (8 - TOKENIZE_SLOTS_PER_TENANT)
    busy = next(r for r in mine if r.status_code == 429)
    assert busy.json()["error"]["code"] == "tokenize_busy" and busy.headers["retry-after"] == "1"
    assert other.status_code == 200 and other.json()["count"] >= 1000
    assert engine.engine.tokenized == TOKENIZE_SLOTS_PER_TENANT + 1
    assert gw.metric("tokenpace_gateway_rejections_total", tenant="team-a",
                     reason="tokenize_busy") == 8 - TOKENIZE_SLOTS_PER_TENANT


def test_counting_bodies_are_capped_before_the_engine(engine: EngineServer, make_gateway: Any,
                                                      tmp_path: Path) -> None:
    """``max_tokenize_bytes`` for every tenant, tighter for one with ``max_input_tokens``
    (64 bytes a token): a larger body is refused with 413 and never reaches the engine."""
    cfg = base_config(engine.url, tmp_path / "usage.db")
    cfg["max_tokenize_bytes"] = 64 * 1024
    cfg["tenants"][1]["max_input_tokens"] = 100  # 100 x 64 + 4096 = 10,496 bytes
    gw = make_gateway(cfg)
    assert _post(gw.url, KEY_A, {"model": "fake", "prompt": "x" * 60_000}).status_code == 200
    too_big = _post(gw.url, KEY_A, {"model": "fake", "prompt": "x" * 70_000})
    assert too_big.status_code == 413 and "max_tokenize_bytes" in too_big.json()["error"]["message"]
    messages = _post(gw.url, KEY_A, {"model": "fake", "messages": [
        {"role": "user", "content": "x" * 70_000}]}, path="/v1/messages/count_tokens")
    assert messages.status_code == 413 and messages.json()["type"] == "error"  # Anthropic's
    assert _post(gw.url, KEY_B, {"model": "fake", "prompt": "x" * 10_000}).status_code == 200
    capped = _post(gw.url, KEY_B, {"model": "fake", "prompt": "x" * 11_000})
    assert capped.status_code == 413 and "max_input_tokens" in capped.json()["error"]["message"]
    assert engine.engine.tokenized == 2


def test_counting_calls_count_against_max_requests(engine: EngineServer, make_gateway: Any,
                                                   tmp_path: Path) -> None:
    cfg = base_config(engine.url, tmp_path / "usage.db")
    cfg["tenants"][1]["max_requests"] = [{"requests": 2, "per": "1h"}]
    gw = make_gateway(cfg)
    answers = [_post(gw.url, KEY_B, {"model": "fake", "prompt": "hi"}) for _ in range(3)]
    assert [r.status_code for r in answers] == [200, 200, 429]
    assert "request rate limit" in answers[2].json()["error"]["message"]
    assert engine.engine.tokenized == 2
    # A generation after them is refused by the same limit.
    chat = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {KEY_B}"},
                      json={"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 4})
    assert chat.status_code == 429
