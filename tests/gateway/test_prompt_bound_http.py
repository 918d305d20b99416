"""Prompt counting off the critical path, over real HTTP: requests decided by the
prompt's byte bound make no /tokenize call, one that the bound cannot decide makes one,
and budgets are exact after settlement (and corrected at a stream's first usage).

The fake engine counts a chat prompt as 3 tokens per message plus its content's bytes plus
2, a plain prompt as its bytes plus 1; the gateway learns those overheads by probes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_A, base_config

PER_DAY = 10000  # refills 0.12 per second: the levels below hold within 1 over a test


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, content=json.dumps(body),
                      headers={"authorization": f"Bearer {KEY_A}"}, timeout=30)


def is_probe(body: dict[str, Any]) -> bool:
    if "messages" in body:
        return all(m["content"] == "" for m in body["messages"])
    return body["prompt"] == "a"


def counted(engine: EngineServer) -> list[dict[str, Any]]:
    """The /tokenize calls that counted a client's prompt (not a probe of the overhead)."""
    return [b for b in engine.engine.tokenize_bodies if not is_probe(b)]


@pytest.fixture
def gw(engine: EngineServer, make_gateway: Any, tmp_path: Path) -> Any:
    return make_gateway(base_config(engine.url, tmp_path / "u.db", max_input_tokens=500,
                                    budgets=[{"tokens": PER_DAY, "per": "1d"}]))


def test_requests_within_their_bound_are_not_counted_and_budgets_settle_exactly(
        engine: EngineServer, gw: Any) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "h\u00e9llo"}]
    for _ in range(3):
        resp = post(gw.url, "/v1/chat/completions", {"model": "fake", "messages": msgs,
                                                     "max_tokens": 5})
        assert resp.status_code == 200, resp.text
    resp = post(gw.url, "/v1/completions", {"model": "fake", "prompt": "hello", "max_tokens": 3})
    assert resp.status_code == 200
    with httpx.stream("POST", gw.url + "/v1/completions",
                      headers={"authorization": f"Bearer {KEY_A}"},
                      json={"model": "fake", "prompt": "streamed", "max_tokens": 4,
                            "stream": True}) as r:
        assert r.status_code == 200
        r.read()
    assert counted(engine) == []  # no request waited for a count
    # the overheads were learned once: 3 chat probes and 1 plain-prompt probe
    assert len(engine.engine.tokenize_bodies) == 4
    chat_prompt = 3 + 8 + 3 + len("h\u00e9llo".encode()) + 2  # 22
    rows = gw.rows(5)
    assert sorted(r.prompt_tokens for r in rows) == sorted([chat_prompt] * 3 + [6, 9])
    spent = 3 * (chat_prompt + 2 * 5) + (6 + 2 * 3) + (9 + 2 * 4)
    assert sum(r.cost for r in rows) == spent
    level = gw.metric("tokenpace_gateway_budget_remaining_tokens", tenant="team-a")
    assert level == pytest.approx(PER_DAY - spent, abs=1)


def test_a_prompt_whose_bound_may_break_the_cap_is_counted_once_first(
        engine: EngineServer, gw: Any) -> None:
    # 499 bytes: the engine counts 500 (within 500), the bound says 501
    resp = post(gw.url, "/v1/completions", {"model": "fake", "prompt": "z" * 499, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert [b["prompt"] for b in counted(engine)] == ["z" * 499]
    resp = post(gw.url, "/v1/completions", {"model": "fake", "prompt": "z" * 500, "max_tokens": 2})
    assert resp.status_code == 400 and "501 tokens" in resp.json()["error"]["message"]
    assert len(counted(engine)) == 2
    # well under the cap: decided by the bound again
    assert post(gw.url, "/v1/completions", {"model": "fake", "prompt": "z" * 400,
                                            "max_tokens": 2}).status_code == 200
    assert len(counted(engine)) == 2


def test_a_stream_gives_the_over_reservation_back_at_its_first_usage(
        engine: EngineServer, gw: Any) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "SLOW please"}],
            "max_tokens": 20, "stream": True}
    exact = 3 + len("SLOW please") + 2  # 16; the bound is 5 + 11 + len("user") + 4 = 24
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {KEY_A}"}, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"content"' in first
        # the gateway read the chunk's usage before passing it on: the reservation is now
        # the exact prompt plus the whole output's reservation, 50 ms x 19 tokens before the end
        level = gw.metric("tokenpace_gateway_budget_remaining_tokens", tenant="team-a")
        assert level == pytest.approx(PER_DAY - (exact + 2 * 20), abs=1)
        for _ in lines:
            pass
    assert counted(engine) == []
    row = gw.rows(1)[0]
    assert (row.prompt_tokens, row.completion_tokens) == (exact, 20)
    level = gw.metric("tokenpace_gateway_budget_remaining_tokens", tenant="team-a")
    assert level == pytest.approx(PER_DAY - (exact + 2 * 20), abs=1)


def test_prompt_count_exact_counts_every_prompt_a_decision_depends_on(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    config = base_config(engine.url, tmp_path / "u.db", max_input_tokens=500)
    config["prompt_count"] = "exact"
    gw = make_gateway(config)
    for prompt in ("one", "two"):
        assert post(gw.url, "/v1/completions", {"model": "fake", "prompt": prompt,
                                                "max_tokens": 2}).status_code == 200
    assert [b["prompt"] for b in engine.engine.tokenize_bodies] == ["one", "two"]  # no probe


def test_concurrent_first_requests_share_one_probe(engine: EngineServer, gw: Any) -> None:
    from concurrent.futures import ThreadPoolExecutor

    engine.engine.tokenize_delay_s = 0.5  # the probe is still out when the others arrive
    body = {"model": "fake", "prompt": "first", "max_tokens": 2}
    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda _: post(gw.url, "/v1/completions", body).status_code,
                              range(6)))
    assert codes == [200] * 6
    assert engine.engine.tokenize_bodies == [{"model": "fake", "prompt": "a"}]
