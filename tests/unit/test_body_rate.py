"""``tenants.BodyRate`` on a fake clock, and the ``max_body_bytes_per_second`` key."""

from __future__ import annotations

import pytest

from tokenpace.gateway.config import ConfigError, parse_config
from tokenpace.gateway.tenants._body_rate import TOLERANCE_S, BodyRate


def test_a_body_starts_while_the_debt_is_within_the_tolerance() -> None:
    pace = BodyRate(100.0)  # bytes a second
    assert pace.wait_s(0.0) == 0.0
    pace.charge(300, 0.0)  # any size starts when nothing is owed: 3 s of debt
    assert pace.wait_s(0.0) == pytest.approx(3.0 - TOLERANCE_S)
    assert pace.wait_s(1.0) == 0.0  # owes 2 s: within the tolerance
    pace.charge(50, 1.0)
    assert pace.wait_s(1.0) == pytest.approx(0.5)
    assert pace.wait_s(10.0) == 0.0
    pace.charge(100, 10.0)  # paid up long ago: the debt starts from now, nothing banked
    assert pace.wait_s(10.0) == 0.0 and pace.wait_s(9.0) == 0.0


def _tenant(**extra: object) -> dict[str, object]:
    return {"engines": ["http://127.0.0.1:1"], "ledger": "sqlite:///unused.db",
            "tenants": [{"id": "t", "api_keys": ["sk-t"], **extra}]}


def test_a_file_tenant_gets_the_default_rate_and_may_name_its_own() -> None:
    assert parse_config(_tenant()).tenant("t").max_body_bytes_per_second == 1024 * 1024
    assert parse_config(_tenant(max_body_bytes_per_second=65536)
                        ).tenant("t").max_body_bytes_per_second == 65536
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.max_body_bytes_per_second"):
        parse_config(_tenant(max_body_bytes_per_second=10))
