"""What the shipped dashboard and alert rules ask Prometheus: every query, and the metric
names in them, read from the files in deploy/ (so a test cannot drift from what ships)."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "tokenpace.json"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULES = DEPLOY / "prometheus" / "rules" / "tokenpace.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "tests" / "tokenpace.rules.test.yml"

# Grafana's variables as the dashboard's "All" selection expands them.
GRAFANA_VARIABLES = {"$tenant": ".*", "$engine": ".*", "$__rate_interval": "1m"}

_METRIC = re.compile(r"(?<![\w:])(tokenpace_[a-z0-9_]+|vllm:[a-z0-9_:]+|process_[a-z0-9_]+|up)(?=\s*[{\[)]|\s*$|\s)")


@dataclass(frozen=True)
class Query:
    where: str  # "panel 'Queue depth' A", "alert TokenpaceTenantStarved"
    expr: str


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[Query]:
    out = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append(Query(f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    return out


def expand(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def variable_queries() -> list[tuple[str, str, str]]:
    """(variable, metric, label) of each ``label_values(metric, label)`` variable."""
    out = []
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\(([\w:]+),\s*(\w+)\)", var["query"]["query"])
        assert m, f"variable {var['name']}: expected label_values(metric, label)"
        out.append((var["name"], m.group(1), m.group(2)))
    return out


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def rule_queries() -> list[Query]:
    return [Query(f"alert {r['alert']}", r["expr"]) for r in rules()]


def metric_names(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def all_metric_names() -> set[str]:
    names: set[str] = set()
    for q in dashboard_queries() + rule_queries():
        names |= metric_names(q.expr)
    for _, metric, _ in variable_queries():
        names.add(metric)
    return names


def prometheus_binary(name: str) -> str:
    """Path of ``prometheus`` or ``promtool`` (Debian package ``prometheus``); in CI a missing
    one fails the test, elsewhere it skips it with the reason."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed (apt-get install prometheus; .ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return path
