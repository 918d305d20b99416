"""The shipped Prometheus configuration and alert rules, checked by Prometheus's own promtool:
syntax, and each alert's unit tests with synthetic series (deploy/prometheus/tests/)."""

from __future__ import annotations

import subprocess

import pytest

from tests.monitoring._deploy import PROMETHEUS_CONFIG, RULE_TESTS, RULES, prometheus_binary, rules


def promtool(*args: str) -> str:
    proc = subprocess.run([prometheus_binary("promtool"), *args], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, f"promtool {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.prometheus
def test_config_and_rules_are_valid() -> None:
    promtool("check", "config", str(PROMETHEUS_CONFIG))  # also checks the rule files it names
    promtool("check", "rules", str(RULES))


@pytest.mark.prometheus
def test_every_alert_passes_its_unit_tests() -> None:
    promtool("test", "rules", str(RULE_TESTS))


def test_every_alert_has_a_unit_test_and_a_runbook() -> None:
    tested = RULE_TESTS.read_text()
    for rule in rules():
        assert f"alertname: {rule['alert']}" in tested, f"{rule['alert']} has no promtool test"
        assert rule["annotations"].get("runbook", "").strip(), f"{rule['alert']} has no runbook"
        assert rule["labels"].get("severity") in ("warning", "critical"), rule["alert"]
