"""The ``batch`` section and the batch cost coefficients: defaults that work with nothing
configured, and each refusal naming its key."""

from __future__ import annotations

from typing import Any

import pytest

from tokenpace.gateway import ConfigError, parse_config

LANES = [{"name": "interactive", "priority": 0}, {"name": "bulk", "priority": 5},
         {"name": "night", "priority": 9}]


def config(**extra: Any) -> Any:
    data: dict[str, Any] = {"engines": ["http://127.0.0.1:9"], "lanes": LANES,
                            "tenants": [{"id": "a", "api_keys": ["k-a"]},
                                        {"id": "b", "api_keys": ["k-b"], "batch_cost": 0.25}]}
    for key, value in extra.items():
        data[key] = value
    return parse_config(data)


def test_defaults_need_no_configuration() -> None:
    c = config()
    assert c.batch_lane == "night"  # the lowest lane: the highest priority value
    assert (c.batch.max_lines, c.batch.max_batches, c.batch.headroom) == (50_000, 10, 1)
    assert c.batch.expire_after_s == 24 * 3600 and c.batch.store is None
    assert c.batch_cost_of("m", c.tenants[0]) == c.cost_of("m")  # no discount by default
    assert (c.batch.max_output_bytes, c.batch.shutdown_wait_s) == (256 << 20, 10.0)
    raised = config(batch={"max_output_bytes": 1 << 30, "shutdown_wait": "1m"}).batch
    assert (raised.max_output_bytes, raised.shutdown_wait_s) == (1 << 30, 60.0)


def test_costs_the_tenant_before_the_model_before_the_section() -> None:
    c = config(batch={"cost": 0.5, "lane": "bulk"},
               cost={"prompt": 2.0, "completion": 4.0},
               models=[{"name": "m", "batch_cost": 0.1, "cost": {"prompt": 1.0,
                                                                  "completion": 1.0}}])
    assert c.batch_lane == "bulk"
    a, b = c.tenants
    assert c.batch_cost_of("other", a).prompt == pytest.approx(1.0)  # 2.0 x 0.5
    assert c.batch_cost_of("other", a).completion == pytest.approx(2.0)
    assert c.batch_cost_of("m", a).completion == pytest.approx(0.1)
    assert c.batch_cost_of("m", b).completion == pytest.approx(0.25)
    assert c.batch_cost_of("other", b).cached_prompt == pytest.approx(0.5)


@pytest.mark.parametrize(("batch", "message"), [
    ({"lane": "nope"}, "batch.lane: unknown lane 'nope'"),
    ({"cost": -1}, "batch.cost"),
    ({"cost": True}, "batch.cost"),
    ({"headroom": -1}, "batch.headroom"),
    ({"max_lines": 0}, "batch.max_lines"),
    ({"expire_after": "soon"}, "batch.expire_after"),
    ({"store": "mysql://x"}, "batch.store"),
    ({"max_output_bytes": 100}, "batch.max_output_bytes"),
    ({"shutdown_wait": "0s"}, "batch.shutdown_wait"),
    ({"shutdown_wait": "later"}, "batch.shutdown_wait"),
    ({"surprise": 1}, "batch.surprise: unknown key"),
])
def test_bad_values_are_refused_by_name(batch: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config(batch=batch)
    assert message in str(info.value)


def test_a_relative_store_is_resolved_beside_the_configuration(tmp_path: Any) -> None:
    c = parse_config({"engines": ["http://127.0.0.1:9"],
                      "tenants": [{"id": "a", "api_keys": ["k"]}],
                      "batch": {"store": "sqlite:///batches.db"}}, base_dir=tmp_path)
    assert c.batch.store == f"sqlite:///{tmp_path / 'batches.db'}"
