"""Admission as a stage, in process: caps, budget refusals and their headers,
and the refusals that need no prompt count. The HTTP behaviour is in test_admission_http.py;
these call ``admit`` directly with a real Runtime (real ledger file, real dispatcher). The
engine client points at a closed port: a refusal that asked it to count would be a 502."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenpace.gateway import parse_config
from tokenpace.gateway.admission import Admission, admit
from tokenpace.gateway.dispatch import Dispatcher
from tokenpace.gateway.exchange import Exchange, Runtime
from tokenpace.gateway.ledger import open_ledger
from tokenpace.gateway.tenants import Tenants
from tokenpace.gateway.wire import GatewayError, parse_request

CLOSED = "http://127.0.0.1:1"


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Any]:
    made: list[Runtime] = []
    now = [0.0]

    def make(**tenant: Any) -> Runtime:
        config = parse_config({
            "engines": [CLOSED], "ledger": f"sqlite:///{tmp_path / 'usage.db'}",
            "cost": {"prompt": 1.0, "completion": 1.0},
            "tenants": [{"id": "t", "api_keys": ["k"], **tenant}],
        })
        clock = lambda: now[0]  # noqa: E731
        rt = Runtime(config, Tenants(config, clock), Dispatcher(config, clock), {},
                     open_ledger(config.ledger), clock=clock)
        made.append(rt)
        return rt

    make.now = now  # type: ignore[attr-defined]
    yield make
    for rt in made:
        rt.ledger.close()


def run_admit(rt: Runtime, body: dict[str, Any], kind: str = "completion",
              application: str | None = None) -> tuple[Exchange, Any]:
    async def main() -> tuple[Exchange, Any]:
        tenant = rt.tenants.get("t")
        ex = Exchange(rt, "tpg-test", kind, tenant, rt.clock(), time.time(),
                      application=None if application is None else tenant.applications[application])
        async with httpx.AsyncClient(base_url=CLOSED) as client:
            try:
                return ex, await admit(rt, ex, parse_request(kind, body), client)
            except GatewayError as exc:
                return ex, exc
    return asyncio.run(main())


def ids(n: int) -> list[int]:
    return list(range(1, n + 1))


def test_an_admitted_request_reserves_prompt_plus_output_and_says_so(runtime: Any) -> None:
    rt = runtime(budgets=[{"tokens": 100, "per": "1m"}])
    ex, admission = run_admit(rt, {"model": "m", "prompt": ids(3), "max_tokens": 10, "n": 2})
    assert admission == Admission(prompt_tokens=3, max_tokens=10, reserved=23.0)
    assert (ex.prompt_tokens, ex.reserved, ex.max_completion_tokens) == (3, 23.0, 20)
    assert ex.prompt_counted


def test_a_budget_refusal_carries_retry_and_ratelimit_headers(runtime: Any) -> None:
    rt = runtime(budgets=[{"tokens": 100, "per": "1m"}])  # refills 100/60 per second
    _, first = run_admit(rt, {"model": "m", "prompt": ids(30), "max_tokens": 30})
    assert isinstance(first, Admission)  # 60 reserved, 40 left
    # The lower bound (35: token ids have no text bytes) fits; the full 45 does not.
    ex, refused = run_admit(rt, {"model": "m", "prompt": ids(10), "max_tokens": 35})
    assert isinstance(refused, GatewayError)
    assert (refused.status, refused.reason, refused.code) == (429, "budget", "rate_limit_exceeded")
    h = refused.headers
    assert h["x-ratelimit-limit-tokens"] == "100" and h["x-ratelimit-remaining-tokens"] == "40"
    assert h["retry-after"] == "3" and h["retry-after-ms"] == "3000"  # 5 missing
    assert h["x-ratelimit-reset-tokens"] == "36s"  # 60 missing
    assert ex.prompt_tokens == 10 and ex.reserved == 0.0  # counted, nothing reserved
    # Refused on the lower bound alone (50 > 40), before counting: its wait is the bound's.
    ex, cheap = run_admit(rt, {"model": "m", "prompt": ids(10), "max_tokens": 50})
    assert isinstance(cheap, GatewayError) and cheap.reason == "budget"
    assert cheap.headers["retry-after-ms"] == "6000" and ex.prompt_tokens == 0


def test_a_request_larger_than_the_whole_budget_is_a_400_before_any_count(runtime: Any) -> None:
    rt = runtime(budgets=[{"tokens": 100, "per": "1m"}])
    ex, refused = run_admit(rt, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 200}, kind="chat")
    assert isinstance(refused, GatewayError)
    assert (refused.status, refused.reason, refused.param) == (400, "larger_than_budget", "max_tokens")
    assert not ex.prompt_counted  # refused on the output part alone: the engine was not asked


def test_a_prompt_too_big_by_its_bytes_is_refused_without_counting(runtime: Any) -> None:
    rt = runtime(max_input_tokens=10)
    big = "x" * (10 * 64 + 1)  # more than 64 bytes per allowed token
    ex, refused = run_admit(rt, {"model": "m", "messages": [{"role": "user", "content": big}],
                                 "max_tokens": 5}, kind="chat")
    assert isinstance(refused, GatewayError)
    assert (refused.status, refused.reason, refused.param) == (400, "max_input_tokens", "messages")
    assert "at least 11 tokens" in refused.message and not ex.prompt_counted


def test_counted_caps_refuse_with_their_own_messages(runtime: Any) -> None:
    rt = runtime(max_input_tokens=4, max_output_tokens=8)
    _, over_input = run_admit(rt, {"model": "m", "prompt": ids(5), "max_tokens": 2})
    assert isinstance(over_input, GatewayError) and over_input.reason == "max_input_tokens"
    assert "has 5 tokens" in over_input.message
    _, over_output = run_admit(rt, {"model": "m", "prompt": ids(2), "max_tokens": 9})
    assert isinstance(over_output, GatewayError)
    assert (over_output.reason, over_output.param) == ("max_output_tokens", "max_tokens")
    _, filled = run_admit(rt, {"model": "m", "prompt": ids(2)})
    assert filled == Admission(prompt_tokens=2, max_tokens=8, reserved=10.0)


def test_a_full_queue_is_refused_before_anything_else(runtime: Any) -> None:
    rt = runtime(max_concurrency=1, max_queued=0, max_input_tokens=1)
    tenant = rt.tenants.get("t")
    tenant.inflight = 1
    _, refused = run_admit(rt, {"model": "m", "prompt": "x" * 1000, "max_tokens": 1})
    assert isinstance(refused, GatewayError)
    assert (refused.status, refused.reason) == (429, "queue_full")
    assert int(refused.headers["retry-after"]) >= 1


def test_a_prompt_that_must_be_counted_asks_the_engine(runtime: Any) -> None:
    rt = runtime(max_input_tokens=100)
    _, refused = run_admit(rt, {"model": "m", "prompt": "hello", "max_tokens": 1})
    assert isinstance(refused, GatewayError)  # the engine (a closed port) could not count it
    assert (refused.status, refused.reason) == (502, "engine_unavailable")


def test_max_requests_refuses_the_request_past_the_limit_with_exact_headers(runtime: Any) -> None:
    """3 requests per minute: a bucket of 3 refilled at one request per 20 s."""
    rt = runtime(max_requests=[{"requests": 3, "per": "1m"}])
    body = {"model": "m", "prompt": ids(3), "max_tokens": 5}
    for _ in range(3):
        assert isinstance(run_admit(rt, body)[1], Admission)
    runtime.now[0] = 5.0  # 5 s later: a quarter of a request back
    _, refused = run_admit(rt, body)
    assert isinstance(refused, GatewayError)
    assert (refused.status, refused.reason, refused.code) == (429, "requests", "rate_limit_exceeded")
    assert "request rate limit 3 per 1m" in refused.message
    h = refused.headers
    assert h["x-ratelimit-limit-requests"] == "3"
    assert h["x-ratelimit-remaining-requests"] == "0"  # 0.25 of a request
    assert h["retry-after-ms"] == "15000" and h["retry-after"] == "15"  # 0.75 missing
    assert h["x-ratelimit-reset-requests"] == "55s"  # 2.75 missing at 1 per 20 s
    assert "x-ratelimit-limit-tokens" not in h
    runtime.now[0] = 20.0  # one request back
    assert isinstance(run_admit(rt, body)[1], Admission)
    assert isinstance(run_admit(rt, body)[1], GatewayError)


def test_every_max_requests_limit_must_admit_and_the_longest_wait_is_reported(runtime: Any) -> None:
    rt = runtime(max_requests=[{"requests": 2, "per": "1s"}, {"requests": 3, "per": "1h"}])
    body = {"model": "m", "prompt": ids(1), "max_tokens": 1}
    assert isinstance(run_admit(rt, body)[1], Admission)
    assert isinstance(run_admit(rt, body)[1], Admission)
    _, short = run_admit(rt, body)  # the per-second limit refuses, 0.5 s to wait
    assert short.headers["x-ratelimit-limit-requests"] == "2"
    assert short.headers["retry-after-ms"] == "500"
    runtime.now[0] = 1.0
    assert isinstance(run_admit(rt, body)[1], Admission)  # the third of the hour
    runtime.now[0] = 2.0
    _, long = run_admit(rt, body)  # the hourly one now: 1200 s per request
    assert long.headers["x-ratelimit-limit-requests"] == "3"
    assert long.headers["x-ratelimit-reset-requests"] == "59m58s"


def test_a_request_refused_by_its_budget_still_counts_as_a_request(runtime: Any) -> None:
    """As OpenAI counts requests: every request that reaches the check."""
    rt = runtime(max_requests=[{"requests": 2, "per": "1m"}], budgets=[{"tokens": 20, "per": "1m"}])
    assert isinstance(run_admit(rt, {"model": "m", "prompt": ids(15), "max_tokens": 4})[1],
                      Admission)  # 19 of 20 reserved
    # Its lower bound (1) fits, its count (6) does not: refused after the request check.
    _, refused = run_admit(rt, {"model": "m", "prompt": ids(5), "max_tokens": 1})
    assert isinstance(refused, GatewayError) and refused.reason == "budget"
    _, third = run_admit(rt, {"model": "m", "prompt": ids(1), "max_tokens": 1})
    assert isinstance(third, GatewayError) and third.reason == "requests"


def test_a_full_queue_refusal_does_not_count_as_a_request(runtime: Any) -> None:
    rt = runtime(max_requests=[{"requests": 1, "per": "1m"}], max_concurrency=1, max_queued=0)
    tenant = rt.tenants.get("t")
    tenant.inflight = 1
    _, refused = run_admit(rt, {"model": "m", "prompt": ids(1), "max_tokens": 1})
    assert isinstance(refused, GatewayError) and refused.reason != "requests"
    tenant.inflight = 0
    assert isinstance(run_admit(rt, {"model": "m", "prompt": ids(1), "max_tokens": 1})[1], Admission)


def test_a_request_limit_and_a_budget_of_the_same_figures_keep_separate_buckets() -> None:
    from tokenpace.fairness import BudgetSpec, RequestLimit

    assert RequestLimit(3, 3600).key == "requests:3/1h" != BudgetSpec(3, 3600).key == "3/1h"


def _would_reject(reason: str, tenant: str = "t", application: str = "") -> float:
    from tokenpace.gateway import metrics

    value = metrics.REGISTRY.get_sample_value("tokenpace_gateway_would_reject_total",
                                              {"tenant": tenant, "application": application,
                                               "reason": reason})
    return value or 0.0


def test_an_observed_budget_refuses_nothing_counts_what_it_would_and_settles(runtime: Any) -> None:
    """100 per minute in observe mode: kept as if enforced, but it never refuses."""
    rt = runtime(budgets=[{"tokens": 100, "per": "1m", "mode": "observe"}])
    tenant = rt.tenants.get("t")
    before = _would_reject("budget")
    ex1, first = run_admit(rt, {"model": "m", "prompt": ids(30), "max_tokens": 30})
    assert isinstance(first, Admission) and _observed(ex1) == 60.0
    ex2, second = run_admit(rt, {"model": "m", "prompt": ids(30), "max_tokens": 30})
    assert isinstance(second, Admission), "observe mode refuses nothing"
    assert _would_reject("budget") == before + 1
    assert _observed(ex2) == 0.0, "what it would have refused is not charged to it"
    assert tenant.observed_budgets.levels(0.0) == {"observe:100/1m": 40.0}
    assert tenant.budgets.levels(0.0) == {}, "no enforced budget"
    # At the end the observed reservation is replaced by the actual cost (30 + 10).
    ex1.completion_tokens, ex1.prompt_tokens = 10, 30
    asyncio.run(_finish(ex1))
    assert tenant.observed_budgets.levels(0.0) == {"observe:100/1m": 60.0}


def _observed(ex: Exchange) -> float:
    """What the exchange holds on budgets in observe mode (in process)."""
    return sum(h.reserved for h in ex.holds if h.level is None)


async def _finish(ex: Any) -> None:
    from tokenpace.gateway.exchange import Outcome

    ex.finish(Outcome.FINISHED, "stop")


def test_an_observed_request_limit_counts_and_an_enforced_one_beside_it_refuses(
        runtime: Any) -> None:
    rt = runtime(max_requests=[{"requests": 3, "per": "1m"},
                               {"requests": 1, "per": "1m", "mode": "observe"}])
    before = _would_reject("requests")
    body = {"model": "m", "prompt": ids(1), "max_tokens": 1}
    assert [isinstance(run_admit(rt, body)[1], Admission) for _ in range(3)] == [True] * 3
    assert _would_reject("requests") == before + 2  # the 2nd and 3rd are past 1 per minute
    _, refused = run_admit(rt, body)
    assert isinstance(refused, GatewayError) and refused.reason == "requests"
    assert refused.headers["x-ratelimit-limit-requests"] == "3", "the enforced limit"
    assert _would_reject("requests") == before + 2, "refused by an enforced limit first"


# -- applications inside the tenant ---------------------------------------------------------


def _apps(**chat: Any) -> list[dict[str, Any]]:
    return [{"id": "chat", "api_keys": ["k-chat"], **chat}, {"id": "agent", "api_keys": ["k-agent"]}]


def test_an_applications_budget_refuses_while_its_sibling_and_the_tenant_go_on(
        runtime: Any) -> None:
    rt = runtime(budgets=[{"tokens": 100, "per": "1h"}],
                 applications=_apps(budgets=[{"tokens": 30, "per": "1h"}]))
    tenant = rt.tenants.get("t")
    chat = tenant.applications["chat"]
    body = {"model": "m", "prompt": ids(10), "max_tokens": 10}  # 20 cost units
    ex, first = run_admit(rt, body, application="chat")
    assert isinstance(first, Admission)
    assert chat.budgets.levels(0.0) == {"30/1h": 10.0} and tenant.budgets.levels(0.0) == {"100/1h": 80.0}
    _, refused = run_admit(rt, body, application="chat")
    assert isinstance(refused, GatewayError) and refused.status == 429
    assert "budget 30/1h of application 'chat' of tenant 't' exhausted" in refused.message
    assert refused.headers["x-ratelimit-limit-tokens"] == "30"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "10"
    assert tenant.budgets.levels(0.0) == {"100/1h": 80.0}, "the application refused first"
    for expected in (60.0, 40.0, 20.0, 0.0):  # the sibling and the tenant's own key go on
        assert isinstance(run_admit(rt, body, application="agent")[1], Admission)
        assert tenant.budgets.levels(0.0) == {"100/1h": expected}
    # The tenant's budget counts every application: now it refuses the sibling too.
    _, refused = run_admit(rt, body, application="agent")
    assert isinstance(refused, GatewayError) and refused.status == 429
    assert "budget 100/1h of tenant 't' exhausted" in refused.message
    # Settlement gives the application and the tenant back the unused part (20 -> 12).
    ex.prompt_tokens, ex.completion_tokens = 10, 2
    asyncio.run(_finish(ex))
    assert chat.budgets.levels(0.0) == {"30/1h": 18.0}
    assert tenant.budgets.levels(0.0) == {"100/1h": 8.0}


def test_a_tenant_refusal_gives_the_applications_reservation_back(runtime: Any) -> None:
    rt = runtime(budgets=[{"tokens": 25, "per": "1h"}],
                 applications=_apps(budgets=[{"tokens": 100, "per": "1h"}]))
    tenant = rt.tenants.get("t")
    body = {"model": "m", "prompt": ids(10), "max_tokens": 10}
    assert isinstance(run_admit(rt, body, application="chat")[1], Admission)
    ex, refused = run_admit(rt, body, application="chat")
    assert isinstance(refused, GatewayError) and "of tenant 't'" in refused.message
    assert "application" not in refused.message
    assert tenant.applications["chat"].budgets.levels(0.0) == {"100/1h": 80.0}, "given back"
    assert ex.holds == []


def test_an_applications_request_limit_has_the_exact_headers_and_spares_its_sibling(
        runtime: Any) -> None:
    rt = runtime(max_requests=[{"requests": 5, "per": "1m"}],
                 applications=_apps(max_requests=[{"requests": 2, "per": "1m"}]))
    body = {"model": "m", "prompt": ids(1), "max_tokens": 1}
    assert all(isinstance(run_admit(rt, body, application="chat")[1], Admission) for _ in range(2))
    _, refused = run_admit(rt, body, application="chat")
    assert isinstance(refused, GatewayError) and refused.reason == "requests"
    assert "request rate limit 2 per 1m of application 'chat' of tenant 't'" in refused.message
    assert (refused.headers["x-ratelimit-limit-requests"],
            refused.headers["x-ratelimit-remaining-requests"],
            refused.headers["x-ratelimit-reset-requests"]) == ("2", "0", "1m0s")
    assert refused.headers["retry-after-ms"] == "30000"  # one request back after 60 s / 2
    # The tenant's limit counted the chat requests that reached it (2 of 5), not the refused one.
    assert all(isinstance(run_admit(rt, body, application="agent")[1], Admission)
               for _ in range(3))
    _, refused = run_admit(rt, body, application="agent")
    assert isinstance(refused, GatewayError) and refused.headers["x-ratelimit-limit-requests"] == "5"


def test_an_applications_limits_in_observe_mode_count_under_its_id(runtime: Any) -> None:
    rt = runtime(applications=_apps(budgets=[{"tokens": 30, "per": "1h", "mode": "observe"}],
                                    max_requests=[{"requests": 1, "per": "1m",
                                                   "mode": "observe"}]))
    before = (_would_reject("budget", application="chat"),
              _would_reject("requests", application="chat"))
    body = {"model": "m", "prompt": ids(10), "max_tokens": 10}
    results = [run_admit(rt, body, application="chat") for _ in range(3)]
    assert all(isinstance(a, Admission) for _, a in results), "observe mode refuses nothing"
    assert (_would_reject("budget", application="chat"),
            _would_reject("requests", application="chat")) == (before[0] + 2, before[1] + 2)
    assert [_observed(ex) for ex, _ in results] == [20.0, 0.0, 0.0]
    assert rt.tenants.get("t").applications["chat"].observed_budgets.levels(0.0) == \
        {"observe:30/1h": 10.0}


def test_an_admitted_request_knows_what_its_tightest_limits_have_left(runtime: Any) -> None:
    """The response's x-ratelimit-* headers: per kind of limit, the one with the least
    left once this request took its share, over every budget of the tenant and of its
    application; nothing of a kind the tenant does not limit."""
    from tokenpace.gateway.wire import headroom_headers

    rt = runtime(budgets=[{"tokens": 1000, "per": "1h"}, {"tokens": 100, "per": "1m"}],
                 max_requests=[{"requests": 10, "per": "1m"}],
                 applications=[{"id": "bot", "api_keys": ["kb"],
                                "budgets": [{"tokens": 50, "per": "10s"}],
                                "max_requests": [{"requests": 3, "per": "1s"}]}])
    ex, admitted = run_admit(rt, {"model": "m", "prompt": ids(10), "max_tokens": 20})
    assert isinstance(admitted, Admission)
    assert headroom_headers(ex.requests_headroom, ex.tokens_headroom) == {
        "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "6s",  # one request back every 6 s
        "x-ratelimit-limit-tokens": "100", "x-ratelimit-remaining-tokens": "70",
        "x-ratelimit-reset-tokens": "18s"}  # 30 of 100 a minute: 18 s; 30 of 1000/1h: 108 s
    runtime.now[0] = 1.5
    ex, admitted = run_admit(rt, {"model": "m", "prompt": ids(10), "max_tokens": 20},
                             application="bot")
    assert isinstance(admitted, Admission)
    # The application's budget (50 - 30 = 20) is tighter than the tenant's (72.5 - 30),
    # the tenant's request limit (10 - 2 + 0.25) than the application's (3 - 1).
    assert headroom_headers(ex.requests_headroom, ex.tokens_headroom) == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "334ms",
        "x-ratelimit-limit-tokens": "50", "x-ratelimit-remaining-tokens": "20",
        "x-ratelimit-reset-tokens": "6s"}


def test_no_ratelimit_headers_without_limits_and_none_for_observed_ones(runtime: Any) -> None:
    from tokenpace.gateway.wire import headroom_headers

    rt = runtime(budgets=[{"tokens": 100, "per": "1m", "mode": "observe"}])
    ex, admitted = run_admit(rt, {"model": "m", "prompt": ids(10), "max_tokens": 20})
    assert isinstance(admitted, Admission)
    assert (ex.requests_headroom, ex.tokens_headroom) == (None, None)
    assert headroom_headers(None, None) == {}
