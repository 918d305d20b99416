"""A real Prometheus, with the shipped configuration and alert rules, scraping a real gateway
in front of a real ``tokenpace serve --trusted-gateway`` engine (tiny model) after a short
load; then every query of the dashboard and of the rules runs through Prometheus's HTTP API.

Each query must be valid, and every dashboard query must return series: the load below
exercises every panel (streams from two tenants in two lanes, a tenant queueing behind its
concurrency limit, refusals, budgets). ``EXPECTED_EMPTY`` names a panel query that this load
cannot fill, with the reason; it is empty today. Every metric name the dashboard or the
rules use must exist in Prometheus, so a renamed metric (ours or vLLM's) fails here.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests._engine_pool import ModuleEngines
from tests._servers import Server, free_port, tokenpace_serve_argv
from tests.gateway.conftest import GatewayProcess
from tests.monitoring._deploy import (
    PROMETHEUS_CONFIG,
    RULES,
    all_metric_names,
    dashboard_queries,
    expand,
    prometheus_binary,
    rule_queries,
    rules,
    variable_queries,
)

pytestmark = [pytest.mark.vllm, pytest.mark.prometheus]

KEY_A, KEY_B = "sk-mon-a", "sk-mon-b"
KEY_A_APP = "sk-mon-a-app"  # an application of a's, with a budget of its own
EXPECTED_EMPTY: dict[str, str] = {}
# What the load ends with, so the test knows when Prometheus has scraped all of it: requests of
# known tenants (6 streams, 1 refused), refusals (one of them without a valid key), and
# what a's request limit in observe mode would have refused.
DONE = ("sum(tokenpace_gateway_requests_total) >= 7 and sum(tokenpace_gateway_rejections_total) >= 2"
        " and sum(tokenpace_gateway_would_reject_total) >= 2")


@dataclass
class Stack:
    prometheus: str  # base URL
    engine: Server
    gateway: GatewayProcess


def engine_scrape_key() -> str:
    """The engine key of the shipped scrape config (the engine job's bearer credentials)."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "tokenpace-engine"]
    return job["authorization"]["credentials"]


def start_prometheus(binary: str, home: Path, targets: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """The shipped prometheus.yml with this test's targets, 1 s scrapes and rule evaluations,
    and the shipped rule file."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(RULES)]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(targets), f"jobs in prometheus.yml: {sorted(jobs)}"
    for name, target in targets.items():
        jobs[name]["static_configs"] = [{"targets": [target]}]
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(home / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={home / 'prometheus.yml'}", f"--storage.tsdb.path={home / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((home / "prometheus.log").read_text()[-3000:])
        try:
            if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("prometheus not ready after 60 s")


def query(url: str, expr: str) -> dict[str, Any]:
    return httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()


def run_load(gw: GatewayProcess) -> None:
    def stream(key: str) -> None:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=120)
        for _ in client.chat.completions.create(
                model="tiny", stream=True, max_tokens=20,
                messages=[{"role": "user", "content": "Hello"}]):
            pass

    # b's concurrency limit of 1 makes two of its three streams wait in the gateway queue.
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(stream, [KEY_A, KEY_A, KEY_A_APP] + [KEY_B] * 3))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
    assert httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30,
                      headers={"authorization": "Bearer sk-nobody"}).status_code == 401
    assert httpx.post(f"{gw.url}/v1/chat/completions", json={**body, "max_tokens": 1000}, timeout=30,
                      headers={"authorization": f"Bearer {KEY_A}"}).status_code == 400


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    prometheus_binary("prometheus")  # its skip (or CI failure) before the slow engine start
    port = free_port()
    # The engine requires the key that the shipped prometheus.yml scrapes it with (that of
    # examples/gateway.yaml), so this also proves the shipped scrape config authenticates.
    return [Server(tokenpace_serve_argv(tiny_model, port, "--trusted-gateway",
                                        "--scheduling-policy", "priority"), port, home / "vllm.log",
                   env={"VLLM_API_KEY": engine_scrape_key()})]


@pytest.fixture(scope="module")
def stack(module_engines: ModuleEngines) -> Iterator[Stack]:
    binary = prometheus_binary("prometheus")
    [engine], home = module_engines.servers, module_engines.home
    port, engine_key = engine.port, engine_scrape_key()
    gw = prom = None
    try:
        gw = GatewayProcess(home, {
            "engines": [{"url": engine.base_url, "api_key": engine_key, "max_inflight": 8,
                         "scheduling_policy": "priority"}],
            "lanes": [{"name": "interactive", "priority": 0}, {"name": "batch", "priority": 10}],
            "ledger": f"sqlite:///{home / 'usage.db'}",
            "tenants": [
                {"id": "a", "api_keys": [KEY_A], "lane": "interactive", "output_tokens_per_second": 100,
                 "max_output_tokens": 64, "budgets": [{"tokens": 1000000, "per": "1d"}],
                 "applications": [{"id": "app", "api_keys": [KEY_A_APP],
                                   "budgets": [{"tokens": 500000, "per": "month"}]}],
                 # observe mode: a's 2nd to 4th requests would be refused, none is
                 "max_requests": [{"requests": 1, "per": "1h", "mode": "observe"}]},
                {"id": "b", "api_keys": [KEY_B], "lane": "batch", "output_tokens_per_second": 50,
                 "max_concurrency": 1, "budgets": [{"tokens": 5000, "per": "10s"}]},
            ],
        }).start()
        prom, url = start_prometheus(binary, home, {
            "tokenpace-gateway": f"127.0.0.1:{gw.port}", "tokenpace-engine": f"127.0.0.1:{port}"})
        run_load(gw)
        # Wait for a scrape that saw every ended request, then a few more so that every
        # rate() window holds several samples after the load.
        deadline = time.monotonic() + 60
        while True:
            if query(url, DONE)["data"]["result"]:
                break
            assert time.monotonic() < deadline, f"Prometheus never saw the whole load: {DONE}"
            time.sleep(0.5)
        time.sleep(3)
        yield Stack(url, engine, gw)
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
        if gw is not None:
            gw.stop()


def test_every_dashboard_query_is_valid_and_returns_series(stack: Stack) -> None:
    problems = []
    for q in dashboard_queries():
        answer = query(stack.prometheus, expand(q.expr))
        if answer.get("status") != "success":
            problems.append(f"{q.where}: {answer.get('error')}")
        elif not answer["data"]["result"] and q.where not in EXPECTED_EMPTY:
            problems.append(f"{q.where}: no series for {expand(q.expr)}")
    assert not problems, "\n".join(problems)


# Exported only by a gateway with `state: redis://...` (the fallbacks with
# `on_state_failure: open`); this stack has one in-process gateway. Their names are checked
# against the state store's collector in test_dashboard.py, their alerts by promtool.
ONLY_WITH_SHARED_STATE = {"tokenpace_gateway_state_up", "tokenpace_gateway_state_fallbacks_total"}
# Series only once the ledger differs from the engines (a tenant's first drift); the names are
# checked against the registry in test_dashboard.py, the alert by promtool.
ONLY_WITH_DRIFT = {"tokenpace_gateway_ledger_unrecorded_tokens_total",
                   "tokenpace_gateway_ledger_overcharged_tokens_total"}


def test_every_metric_name_used_exists_in_prometheus(stack: Stack) -> None:
    missing = [name for name in sorted(all_metric_names() - ONLY_WITH_SHARED_STATE
                                       - ONLY_WITH_DRIFT)
               if not query(stack.prometheus, f'count({{__name__="{name}"}})')["data"]["result"]]
    assert not missing, f"no such series in Prometheus (renamed?): {missing}"


def test_dashboard_variables_list_the_tenants_and_the_engine(stack: Stack) -> None:
    values = {}
    for name, metric, label in variable_queries():
        values[name] = set(httpx.get(f"{stack.prometheus}/api/v1/label/{label}/values",
                                     params={"match[]": metric}, timeout=10).json()["data"])
    assert values["tenant"] == {"a", "b"}
    assert values["engine"] == {f"127.0.0.1:{stack.engine.port}"}


def test_every_alert_rule_evaluates_and_none_fires(stack: Stack) -> None:
    for q in rule_queries():
        answer = query(stack.prometheus, q.expr)
        assert answer.get("status") == "success", f"{q.where}: {answer.get('error')}"
    loaded = {}
    deadline = time.monotonic() + 10
    while True:
        groups = httpx.get(f"{stack.prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        if all(r.get("lastEvaluation", "0001").startswith("20") for r in loaded.values()) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(loaded) == {r["alert"] for r in rules()}
    for name, rule in loaded.items():
        assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"
        assert rule["state"] == "inactive", f"{name} is {rule['state']} on a healthy stack"
