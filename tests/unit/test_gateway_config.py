"""gateway.yaml validation: every mistake names its key; the documented example loads."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest

from tokenpace.gateway import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]

GOOD: dict[str, Any] = {
    "engines": [{"url": "http://127.0.0.1:8001", "max_inflight": 32}],
    "cost": {"prompt": 1.0, "completion": 2.0},
    "lanes": [{"name": "interactive", "priority": 0}, {"name": "batch", "priority": 10}],
    "ledger": "sqlite:///usage.db",
    "admin_api_keys": ["admin"],
    "tenants": [
        {"id": "team-a", "api_keys": ["sk-a"], "lane": "interactive", "weight": 2,
         "output_tokens_per_second": 100, "end_user_output_tokens_per_second": 8,
         "max_concurrency": 8, "max_queued": 32,
         "max_input_tokens": 8192, "max_output_tokens": 1024,
         "budgets": [{"tokens": 20000, "per": "10s"}, {"tokens": 2000000, "per": "1d"}],
         "max_requests": [{"requests": 600, "per": "1m"}, {"requests": 10000, "per": "1d"}]},
        {"id": "team-b", "api_keys": ["sha256:" + hashlib.sha256(b"sk-b").hexdigest()]},
    ],
}


def with_change(path: str, value: Any) -> dict[str, Any]:
    config = copy.deepcopy(GOOD)
    node: Any = config
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node[part]
    last = parts[-1]
    if value is KeyError:
        del node[last]
    elif last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return config


def test_good_config_and_key_lookup(tmp_path: Path) -> None:
    config = parse_config(GOOD, base_dir=tmp_path)
    assert config.ledger == f"sqlite:///{tmp_path / 'usage.db'}"
    a = config.tenants[0]
    assert (a.lane, a.weight, a.max_concurrency, a.queue_timeout_s) == ("interactive", 2.0, 8, 60.0)
    assert [b.key for b in a.budgets] == ["20000/10s", "2000000/1d"]
    assert [(r.requests, r.period_s) for r in a.max_requests] == [(600, 60.0), (10000, 86400.0)]
    assert config.tenants[1].max_requests == ()
    assert (a.observed_budgets, a.observed_requests, a.observed_concurrency) == ((), (), None)
    assert a.end_user_output_tokens_per_second == 8.0
    assert config.tenants[1].end_user_output_tokens_per_second is None
    assert config.tenant_for_key("sk-a") is a
    assert config.tenant_for_key("sk-b") is config.tenants[1]
    assert config.tenants[1].lane == "interactive"  # the first lane by default
    assert config.tenant_for_key("sk-c") is None
    assert config.is_admin_key("admin") and not config.is_admin_key("sk-a")


def test_limits_in_observe_mode_are_kept_apart_from_enforced_ones() -> None:
    config = copy.deepcopy(GOOD)
    tenant = config["tenants"][0]
    tenant["budgets"].append({"tokens": 20000, "per": "10s", "mode": "observe"})
    tenant["max_requests"][1]["mode"] = "observe"
    tenant["max_concurrency"] = {"limit": 4, "mode": "observe"}
    a = parse_config(config).tenants[0]
    assert [b.key for b in a.budgets] == ["20000/10s", "2000000/1d"]
    assert [b.key for b in a.observed_budgets] == ["observe:20000/10s"]
    assert [r.key for r in a.max_requests] == ["requests:600/1m"]
    assert [r.key for r in a.observed_requests] == ["requests:observe:10000/1d"]
    assert (a.max_concurrency, a.observed_concurrency) == (None, 4)
    tenant["max_concurrency"] = {"limit": 4}  # mode enforce by default
    a = parse_config(config).tenants[0]
    assert (a.max_concurrency, a.observed_concurrency) == (4, None)


@pytest.mark.parametrize("path,value,message", [
    ("colour", "red", "colour: unknown key"),
    ("tenants.0.colour", "red", "tenants[0].colour: unknown key"),
    ("tenants.0.budgets.0.per", "10 parsecs", "tenants[0].budgets[0].per"),
    ("tenants.0.budgets.1.tokens", -5, "tenants[0].budgets[1].tokens"),
    ("tenants.0.lane", "gold", "tenants[0].lane: unknown lane 'gold'"),
    ("tenants.0.end_user_output_tokens_per_second", 0, "tenants[0].end_user_output_tokens_per_second"),
    ("tenants.0.max_requests.0.requests", 1.5, "tenants[0].max_requests[0].requests"),
    ("tenants.0.max_requests.0.requests", 0, "tenants[0].max_requests[0].requests"),
    ("tenants.0.max_requests.0.requests", KeyError, "tenants[0].max_requests[0].requests: required"),
    ("tenants.0.max_requests.1.per", "daily", "tenants[0].max_requests[1].per"),
    ("tenants.0.max_requests.1.tokens", 5, "tenants[0].max_requests[1].tokens: unknown key"),
    ("tenants.0.max_requests.1", {"requests": 600, "per": "60s"}, "max_requests: the same limit"),
    ("tenants.0.max_requests", {"requests": 600}, "tenants[0].max_requests"),
    ("tenants.0.max_requests.0.mode", "dry-run", "tenants[0].max_requests[0].mode: expected 'enforce'"),
    ("tenants.0.budgets.0.mode", "watch", "tenants[0].budgets[0].mode: expected 'enforce'"),
    ("tenants.0.max_concurrency", {"limit": 0, "mode": "observe"}, "tenants[0].max_concurrency.limit"),
    ("tenants.0.max_concurrency", {"mode": "observe"}, "tenants[0].max_concurrency.limit: required"),
    ("tenants.0.max_concurrency", {"limit": 2, "mode": "shadow"}, "tenants[0].max_concurrency.mode"),
    ("tenants.0.max_concurrency", {"limit": 2, "burst": 1}, "tenants[0].max_concurrency.burst: unknown key"),
    ("tenants.0.max_concurrency", 0, "tenants[0].max_concurrency"),
    ("tenants.0.max_output_tokens", "1024", "tenants[0].max_output_tokens"),
    ("tenants.0.weight", True, "tenants[0].weight"),
    ("tenants.0.api_keys", [], "tenants[0].api_keys"),
    ("tenants.1.api_keys", ["sk-a"], "also belongs to 'team-a'"),
    ("tenants.1.id", "team-a", "defined twice"),
    ("tenants.1.api_keys", ["sha256:abc"], "64 hex digits"),
    ("engines.0.url", "127.0.0.1:8001", "engines[0].url"),
    ("engines.0.scheduling_policy", "lifo", "engines[0].scheduling_policy"),
    ("engines", [], "engines: at least one"),
    ("engines", KeyError, "engines: required"),
    ("tenants", KeyError, "tenants: required"),
    ("cost.prompt", -1, "cost.prompt"),
    ("cost.cached_prompt", -0.5, "cost.cached_prompt"),
    ("cost.cached_prompt", "cheap", "cost.cached_prompt"),
    ("lanes.1.name", "interactive", "lane names must be unique"),
    ("lanes.0.priority", "high", "lanes[0].priority"),
    ("request_timeout", "soon", "request_timeout"),
    ("lanes.1.min_share", 1.5, "lanes[1].min_share"),
    ("engines.0.max_kv_cache_usage", 2, "engines[0].max_kv_cache_usage"),
    ("engines.0.max_engine_waiting", -1, "engines[0].max_engine_waiting"),
    ("repin_after", "never", "repin_after"),
    ("dispatch_order", "random", "dispatch_order"),
    ("prompt_count", "guess", "prompt_count"),
    ("ledger", 5, "ledger"),
    ("routing", "random", "routing: expected 'pool'"),
    ("pool_affinity", -1, "pool_affinity"),
    ("conversation_affinity", -1, "conversation_affinity"),
    ("conversation_affinity", "many", "conversation_affinity"),
    ("engines.0.models", "chat", "engines[0].models: expected a list"),
    ("engines.0.models", ["chat", "chat"], "engines[0].models: the same name"),
    ("models", [{"aliases": ["x"]}], "models[0].name: required"),
    ("models", [{"name": "a", "colour": 1}], "models[0].colour: unknown key"),
    ("models", [{"name": "a", "cost": {"prompt": -1}}], "models[0].cost.prompt"),
    ("models", [{"name": "a", "cost": {"cached_prompt": True}}], "models[0].cost.cached_prompt"),
    ("models", [{"name": "a"}, {"name": "b", "aliases": ["a"]}], "'a' is already given at models[0].name"),
    ("tenants.0.models", [], "tenants[0].models: at least one model"),
])
def test_mistakes_name_their_key(path: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_change(path, value))
    assert message in str(info.value)


def test_yaml_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text("engines: [\n  {url: x\n")
    with pytest.raises(ConfigError, match="line"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_documented_examples_load() -> None:
    for example in sorted((REPO / "examples").glob("*.yaml")):
        config = load_config(example)
        assert config.tenants, example


# -- engine API keys ---------------------------------------------------------------------


def test_engine_key_given_inline_or_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config(with_change("engines.0.api_key", "sk-engine"))
    assert cfg.engines[0].auth_headers() == {"authorization": "Bearer sk-engine"}
    assert "sk-engine" not in repr(cfg), "the key must not appear in logs of the config"
    monkeypatch.setenv("ENGINE_KEY", "from-env")
    cfg = parse_config(with_change("engines.0.api_key_env", "ENGINE_KEY"))
    assert cfg.engines[0].api_key == "from-env"
    assert parse_config(GOOD).engines[0].auth_headers() == {}


@pytest.mark.parametrize("key, value, message", [
    ("api_key", "", "engines[0].api_key: expected a non-empty string"),
    ("api_key", 12, "engines[0].api_key: expected a non-empty string"),
    ("api_key", " k", "engines[0].api_key: expected a non-empty string"),
    ("api_key_env", "TOKENPACE_TEST_UNSET_VAR", "engines[0].api_key_env: the environment variable "
     "TOKENPACE_TEST_UNSET_VAR is not set"),
    ("api_key_env", "", "engines[0].api_key_env: expected the name"),
])
def test_bad_engine_keys_are_named(key: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(with_change(f"engines.0.{key}", value))
    assert message in str(err.value)


def test_engine_key_inline_and_from_env_together_is_refused() -> None:
    config = with_change("engines.0.api_key", "k")
    config["engines"][0]["api_key_env"] = "X"
    with pytest.raises(ConfigError, match="engines\\[0\\]: give api_key or api_key_env, not both"):
        parse_config(config)


def test_a_reload_keeps_generated_engine_keys_and_refuses_a_changed_one() -> None:
    from tokenpace.gateway.config import keep_engine_keys

    running = parse_config(with_change("engines.0.api_key", "generated"))
    reloaded = keep_engine_keys(parse_config(GOOD), running)
    assert reloaded.engines == running.engines
    assert reloaded.engines[0].api_key == "generated"
    with pytest.raises(ConfigError, match="engines\\[0\\].api_key: changing"):
        keep_engine_keys(parse_config(with_change("engines.0.api_key", "other")), running)


# -- prefix-cache salt -------------------------------------------------------------------


def test_each_tenant_gets_its_own_stable_cache_salt_unless_it_shares() -> None:
    cfg = parse_config(GOOD)
    a, b = (t.cache_salt for t in cfg.tenants)
    assert a and b and a != b
    assert len(a) <= 128 and not set(a) & set("@/\\\0"), "vLLM's limits on cache_salt"
    assert parse_config(copy.deepcopy(GOOD)).tenants[0].cache_salt == a, "same on every replica"
    rekeyed = parse_config(with_change("tenants.0.api_keys", ["sk-other"]))
    assert rekeyed.tenants[0].cache_salt != a, "derived from the tenant's own keys"
    assert parse_config(with_change("tenants.0.share_prefix_cache", True)).tenants[0].cache_salt is None
    with pytest.raises(ConfigError, match="tenants\\[0\\].share_prefix_cache: expected true or false"):
        parse_config(with_change("tenants.0.share_prefix_cache", "yes"))


def test_engine_body_sets_the_salt_and_mixes_in_a_clients_own() -> None:
    import json

    from tokenpace.gateway.engines import EngineInstructions, engine_body
    from tokenpace.gateway.wire import parse_request

    def sent(body: dict, salt: str | None) -> dict:
        req = parse_request("completion", {"model": "m", "prompt": "p", **body})
        return json.loads(engine_body(req, EngineInstructions(user="u", rate=None, priority=0, max_tokens=1,
                                      cache_salt=salt)))

    assert sent({}, "s1")["cache_salt"] == "s1"
    assert sent({"cache_salt": "s1"}, "s2")["cache_salt"] not in ("s1", "s2")
    assert sent({"cache_salt": "mine"}, "s1")["cache_salt"] != sent({"cache_salt": "mine"}, "s2")["cache_salt"]
    assert sent({}, None).get("cache_salt") is None
    assert sent({"cache_salt": "mine"}, None)["cache_salt"] == "mine"


# -- models --------------------------------------------------------------------------------


def test_models_aliases_costs_and_allow_lists() -> None:
    config = copy.deepcopy(GOOD)
    config["engines"] = [{"url": "http://127.0.0.1:8001", "models": ["llama-70b"]},
                         {"url": "http://127.0.0.1:8002", "models": ["coder"]}]
    config["models"] = [{"name": "llama-70b", "aliases": ["gpt-4o"],
                         "cost": {"prompt": 2, "completion": 6}}]
    config["tenants"][0]["models"] = ["gpt-4o"]
    parsed = parse_config(config)
    assert parsed.served_name("gpt-4o") == "llama-70b" and parsed.served_name("coder") == "coder"
    assert parsed.cost_of("llama-70b").of(10, 10) == 80
    assert parsed.cost_of("coder") == parsed.cost  # the top-level coefficients
    # cached_prompt absent: cached prompt tokens cost what the model's prompt tokens cost.
    assert parsed.cost_of("llama-70b").cached_prompt == 2
    assert parsed.cost_of("llama-70b").of(10, 10, cached_tokens=10) == 80
    assert parsed.tenants[0].may_use("llama-70b") and not parsed.tenants[0].may_use("coder")
    assert parsed.tenants[1].models is None and parsed.tenants[1].may_use("coder")
    assert parsed.routing == "pool" and parsed.pool_affinity == 2
    assert parsed.conversation_affinity == 8
    # With every engine's models listed, a tenant's model no engine serves is a typo.
    config["tenants"][0]["models"] = ["lama-70b"]
    with pytest.raises(ConfigError, match=r"tenants\[0\].models: no engine serves 'lama-70b'"):
        parse_config(config)
    # An alias may not shadow a name an engine serves.
    config["tenants"][0]["models"] = ["coder"]
    config["models"][0]["aliases"] = ["coder"]
    with pytest.raises(ConfigError, match="alias 'coder'"):
        parse_config(config)


def test_cached_prompt_coefficient_top_level_and_per_model() -> None:
    config = copy.deepcopy(GOOD)
    config["cost"] = {"prompt": 1.0, "cached_prompt": 0.25, "completion": 2.0}
    config["engines"] = [{"url": "http://127.0.0.1:8001", "models": ["big", "small"]}]
    config["models"] = [{"name": "big", "cost": {"prompt": 2, "cached_prompt": 0,
                                                  "completion": 6}}]
    parsed = parse_config(config)
    assert parsed.cost.cached_prompt == 0.25
    # 100 prompt tokens, 60 of them cached, 10 generated: 40 x 1 + 60 x 0.25 + 10 x 2.
    assert parsed.cost_of("small").of(100, 10, cached_tokens=60) == 75.0
    assert parsed.cost_of("big").of(100, 10, cached_tokens=60) == 40 * 2 + 10 * 6
    # A model's own cost section does not inherit the top level's cached_prompt: absent
    # there, it is that model's prompt coefficient.
    config["models"] = [{"name": "big", "cost": {"prompt": 2, "completion": 6}}]
    assert parse_config(config).cost_of("big").cached_prompt == 2


# -- the ledger checked against the engines ----------------------------------------------


def test_reconcile_interval_and_grace_default_and_may_be_zero() -> None:
    config = parse_config(GOOD)
    assert (config.reconcile_interval_s, config.reconcile_grace_s) == (60.0, 30.0)
    off = parse_config({**GOOD, "reconcile_interval": 0, "reconcile_grace": "0"})
    assert (off.reconcile_interval_s, off.reconcile_grace_s) == (0.0, 0.0)
    assert parse_config({**GOOD, "reconcile_interval": "5m"}).reconcile_interval_s == 300.0
    for value in (-1, False, "soon"):
        with pytest.raises(ConfigError, match="reconcile_interval"):
            parse_config({**GOOD, "reconcile_interval": value})


@pytest.mark.parametrize("path,value,message", [
    ("max_tokenize_bytes", 100, "max_tokenize_bytes: expected an integer >= 1024"),
    ("max_tokenize_bytes", "1MB", "max_tokenize_bytes: expected an integer"),
    ("metrics_api_keys", "sk-m", "metrics_api_keys: expected a list of keys"),
    ("metrics_api_keys", [""], "metrics_api_keys[0]: expected a non-empty string"),
    ("metrics_cache", "soon", "metrics_cache"),
    ("max_conversation_homes", 0, "max_conversation_homes: expected an integer >= 1"),
    ("max_conversation_homes_per_tenant", -1, "max_conversation_homes_per_tenant: expected"),
])
def test_side_route_metrics_and_homes_keys_name_themselves(path: str, value: Any,
                                                           message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_change(path, value))
    assert message in str(info.value)


def test_side_route_metrics_and_homes_defaults_and_keys() -> None:
    config = parse_config(GOOD)
    assert (config.max_tokenize_bytes, config.metrics_cache_s, config.metrics_key_hashes) == (
        1024 * 1024, 2.0, ())
    assert (config.max_conversation_homes, config.max_conversation_homes_per_tenant) == (
        100_000, 10_000)
    config = parse_config({**GOOD, "metrics_api_keys": ["sk-m"], "metrics_cache": 0,
                           "max_tokenize_bytes": 4096})
    assert config.is_metrics_key("sk-m") and config.is_metrics_key("admin")
    assert not config.is_metrics_key("sk-a") and config.is_admin_key("admin")
    assert not config.is_admin_key("sk-m")  # a metrics key is no admin key
    assert (config.metrics_cache_s, config.max_tokenize_bytes) == (0.0, 4096)
