"""A calendar budget over real HTTP (in process and shared in a real redis-server): its
429 and headers say when the month ends; ``GET /tokenpace/v1/me`` shows a tenant its own
limits and budgets; ``GET /v1/organization/usage/completions`` gives an admin the ledger's
usage in OpenAI's shape, equal to ``tokenpace usage`` over the same rows."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import ADMIN_HEADERS, KEY_A, KEY_B, base_config

USAGE = "/v1/organization/usage/completions"


def post(url: str, key: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=30,
                      json={"model": "fake", "prompt": "hello", "max_tokens": max_tokens},
                      headers={"authorization": f"Bearer {key}"})


def next_month(t: float) -> datetime:
    now = datetime.fromtimestamp(t, timezone.utc)
    return datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=timezone.utc)


@pytest.mark.parametrize("state", ["memory", "redis"])
def test_a_month_budget_refuses_until_the_first_and_me_shows_it(
        state: str, engine: EngineServer, make_gateway: Any, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    cfg = base_config(engine.url, tmp_path / "u.db")
    # team-b: cost 1 x prompt + 2 x completion; each request reserves 1 + 2 x 4 at least.
    cfg["tenants"][1]["budgets"] = [{"tokens": 60, "per": "month"},
                                    {"tokens": 100000, "per": "1h"}]
    cfg["tenants"][1]["max_requests"] = [{"requests": 1000, "per": "1d"}]
    if state == "redis":
        cfg["state"] = request.getfixturevalue("redis_server").url
    gw = make_gateway(cfg)
    answers = [post(gw.url, KEY_B) for _ in range(8)]
    codes = [a.status_code for a in answers]
    assert 200 in codes and codes[-1] == 429, codes
    refused = answers[-1]
    error = refused.json()["error"]
    end = next_month(time.time())
    assert "token budget 60/month" in error["message"]
    assert f"it resets at {end.strftime('%Y-%m-%dT%H:%M:%SZ')}" in error["message"], error
    until = end.timestamp() - time.time()
    assert abs(int(refused.headers["retry-after"]) - until) < 60
    assert refused.headers["x-ratelimit-limit-tokens"] == "60"
    reset = refused.headers["x-ratelimit-reset-tokens"]  # OpenAI's format: 412h3m2.5s
    hours = int(reset.split("h")[0]) if "h" in reset else 0
    assert abs(hours * 3600 - until) < 3600 + 60, reset

    me = httpx.get(gw.url + "/tokenpace/v1/me", headers={"authorization": f"Bearer {KEY_B}"})
    assert me.status_code == 200, me.text
    body = me.json()
    assert (body["tenant"], body["application"], body["lane"]) == ("team-b", None, "batch")
    assert body["models"] == ["fake"]
    month = next(b for b in body["budgets"] if b["key"] == "60/month")
    spent = sum(r.cost for r in gw.rows(codes.count(200)) if r.tenant == "team-b")
    assert month["limit"] == 60 and month["per"] == "month" and month["mode"] == "enforce"
    assert month["used"] == pytest.approx(spent) and month["remaining"] == pytest.approx(60 - spent)
    assert month["resets_at"] == month["period_end"] == end.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert month["period_start"].endswith("-01T00:00:00Z")
    hourly = next(b for b in body["budgets"] if b["key"] == "100000/1h")
    assert hourly["per"] == "1h" and "period_end" not in hourly
    assert 0 < hourly["resets_in_s"] < 3600
    (daily,) = body["max_requests"]
    # Counted are the requests that passed the cheap refusals (the budget's output part).
    assert daily["key"] == "requests:1000/1d" and codes.count(200) - 0.1 < daily["used"] <= 8
    assert body["limits"]["tenant"]["max_queued"] is not None
    # The threshold gauge: the fraction of the month's budget used (with Redis, as read in
    # the background every 2 s).
    deadline = time.monotonic() + 10
    while (ratio := gw.metric("tokenpace_gateway_budget_used_ratio", tenant="team-b",
                              budget="60/month")) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ratio == pytest.approx(spent / 60)
    # Only one's own key: none is a 401 in the gateway's format.
    anonymous = httpx.get(gw.url + "/tokenpace/v1/me")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    other = httpx.get(gw.url + "/tokenpace/v1/me", headers={"authorization": f"Bearer {KEY_A}"})
    assert other.json()["tenant"] == "team-a" and other.json()["budgets"] == []


def usage(url: str, query: str, headers: dict[str, str] = ADMIN_HEADERS) -> httpx.Response:
    return httpx.get(f"{url}{USAGE}?{query}", headers=headers, timeout=30)


def cli_usage(ledger: Path, since: float, by: str) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "tokenpace.cli", "usage", "--ledger",
                          f"sqlite:///{ledger}", "--since", datetime.fromtimestamp(
                              since, timezone.utc).isoformat(), "--by", by, "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_the_usage_api_equals_tokenpace_usage_over_the_rows_the_gateway_wrote(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    gw = make_gateway(base_config(engine.url, tmp_path / "u.db"))
    start = math.floor(time.time()) - 1
    for key, n in ((KEY_A, 3), (KEY_B, 2)):
        for _ in range(n):
            assert post(gw.url, key).status_code == 200
    assert httpx.post(gw.url + "/v1/completions", json={"model": "nope", "prompt": "x"},
                      headers={"authorization": f"Bearer {KEY_B}"}).status_code == 404
    rows = gw.rows(6)
    assert len(rows) == 6
    end = math.ceil(max(r.ended_at for r in rows)) + 1

    page = usage(gw.url, f"start_time={start}&end_time={end}&bucket_width=1d"
                 "&group_by=project_id&group_by=model")
    assert page.status_code == 200, page.text
    body = page.json()
    assert body["object"] == "page" and body["has_more"] is False and body["next_page"] is None
    (bucket,) = body["data"]
    assert (bucket["object"], bucket["start_time"], bucket["end_time"]) == ("bucket", start, end)
    results = {r["project_id"]: r for r in bucket["results"]}
    assert set(results) == {"team-a", "team-b"}  # the refusal (no model) is no model request
    for total in cli_usage(tmp_path / "u.db", start, "tenant"):
        if total["tenant"] not in results:
            assert total["requests"] == total["rejected"]
            continue
        r = results[total["tenant"]]
        assert r["object"] == "organization.usage.completions.result"
        assert r["model"] == "fake"
        assert r["input_tokens"] == total["prompt_tokens"]
        assert r["output_tokens"] == total["completion_tokens"]
        assert r["input_cached_tokens"] == total["cached_prompt_tokens"]
        assert r["num_model_requests"] == total["requests"] - total["rejected"]
    assert results["team-a"]["num_model_requests"] == 3

    # A comma-separated group_by is the same query; minute buckets add up to the day's.
    same = usage(gw.url, f"start_time={start}&end_time={end}&group_by=project_id,model")
    assert same.json() == body
    minutes = usage(gw.url, f"start_time={start}&end_time={end}&bucket_width=1m"
                    "&group_by=project_id").json()
    per_minute = [r for b in minutes["data"] for r in b["results"]]
    for tenant, r in results.items():
        assert sum(m["output_tokens"] for m in per_minute if m["project_id"] == tenant) == \
            r["output_tokens"]
    # No group_by: one result per bucket, every field null but the figures.
    whole = usage(gw.url, f"start_time={start}&end_time={end}").json()["data"][0]["results"]
    assert len(whole) == 1 and whole[0]["project_id"] is None and whole[0]["model"] is None
    assert whole[0]["num_model_requests"] == 5
    # Paging: one minute per page, next_page until the window ends.
    early = start - 3 * 60
    seen, query = [], f"start_time={early}&end_time={end}&bucket_width=1m&limit=1"
    while True:
        got = usage(gw.url, query).json()
        assert len(got["data"]) == 1
        seen += got["data"]
        if not got["has_more"]:
            break
        query = f"start_time={early}&end_time={end}&bucket_width=1m&limit=1&page={got['next_page']}"
    assert [b["start_time"] for b in seen] == list(range(early, end, 60))
    assert sum(r["num_model_requests"] for b in seen for r in b["results"]) == 5
    # Filters.
    only_b = usage(gw.url, f"start_time={start}&end_time={end}&project_ids=team-b"
                   "&group_by=project_id").json()["data"][0]["results"]
    assert [r["project_id"] for r in only_b] == ["team-b"]


BAD = [
    ("", "start_time"),
    ("start_time=abc", "start_time"),
    ("start_time=100&end_time=100", "end_time"),
    ("start_time=100&bucket_width=2h", "bucket_width"),
    ("start_time=100&limit=32", "limit"),
    ("start_time=100&bucket_width=1m&limit=1441", "limit"),
    ("start_time=100&group_by=user_id", "group_by"),
    ("start_time=100&user_ids=u1", "user_ids"),
    ("start_time=100&colour=red", "colour"),
    ("start_time=100&page=page_99", "page"),
    ("start_time=100&start_time=200", "start_time"),
]


def test_bad_parameters_are_a_400_naming_the_parameter_and_an_admin_key_is_needed(
        gateway: Any) -> None:
    """One gateway for every case (each would otherwise start its own)."""
    for query, param in BAD:
        resp = usage(gateway.url, query)
        assert resp.status_code == 400, (query, resp.text)
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert usage(gateway.url, "start_time=0", headers={}).status_code == 401
    tenant = usage(gateway.url, "start_time=0", headers={"authorization": f"Bearer {KEY_A}"})
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "invalid_api_key"
