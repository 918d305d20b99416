"""Applications' live state across reloads and restarts: an application that stays keeps
its buckets' levels and its requests in flight, one removed goes, one added starts full;
its budget levels go to the ledger's snapshot under its owner name and come back from it."""

from __future__ import annotations

from typing import Any

from tokenpace.gateway import parse_config
from tokenpace.gateway.config import APPLICATION_SEPARATOR
from tokenpace.gateway.tenants import Tenants


def _config(*applications: dict[str, Any]) -> Any:
    return parse_config({
        "engines": ["http://127.0.0.1:1"], "ledger": "sqlite:///unused.db",
        "tenants": [{"id": "t", "api_keys": ["k"], "budgets": [{"tokens": 100, "per": "1h"}],
                     "applications": list(applications)}],
    })


CHAT = {"id": "chat", "api_keys": ["k-chat"], "budgets": [{"tokens": 50, "per": "1h"}]}
OWNER = f"t{APPLICATION_SEPARATOR}chat"


def test_a_reload_keeps_a_staying_applications_state_and_levels() -> None:
    now = [0.0]
    tenants = Tenants(_config(CHAT), lambda: now[0])
    chat = tenants.get("t").applications["chat"]
    assert chat.try_reserve(30.0, 0.0) is None
    chat.inflight = 2
    tenants.apply(_config({**CHAT, "weight": 3}))  # the weight changes, not the budget
    same = tenants.get("t").applications["chat"]
    assert same is chat and same.config.weight == 3.0 and same.inflight == 2
    assert same.budgets.levels(0.0) == {"50/1h": 20.0}, "not refilled by the reload"
    # A new budget beside the old one: the old keeps its level, the new starts full.
    tenants.apply(_config({**CHAT, "budgets": [{"tokens": 50, "per": "1h"},
                                               {"tokens": 10, "per": "1m"}]}))
    assert chat.budgets.levels(0.0) == {"50/1h": 20.0, "10/1m": 10.0}
    # Removed, then added again: a fresh state (a request in flight keeps the old object).
    tenants.apply(_config({"id": "bot", "api_keys": ["k-bot"]}))
    assert set(tenants.get("t").applications) == {"bot"}
    tenants.apply(_config(CHAT))
    assert tenants.get("t").applications["chat"] is not chat
    assert tenants.get("t").applications["chat"].budgets.levels(0.0) == {"50/1h": 50.0}


def test_application_levels_are_snapshot_under_their_owner_and_restored() -> None:
    now = [0.0]
    config = _config(CHAT)
    tenants = Tenants(config, lambda: now[0])
    assert tenants.changed_levels() == {}
    tenants.get("t").applications["chat"].try_reserve(30.0, 0.0)
    snapshot = tenants.changed_levels()
    assert snapshot == {"t": {"100/1h": 100.0}, OWNER: {"50/1h": 20.0}}
    assert tenants.changed_levels() == {}, "written once"
    # A restart 36 s later: the saved level plus 36 s of refill (50 per hour: 0.5).
    saved = {owner: {key: (level, 36.0) for key, level in levels.items()}
             for owner, levels in snapshot.items()}
    restored = Tenants(config, lambda: 0.0, saved)
    assert restored.get("t").applications["chat"].budgets.levels(0.0) == {"50/1h": 20.5}


def test_a_key_names_its_tenant_and_application() -> None:
    config = _config(CHAT)
    tenant, app = config.identity_for_key("k-chat")  # type: ignore[misc]
    assert (tenant.id, app.id if app else None) == ("t", "chat")
    assert config.identity_for_key("k") == (config.tenants[0], None)
    assert config.identity_for_key("nope") is None
    assert config.tenant_for_key("k-chat") is config.tenants[0]
    # The prefix-cache salt is keyed with every key of the tenant, its applications' too.
    assert config.tenants[0].cache_salt != _config().tenants[0].cache_salt


def test_an_applications_rates_are_read_and_checked() -> None:
    import pytest

    from tokenpace.gateway import ConfigError

    app = _config({**CHAT, "output_tokens_per_second": 30,
                   "end_user_output_tokens_per_second": 4}).tenants[0].applications[0]
    assert (app.output_tokens_per_second, app.end_user_output_tokens_per_second) == (30.0, 4.0)
    with pytest.raises(ConfigError, match=r"applications\[0\]\.end_user_output_tokens_per_second"):
        _config({**CHAT, "end_user_output_tokens_per_second": -1})
