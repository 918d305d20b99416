"""The prompt's byte bound, in process: what it claims, when it decides admission
without a round trip, and how the exact count corrects the reservation later.

Admission runs with a real Runtime (real ledger file, real dispatcher) whose engine client
points at a closed port: a request that asked the engine to count would be a 502, so a
request admitted here was decided without one. The overhead an engine would have taught
the gateway by probes is given with ``PromptBounds.remember``.
"""

from __future__ import annotations

import asyncio
import time
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenpace.gateway import parse_config
from tokenpace.gateway.admission import Admission, admit
from tokenpace.gateway.dispatch import Dispatcher
from tokenpace.gateway.engines import Overhead
from tokenpace.gateway.engines._prompt_bound import (
    SLACK_PER_MESSAGE,
    SLACK_PROMPT,
    bound,
    text_bytes,
)
from tokenpace.gateway.exchange import Exchange, Runtime
from tokenpace.gateway.ledger import open_ledger
from tokenpace.gateway.tenants import Tenants
from tokenpace.gateway.wire import GatewayError, parse_request

CLOSED = "http://127.0.0.1:1"
CHAT = Overhead(fixed=7, per_message=5, max_model_len=100)
PLAIN = Overhead(fixed=1, per_message=0, max_model_len=100)


# -- the bound itself ---------------------------------------------------------------------


def test_text_bytes_is_the_longest_utf8_form_among_the_normalizations() -> None:
    assert text_bytes("hello") == 5
    assert text_bytes("h\u00e9llo \u20ac") == len("h\u00e9llo \u20ac".encode())  # 10
    # NFKC spells U+FDFA out as 18 characters (33 bytes); NFC splits U+0958 in two (6 bytes)
    assert text_bytes("\ufdfa") == len(unicodedata.normalize("NFKC", "\ufdfa").encode()) == 33
    assert text_bytes("\u0958") == len(unicodedata.normalize("NFC", "\u0958").encode()) == 6


def chat(*messages: Any, **fields: Any) -> Any:
    return parse_request("chat", {"model": "m", "messages": list(messages), **fields})


def test_the_chat_bound_adds_the_learned_overhead_roles_and_slack() -> None:
    req = chat({"role": "system", "content": "be brief"},
               {"role": "user", "content": [{"type": "text", "text": "h\u00e9"}], "name": "bo"})
    expected = (7 + 5 + len("system") + 8 + len("user") + 2 + 3 + 2 * SLACK_PER_MESSAGE)
    assert bound(req, CHAT) == expected
    plain = parse_request("completion", {"model": "m", "prompt": "hello"})
    assert bound(plain, PLAIN) == 1 + 5 + SLACK_PROMPT


@pytest.mark.parametrize("req", [
    chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
    chat({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}),
    chat({"role": "user", "content": "hi"}, tools=[{"type": "function"}]),
    chat({"role": "user", "content": "hi"}, chat_template="{{ messages }}"),
    chat({"role": "user", "content": "hi"}, chat_template_kwargs={"x": 1}),
], ids=["image", "tool-calls", "tools", "own-template", "template-kwargs"])
def test_no_bound_is_claimed_for_what_is_not_plain_text(req: Any) -> None:
    assert bound(req, CHAT) is None


# -- admission on the bound -----------------------------------------------------------------


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Any]:
    made: list[Runtime] = []
    now = [0.0]

    def make(overhead: Overhead = PLAIN, kind: str = "completion", **tenant: Any) -> Runtime:
        config = parse_config({
            "engines": [CLOSED], "ledger": f"sqlite:///{tmp_path / 'usage.db'}",
            "cost": {"prompt": 1.0, "completion": 1.0},
            "tenants": [{"id": "t", "api_keys": ["k"], **tenant}],
        })
        clock = lambda: now[0]  # noqa: E731
        rt = Runtime(config, Tenants(config, clock), Dispatcher(config, clock), {},
                     open_ledger(config.ledger), clock=clock)
        rt.prompt_bounds.remember(CLOSED, "m", kind, overhead)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.ledger.close()


def run_admit(rt: Runtime, body: dict[str, Any], kind: str = "completion") -> tuple[Exchange, Any]:
    async def main() -> tuple[Exchange, Any]:
        ex = Exchange(rt, "tpg-test", kind, rt.tenants.get("t"), rt.clock(), time.time())
        async with httpx.AsyncClient(base_url=CLOSED) as client:
            try:
                return ex, await admit(rt, ex, parse_request(kind, body), client, CLOSED)
            except GatewayError as exc:
                return ex, exc
    return asyncio.run(main())


def level(rt: Runtime) -> float:
    return rt.tenants.get("t").budgets.levels(rt.clock())["1000/1m"]


def test_a_bound_within_every_limit_admits_without_a_count_and_reserves_the_bound(
        runtime: Any) -> None:
    rt = runtime(max_input_tokens=50, budgets=[{"tokens": 1000, "per": "1m"}])
    ex, admission = run_admit(rt, {"model": "m", "prompt": "x" * 40, "max_tokens": 10})
    assert admission == Admission(prompt_tokens=0, max_tokens=10, reserved=42 + 10)
    assert ex.prompt_bound == 42 and not ex.prompt_counted
    assert level(rt) == 1000 - 52


def test_a_bound_over_the_cap_asks_for_the_exact_count(runtime: Any) -> None:
    rt = runtime(max_input_tokens=41)  # bound 42: the prompt may still be within 41
    _, refused = run_admit(rt, {"model": "m", "prompt": "x" * 40, "max_tokens": 10})
    assert isinstance(refused, GatewayError)
    assert (refused.status, refused.reason) == (502, "engine_unavailable")  # it tried to count


def test_a_bound_the_budget_cannot_take_asks_for_the_exact_count(runtime: Any) -> None:
    rt = runtime(budgets=[{"tokens": 1000, "per": "1m"}])
    rt.tenants.get("t").budgets.try_reserve(1000 - 51, 0.0)  # 51 left, the bound needs 52
    _, refused = run_admit(rt, {"model": "m", "prompt": "x" * 40, "max_tokens": 10})
    assert isinstance(refused, GatewayError) and refused.status == 502
    assert level(rt) == 51  # nothing was taken on the bound


def test_a_missing_max_tokens_is_filled_on_the_bound_only_when_the_context_has_room(
        runtime: Any) -> None:
    rt = runtime(max_output_tokens=50)  # context 100 (learned); bound of 40 bytes: 42
    _, admission = run_admit(rt, {"model": "m", "prompt": "x" * 40})
    assert isinstance(admission, Admission) and admission.max_tokens == 50
    _, refused = run_admit(rt, {"model": "m", "prompt": "x" * 60})  # 62 + 50 > 100
    assert isinstance(refused, GatewayError) and refused.status == 502


def test_the_exact_count_corrects_the_reservation_and_settlement_is_exact(runtime: Any) -> None:
    rt = runtime(budgets=[{"tokens": 1000, "per": "1m"}])
    ex, _ = run_admit(rt, {"model": "m", "prompt": "x" * 40, "max_tokens": 10})
    assert level(rt) == 1000 - 52
    ex.learn_prompt(9)  # the engine's first usage: 9 prompt tokens
    assert level(rt) == 1000 - 19 and ex.reserved == 19 and ex.prompt_bound is None
    ex.completion_tokens = 4
    asyncio.run(_finish(ex))
    assert level(rt) == 1000 - 13  # exactly the prompt and the output


async def _finish(ex: Exchange) -> None:
    from tokenpace.gateway.exchange import Outcome
    ex.finish(Outcome.FINISHED, "stop")


def test_a_prompt_over_its_bound_turns_the_bound_off_for_that_engine_and_model(
        runtime: Any) -> None:
    rt = runtime(budgets=[{"tokens": 1000, "per": "1m"}])
    ex, _ = run_admit(rt, {"model": "m", "prompt": "x" * 40, "max_tokens": 10})
    ex.learn_prompt(43)  # one more than its bound: a tokenizer the bound does not cover
    assert level(rt) == 1000 - 53  # the reservation follows the real count anyway
    _, next_one = run_admit(rt, {"model": "m", "prompt": "x", "max_tokens": 1})
    assert isinstance(next_one, GatewayError) and next_one.status == 502  # counted again


def test_the_learned_cache_stays_bounded_against_invented_model_names() -> None:
    from tokenpace.gateway.engines._prompt_bound import MAX_LEARNED
    from tokenpace.gateway.engines import PromptBounds

    bounds = PromptBounds()
    bounds.remember(CLOSED, "served", "chat", CHAT)
    for i in range(MAX_LEARNED - 1):  # names the engine refused: kept as "no bound"
        bounds.remember(CLOSED, f"invented-{i}", "chat", None)
    bounds.remember(CLOSED, "another", "chat", None)  # full: the refused names go first
    assert set(bounds._learned) == {(CLOSED, "served", "chat"), (CLOSED, "another", "chat")}
