"""Applications inside a tenant, through a real gateway process over real HTTP.

A key names a tenant and one of its applications; the application's limits apply inside
its tenant's (both must admit a request), its requests are told apart in the ledger and
the metrics, and its ``max_concurrency`` holds only its own requests in the queue.

Costs are exact: prompts are token ids (``len(prompt)`` tokens), the fake engine answers
``max_tokens`` tokens, and the cost model is ``prompt x 1 + completion x 2``.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import ADMIN_KEY, GatewayProcess
from tokenpace.gateway import ConfigError, parse_config

CHAT, AGENT, OWN = "sk-acme-chat", "sk-acme-agent", "sk-acme"

# prompt 3 + 2 x 5 completion = 13; the cheap pre-count check sees only the output part (10)
BIG = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 5}
# prompt 8 + 2 x 1 completion = 10; the cheap check sees 2
MID = {"model": "fake", "prompt": list(range(1, 9)), "max_tokens": 1}


def config(engine_url: str, ledger: Path, tenant: dict[str, Any] | None = None,
           chat: dict[str, Any] | None = None, agent: dict[str, Any] | None = None,
           own_key: bool = True) -> dict[str, Any]:
    acme: dict[str, Any] = {
        "id": "acme",
        "applications": [
            {"id": "chat", "api_keys": [CHAT], **(chat or {})},
            {"id": "agent", "api_keys": [AGENT], **(agent or {})},
        ],
        **(tenant or {}),
    }
    if own_key:
        acme["api_keys"] = [OWN]
    return {
        "engines": [{"url": engine_url, "max_inflight": 8}],
        "cost": {"prompt": 1.0, "completion": 2.0},
        "ledger": f"sqlite:///{ledger}",
        "admin_api_keys": [ADMIN_KEY],
        "tenants": [acme, {"id": "other", "api_keys": ["sk-other"]}],
    }


def post(gw: GatewayProcess, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.url + "/v1/completions", content=json.dumps(body),
                      headers={"authorization": f"Bearer {key}"}, timeout=60)


def go_seconds(text: str) -> float:
    """OpenAI's reset duration (``46m47.9s``, ``1.5s``, ``20ms``) in seconds."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:([\d.]+)s)?(?:(\d+)ms)?", text)
    assert m is not None and text, text
    h, mins, s, ms = m.groups()
    return int(h or 0) * 3600 + int(mins or 0) * 60 + float(s or 0) + int(ms or 0) / 1000


def refused(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 429, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded"), error
    return error


# -- budgets -------------------------------------------------------------------------------


def test_an_application_budget_refuses_while_its_sibling_goes_on_inside_the_tenant_budget(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    # The tenant has no key of its own: its applications' keys are enough.
    gw = make_gateway(config(engine.url, tmp_path / "u.db", own_key=False,
                             tenant={"budgets": [{"tokens": 100, "per": "1h"}]},
                             chat={"budgets": [{"tokens": 50, "per": "1h"}]}))
    # chat: 50 -> 37 -> 24 -> 11; the tenant: 100 -> 61
    assert [post(gw, CHAT, BIG).status_code for _ in range(3)] == [200, 200, 200]
    # 11 left passes the cheap check (10) but not the reservation (13): chat's own refusal
    resp = post(gw, CHAT, BIG)
    error = refused(resp)
    assert ("token budget 50/1h of application 'chat' of tenant 'acme' exhausted: "
            "this request needs 13, 11 remain") in error["message"], error
    assert resp.headers["x-ratelimit-limit-tokens"] == "50"
    assert resp.headers["x-ratelimit-remaining-tokens"] == "11"
    assert int(resp.headers["retry-after"]) in range(140, 146)  # 2 tokens at 50/3600 s
    assert 2790 <= go_seconds(resp.headers["x-ratelimit-reset-tokens"]) <= 2808  # 39 tokens
    # agent goes on in the tenant's budget: 61 -> 9 after four requests. Exactly four:
    # chat's refusal took nothing from the tenant (had it taken 13, only three would fit).
    assert [post(gw, AGENT, BIG).status_code for _ in range(4)] == [200] * 4
    resp = post(gw, AGENT, BIG)
    error = refused(resp)
    assert "token budget 100/1h of tenant 'acme' exhausted" in error["message"], error
    assert "application" not in error["message"]
    assert resp.headers["x-ratelimit-limit-tokens"] == "100"
    assert resp.headers["x-ratelimit-remaining-tokens"] == "9"
    # chat (11 left) admits 10, the tenant (9 left) refuses it: chat's reservation goes back
    for _ in range(2):
        resp = post(gw, CHAT, MID)
        error = refused(resp)
        assert ("token budget 100/1h of tenant 'acme' exhausted: this request needs 10, "
                "9 remain") in error["message"], error
        assert resp.headers["x-ratelimit-remaining-tokens"] == "9"
    # ... whole: chat still has exactly 11. (12 = prompt 10 + 2 x 1 passes both cheap
    # checks, 2 each, so chat's reservation, checked first, is what refuses it.)
    resp = post(gw, CHAT, {"model": "fake", "prompt": list(range(1, 11)), "max_tokens": 1})
    assert "of application 'chat' of tenant 'acme' exhausted: this request needs 12, 11 remain" \
        in refused(resp)["message"]
    assert resp.headers["x-ratelimit-remaining-tokens"] == "11"
    # the ledger and the metrics say whose requests were refused
    rows = gw.rows(13)
    outcome = {(r.application, r.finish_reason.startswith("rejected")) for r in rows}
    assert outcome == {("chat", False), ("chat", True), ("agent", False), ("agent", True)}
    assert sum(r.application == "chat" and r.finish_reason == "rejected:budget" for r in rows) == 4
    assert gw.wait_metric("tokenpace_gateway_application_requests_total", 4.0, tenant="acme",
                          application="chat", outcome="rejected") == 4.0
    assert gw.metric("tokenpace_gateway_application_requests_total", tenant="acme",
                     application="agent", outcome="rejected") == 1.0
    assert gw.metric("tokenpace_gateway_rejections_total", tenant="acme", reason="budget") == 5.0
    assert len(engine.engine.requests) == 7


def test_ledger_rows_and_metrics_carry_the_application(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    gw = make_gateway(config(engine.url, tmp_path / "u.db"))
    small = {"model": "fake", "prompt": [7, 8], "max_tokens": 4}
    assert post(gw, CHAT, BIG).status_code == 200
    assert post(gw, CHAT, BIG).status_code == 200
    assert post(gw, AGENT, small).status_code == 200
    assert post(gw, OWN, small).status_code == 200
    rows = gw.rows(4)
    got = sorted((r.tenant, r.application, r.prompt_tokens, r.completion_tokens, r.cost)
                 for r in rows)
    assert got == [("acme", "", 2, 4, 10.0), ("acme", "agent", 2, 4, 10.0),
                   ("acme", "chat", 3, 5, 13.0), ("acme", "chat", 3, 5, 13.0)]
    name = "tokenpace_gateway_application_requests_total"
    assert gw.wait_metric(name, 2.0, tenant="acme", application="chat", outcome="length") == 2.0
    assert gw.metric(name, tenant="acme", application="agent", outcome="length") == 1.0
    assert gw.metric(name, application="") is None  # the tenant's own key is not here
    tokens = "tokenpace_gateway_application_tokens_total"
    assert gw.metric(tokens, tenant="acme", application="chat", kind="prompt") == 6.0
    assert gw.metric(tokens, tenant="acme", application="chat", kind="completion") == 10.0
    assert gw.metric(tokens, tenant="acme", application="agent", kind="prompt") == 2.0
    assert gw.metric(tokens, tenant="acme", application="agent", kind="completion") == 4.0
    assert gw.metric(tokens, application="") is None
    # the tenant's totals count all three keys
    assert gw.metric("tokenpace_gateway_prompt_tokens_total", tenant="acme") == 3 + 3 + 2 + 2
    assert gw.metric("tokenpace_gateway_completion_tokens_total", tenant="acme") == 5 + 5 + 4 + 4


# -- concurrency ---------------------------------------------------------------------------


def test_application_max_concurrency_holds_only_its_own_requests(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    gw = make_gateway(config(engine.url, tmp_path / "u.db", chat={"max_concurrency": 1}))
    engine.engine.gate = threading.Event()  # everything dispatched stays in flight
    answers: dict[str, int] = {}

    def send(key: str, name: str) -> threading.Thread:
        def run() -> None:
            answers[name] = post(gw, key, {"model": "fake", "prompt": name,
                                           "max_tokens": 2}).status_code
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    threads = [send(CHAT, f"chat {i}") for i in range(3)]
    try:
        assert gw.wait_metric("tokenpace_gateway_queued_requests", 2.0, timeout_s=30,
                              tenant="acme") == 2.0
        threads += [send(AGENT, f"agent {i}") for i in range(2)]
        # the agent's requests pass chat's held ones
        assert gw.wait_metric("tokenpace_gateway_inflight_requests", 3.0, timeout_s=30,
                              tenant="acme") == 3.0
        time.sleep(0.3)  # nothing more goes while the engine holds them
        seen = sorted(s.body["prompt"] for s in engine.engine.requests)
        assert [p.split()[0] for p in seen] == ["agent", "agent", "chat"], seen
        assert gw.metric("tokenpace_gateway_queued_requests", tenant="acme") == 2.0
    finally:
        engine.engine.gate.set()
        for t in threads:
            t.join()
    assert answers == {f"chat {i}": 200 for i in range(3)} | {f"agent {i}": 200 for i in range(2)}
    assert len(engine.engine.requests) == 5
    rows = gw.rows(5)
    assert sorted(r.application for r in rows) == ["agent", "agent", "chat", "chat", "chat"]
    assert all(r.finish_reason == "length" for r in rows), rows


# -- observe mode --------------------------------------------------------------------------


def test_observed_application_limits_refuse_nothing_and_count(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    gw = make_gateway(config(
        engine.url, tmp_path / "u.db",
        chat={"budgets": [{"tokens": 20, "per": "1h", "mode": "observe"}],
              "max_requests": [{"requests": 2, "per": "1h", "mode": "observe"}]},
        agent={"max_concurrency": {"limit": 1, "mode": "observe"}}))
    # budget 20: the first (13) fits, the next three would not (7 left; a request it would
    # have refused is not charged to it); requests 2/1h: the third and fourth would not
    assert [post(gw, CHAT, BIG).status_code for _ in range(4)] == [200] * 4
    would = "tokenpace_gateway_would_reject_total"
    assert gw.wait_metric(would, 3.0, tenant="acme", application="chat", reason="budget") == 3.0
    assert gw.metric(would, tenant="acme", application="chat", reason="requests") == 2.0
    # an observed max_concurrency 1: two at once both run, the second is counted
    engine.engine.gate = threading.Event()
    answers: list[int] = []
    threads = [threading.Thread(target=lambda: answers.append(
        post(gw, AGENT, {"model": "fake", "prompt": "hi", "max_tokens": 2}).status_code))
        for _ in range(2)]
    for t in threads:
        t.start()
    try:
        assert gw.wait_metric("tokenpace_gateway_inflight_requests", 2.0, timeout_s=30,
                              tenant="acme") == 2.0
        assert gw.wait_metric(would, 1.0, tenant="acme", application="agent",
                              reason="max_concurrency") == 1.0
    finally:
        engine.engine.gate.set()
        for t in threads:
            t.join()
    assert answers == [200, 200]
    assert gw.metric(would, tenant="acme", application="") is None  # the tenant has none
    assert gw.metric("tokenpace_gateway_rejections_total", tenant="acme") is None
    assert gw.metric("tokenpace_gateway_application_requests_total", tenant="acme",
                     application="chat", outcome="length") == 4.0


# -- request rate --------------------------------------------------------------------------


def test_an_application_request_rate_limit_answers_openai_429s(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    gw = make_gateway(config(engine.url, tmp_path / "u.db",
                             tenant={"max_requests": [{"requests": 4, "per": "1h"}]},
                             chat={"max_requests": [{"requests": 2, "per": "1h"}]}))
    assert [post(gw, CHAT, BIG).status_code for _ in range(2)] == [200, 200]
    resp = post(gw, CHAT, BIG)
    error = refused(resp)
    assert "request rate limit 2 per 1h of application 'chat' of tenant 'acme' reached" \
        in error["message"], error
    assert resp.headers["x-ratelimit-limit-requests"] == "2"
    assert resp.headers["x-ratelimit-remaining-requests"] == "0"
    assert 3590 <= go_seconds(resp.headers["x-ratelimit-reset-requests"]) <= 3600
    assert int(resp.headers["retry-after"]) in range(1790, 1801)  # 1800 s per request
    assert "x-ratelimit-limit-tokens" not in resp.headers
    # the sibling is not limited by chat's limit, and chat's refusal did not count against
    # the tenant's 4/1h: agent has exactly the two left
    assert [post(gw, AGENT, BIG).status_code for _ in range(2)] == [200, 200]
    resp = post(gw, AGENT, BIG)
    error = refused(resp)
    assert "request rate limit 4 per 1h reached" in error["message"], error
    assert "application" not in error["message"]
    assert resp.headers["x-ratelimit-limit-requests"] == "4"
    assert resp.headers["x-ratelimit-remaining-requests"] == "0"
    assert post(gw, "sk-other", BIG).status_code == 200  # another tenant is not limited
    assert gw.wait_metric("tokenpace_gateway_rejections_total", 2.0, tenant="acme",
                          reason="requests") == 2.0
    assert len(engine.engine.requests) == 5


# -- configuration -------------------------------------------------------------------------


def _tenant_config(**acme: Any) -> dict[str, Any]:
    return {"engines": ["http://127.0.0.1:1"], "ledger": "sqlite:///unused.db",
            "tenants": [{"id": "acme", **acme}, {"id": "other", "api_keys": ["sk-other"]}]}


def _refused(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


def test_configurations_that_are_refused_name_the_key_path() -> None:
    apps = [{"id": "chat", "api_keys": [CHAT]}, {"id": "agent", "api_keys": [AGENT]}]
    ok = parse_config(_tenant_config(applications=apps))  # no key of the tenant's own
    acme = ok.tenant("acme")
    assert acme is not None and [a.id for a in acme.applications] == ["chat", "agent"]
    identity = ok.identity_for_key(AGENT)
    assert identity is not None and identity[0].id == "acme" and identity[1] is not None \
        and identity[1].id == "agent"
    observed = parse_config(_tenant_config(applications=[
        {"id": "chat", "api_keys": [CHAT], "weight": 3,
         "max_concurrency": {"limit": 2, "mode": "observe"},
         "budgets": [{"tokens": 200, "per": "1h", "mode": "observe"}],
         "max_requests": [{"requests": 5, "per": "1m"}]}])).tenant("acme")
    assert observed is not None
    chat = observed.applications[0]
    assert (chat.weight, chat.max_concurrency, chat.observed_concurrency) == (3.0, None, 2)
    assert (chat.budgets, len(chat.observed_budgets), len(chat.max_requests)) == ((), 1, 1)

    message = _refused(_tenant_config(api_keys=[OWN], applications=[
        {"id": "chat", "api_keys": [CHAT]}, {"id": "chat", "api_keys": [AGENT]}]))
    assert message.startswith("tenants[0].applications[1].id: application 'chat' is defined "
                              "twice in the tenant"), message
    message = _refused(_tenant_config(applications=[
        {"id": "chat", "api_keys": [CHAT]}, {"id": "agent", "api_keys": [CHAT]}]))
    assert message.startswith("tenants[0].applications[1].api_keys:"), message
    assert "'chat'" in message and "'agent'" in message
    message = _refused(_tenant_config(api_keys=[CHAT], applications=[
        {"id": "chat", "api_keys": [CHAT]}]))
    assert message.startswith("tenants[0].applications[0].api_keys:"), message
    # ... and across tenants: another tenant's own key
    data = _tenant_config(api_keys=[OWN], applications=[{"id": "chat", "api_keys": [CHAT]}])
    data["tenants"][1]["api_keys"] = [CHAT]
    message = _refused(data)
    assert message.startswith("tenants[1].api_keys:") and "'chat'" in message, message
    message = _refused(_tenant_config(api_keys=[OWN], applications=[{"id": "chat"}]))
    assert message.startswith("tenants[0].applications[0].api_keys: at least one key"), message
    # max_queued is the tenant's alone: on an application it is an unknown key, not a
    # setting that silently does nothing.
    message = _refused(_tenant_config(api_keys=[OWN], applications=[
        {"id": "chat", "api_keys": [CHAT], "max_queued": 1}]))
    assert message.startswith("tenants[0].applications[0].max_queued: unknown key"), message
    message = _refused(_tenant_config(api_keys=[OWN], applications=[
        {"id": "chat", "api_keys": [CHAT], "output_tokens_per_second": 0}]))
    assert message.startswith("tenants[0].applications[0].output_tokens_per_second: "
                              "expected a number greater than 0"), message
    message = _refused(_tenant_config(api_keys=[OWN], applications=[
        {"id": "chat", "api_keys": [CHAT], "budgets": [{"tokens": 0, "per": "1h"}]}]))
    assert message.startswith("tenants[0].applications[0].budgets[0]"), message
    message = _refused(_tenant_config(api_keys=[OWN], applications=[
        {"id": "ch\x1fat", "api_keys": [CHAT]}]))
    assert message.startswith("tenants[0].applications[0].id: must not contain control"), message
    message = _refused(_tenant_config(api_keys=[OWN], applications=[{"api_keys": [CHAT]}]))
    assert message.startswith("tenants[0].applications[0].id: required"), message
    for acme in ({}, {"applications": []}, {"api_keys": []}):
        message = _refused(_tenant_config(**acme))
        assert message.startswith("tenants[0].api_keys: at least one key"), (acme, message)


def test_the_gateway_command_refuses_a_bad_application_config(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(_tenant_config(api_keys=[OWN], applications=[
        {"id": "chat", "api_keys": [CHAT]}, {"id": "chat", "api_keys": [AGENT]}])))
    done = subprocess.run([sys.executable, "-m", "tokenpace.cli", "gateway", "--config", str(path),
                           "--port", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "tenants[0].applications[1].id: application 'chat' is defined twice" in done.stderr


# -- reload --------------------------------------------------------------------------------


def test_a_reload_that_changes_an_application_keeps_its_spent_budget(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    cfg = config(engine.url, tmp_path / "u.db",
                 tenant={"budgets": [{"tokens": 40, "per": "1h"}]},
                 chat={"weight": 3, "budgets": [{"tokens": 30, "per": "1h"}]})
    gw = make_gateway(cfg)
    # chat: 30 -> 4; the tenant: 40 -> 14
    assert [post(gw, CHAT, BIG).status_code for _ in range(2)] == [200, 200]
    new = copy.deepcopy(cfg)
    new["tenants"][0]["applications"][0]["weight"] = 1
    new["tenants"][0]["applications"][1]["max_concurrency"] = 2
    gw.write(new)
    resp = httpx.post(gw.url + "/admin/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert resp.status_code == 200, resp.text
    # chat's level was kept: refilled it would take 13 (30 tokens)
    resp = post(gw, CHAT, BIG)
    error = refused(resp)
    assert "token budget 30/1h of application 'chat' of tenant 'acme' exhausted" \
        in error["message"], error
    assert resp.headers["x-ratelimit-remaining-tokens"] == "4"
    # the tenant's too: 14 takes one more, then 1 is left
    assert post(gw, AGENT, BIG).status_code == 200
    resp = post(gw, AGENT, BIG)
    assert "token budget 40/1h of tenant 'acme' exhausted" in refused(resp)["message"]
    assert resp.headers["x-ratelimit-remaining-tokens"] == "1"


def test_admitted_responses_carry_the_tightest_limits_headers(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    """Like OpenAI's, every admitted response (streamed or not) carries
    ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` of the tightest limit of
    each kind over the tenant and its application, after this request's share; a tenant
    without limits gets none."""
    gw = make_gateway(config(engine.url, tmp_path / "u.db",
                             tenant={"budgets": [{"tokens": 100, "per": "1h"}],
                                     "max_requests": [{"requests": 5, "per": "1m"}]},
                             chat={"budgets": [{"tokens": 50, "per": "1h"}]}))
    resp = post(gw, CHAT, BIG)  # 13: chat 50 -> 37, the tenant 100 -> 87
    assert resp.status_code == 200, resp.text
    h = resp.headers
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("50", "37")
    assert 930 <= go_seconds(h["x-ratelimit-reset-tokens"]) <= 940  # 13 at 50 an hour
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("5", "4")
    assert 11.5 <= go_seconds(h["x-ratelimit-reset-requests"]) <= 12  # one at 5 a minute
    # The tenant's own key: the tenant's budget (87 -> 74), its request limit (4 -> 3).
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=60,
                      content=json.dumps({**BIG, "stream": True}),
                      headers={"authorization": f"Bearer {OWN}"}) as streamed:
        assert streamed.status_code == 200
        assert "data: [DONE]" in streamed.read().decode()
        h = streamed.headers
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("100", "74")
    assert h["x-ratelimit-remaining-requests"] == "3"
    resp = post(gw, "sk-other", BIG)
    assert resp.status_code == 200
    assert not [name for name in resp.headers if name.startswith("x-ratelimit")]
