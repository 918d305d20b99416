"""Static checks of the Grafana dashboard and the metric names that the dashboard and the
alert rules use; the live test (test_prometheus_live.py) runs every query for real."""

from __future__ import annotations

import re
from pathlib import Path

from tests.monitoring._deploy import all_metric_names, dashboard, dashboard_queries, expand
from tokenpace.gateway import metrics as _metrics

DOCS = Path(__file__).resolve().parents[2] / "docs"
GATEWAY_METRICS = DOCS / "gateway" / "metrics.md"
ENGINE_METRICS = DOCS / "engine" / "metrics.md"
PREFIX = "tokenpace_gateway_"


def _state_families() -> list:
    """The state store's families as a gateway with ``state: redis://...`` and
    ``on_state_failure: open`` exports them (its collector is registered at start-up)."""
    from tokenpace.gateway.state import LocalStore
    from tokenpace.gateway.state import FailoverStore
    from tokenpace.gateway.state import StateCollector
    from tokenpace.gateway.state import RedisStore

    store = FailoverStore(RedisStore("redis://127.0.0.1:1/0"), "open", LocalStore())
    return list(StateCollector(store).collect())


def exported_names() -> set[str]:
    """Series names the gateway's registry can export (counters as _total, histograms as
    _bucket/_count/_sum), whether or not a sample exists yet."""
    names = set()
    for family in [*_metrics.REGISTRY.collect(), *(g.family() for g in _metrics.LIVE),
                   *_state_families()]:
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_count", "_sum")}
        else:
            names.add(family.name)
    return names


def engine_names() -> set[str]:
    """Series names the engine's pacing page carries (one paced user, with a rate)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tokenpace.engine._metrics import exposition

    page = exposition({"users": {"u": [3, 1, 2, 0.5, 20.0]}, "idle_waits": 1,
                       "idle_wait_seconds": 0.1, "folded_users": 0}).decode()
    return {s.name for f in text_string_to_metric_families(page) for s in f.samples}


def test_every_gateway_metric_the_deploy_files_use_is_exported() -> None:
    """A renamed or removed gateway or engine metric fails here (and in the live test)."""
    used = {n for n in all_metric_names() if n.startswith(("tokenpace_", "process_"))}
    missing = used - exported_names() - engine_names()
    assert not missing, f"used in deploy/ but not exported: {sorted(missing)}"


def test_every_engine_metric_is_documented() -> None:
    section = ENGINE_METRICS.read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    for name in engine_names():
        assert f"`{name}`" in section, f"{name}: not in docs/engine/metrics.md#metrics"


def test_no_created_series() -> None:
    """Counters and histograms would each add a ``_created`` series per label set."""
    _metrics.REQUESTS.labels("t", "l", "stop").inc(0)
    _metrics.QUEUE_SECONDS.labels("t").observe(0.1)
    try:
        samples = [s.name for f in _metrics.REGISTRY.collect() for s in f.samples]
        assert "tokenpace_gateway_requests_total" in samples
        assert not [n for n in samples if n.endswith("_created")]
    finally:
        _metrics.REQUESTS.remove("t", "l", "stop")
        _metrics.QUEUE_SECONDS.remove("t")


def test_every_gateway_metric_is_documented_once() -> None:
    section = GATEWAY_METRICS.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    for family in [*_metrics.REGISTRY.collect(), *(g.family() for g in _metrics.LIVE)]:
        if not family.name.startswith(PREFIX):
            continue
        short = family.name[len(PREFIX):] + ("_total" if family.type == "counter" else "")
        count = len(re.findall(rf"`{re.escape(short)}`", section))
        assert count == 1, f"{family.name}: documented {count} times in docs/gateway/metrics.md#metrics"


def test_dashboard_is_importable_with_a_datasource_variable() -> None:
    dash = dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"tenant", "engine"} <= set(variables)
    assert "__inputs" not in dash and "id" not in dash  # importable as is, no fixed uids
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel.get("description"), f"panel {panel['title']!r} has no description"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_tenant_panel_follows_the_tenant_variable() -> None:
    for q in dashboard_queries():
        expand(q.expr)  # no unknown variable
        if "tenant" in q.expr and "group_left" not in q.expr:
            assert 'tenant=~"$tenant"' in q.expr, q.where
