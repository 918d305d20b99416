"""Observe mode's log: at most one line a minute per tenant and reason, with the count."""

from __future__ import annotations

import logging

import pytest

from tokenpace.gateway.tenants._would_reject import LOG_EVERY_S, WouldRejectLog


def test_one_line_a_minute_per_tenant_and_reason_with_the_count_since(
        caplog: pytest.LogCaptureFixture) -> None:
    log = WouldRejectLog()
    with caplog.at_level(logging.WARNING, logger="tokenpace.gateway"):
        log.note("a", "tenant 'a'", "budget", "budget 100/1m", 0.0)  # the first is logged at once
        for t in range(1, 50):
            log.note("a", "tenant 'a'", "budget", "budget 100/1m", float(t))
        log.note("a", "tenant 'a'", "requests", "max_requests 3/1m", 10.0)  # another reason: its own line
        log.note("b", "tenant 'b'", "budget", "budget 100/1m", 10.0)  # another tenant: its own line
        log.note("a", "tenant 'a'", "budget", "budget 100/1m", LOG_EVERY_S)  # a minute on: 50 since
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "tenant 'a': budget 100/1m in observe mode would have refused 1 request(s)",
        "tenant 'a': max_requests 3/1m in observe mode would have refused 1 request(s)",
        "tenant 'b': budget 100/1m in observe mode would have refused 1 request(s)",
        "tenant 'a': budget 100/1m in observe mode would have refused 50 request(s) "
        "in the last 60 s",
    ]


def test_concurrency_says_held_back_and_a_forgotten_tenant_starts_over(
        caplog: pytest.LogCaptureFixture) -> None:
    log = WouldRejectLog()
    with caplog.at_level(logging.WARNING, logger="tokenpace.gateway"):
        log.note("a", "tenant 'a'", "max_concurrency", "max_concurrency 4", 0.0)
        log.forget("a")
        log.note("a", "tenant 'a'", "max_concurrency", "max_concurrency 4", 1.0)
    assert [r.getMessage() for r in caplog.records] == [
        "tenant 'a': max_concurrency 4 in observe mode would have held back 1 request(s)"] * 2


def test_an_applications_lines_name_it_and_go_with_its_tenant(
        caplog: pytest.LogCaptureFixture) -> None:
    log = WouldRejectLog()
    owner = "a\x1fbot"  # ApplicationConfig.owner("a")
    label = "application 'bot' of tenant 'a'"
    with caplog.at_level(logging.WARNING, logger="tokenpace.gateway"):
        log.note(owner, label, "budget", "budget 100/1m", 0.0)
        log.note("a", "tenant 'a'", "budget", "budget 100/1m", 1.0)  # the tenant's own: apart
        log.note(owner, label, "budget", "budget 100/1m", 2.0)  # within the minute: counted
        log.forget("a")  # the tenant's series went: its applications' log state too
        log.note(owner, label, "budget", "budget 100/1m", 3.0)
    assert [r.getMessage() for r in caplog.records] == [
        "application 'bot' of tenant 'a': budget 100/1m in observe mode would have refused "
        "1 request(s)",
        "tenant 'a': budget 100/1m in observe mode would have refused 1 request(s)",
        "application 'bot' of tenant 'a': budget 100/1m in observe mode would have refused "
        "1 request(s)",
    ]
