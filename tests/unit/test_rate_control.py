"""The rate-control route's body and its engine-side call, in process (no vLLM)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tokenpace.engine._control import ControlRefused, parse_rates, tokenpace_set_rates


@pytest.mark.parametrize("body, param", [
    ([], "rates"),
    ({"rates": {}}, "rates"),
    ({"rates": {"a": 5}}, "rates.a"),
    ({"rates": {"a": {"rate": -1}}}, "rates.a"),
    ({"rates": {"a": {"rate": True}}}, "rates.a"),
    ({"rates": {"a": {"rate": 5, "version": -1}}}, "rates.a"),
    ({"rates": {"a": {"rate": 5, "version": "7"}}}, "rates.a"),
    ({"rates": {"": {"rate": 5}}}, "rates."),
])
def test_bad_bodies_name_the_field(body: Any, param: str) -> None:
    with pytest.raises(ControlRefused) as info:
        parse_rates(body)
    assert info.value.status == 400 and info.value.param == param


def test_a_good_body_and_what_the_engine_answers() -> None:
    assert parse_rates({"rates": {"a": {"rate": 5}, "b": {"rate": 2.5, "version": 9}}}) == {
        "a": (5.0, None), "b": (2.5, 9)}
    seen: list[Any] = []

    def set_user_rates(rates: Any) -> Any:
        seen.append(rates)
        return {u: (r, v) for u, (r, v) in rates.items()}

    core = SimpleNamespace(scheduler=SimpleNamespace(set_user_rates=set_user_rates))
    assert tokenpace_set_rates(core, {"a": {"rate": 5, "version": 3}}) == {
        "rates": {"a": {"rate": 5.0, "version": 3}}}
    # The engine checks again: a caller of the utility that skipped the route gets an error.
    assert tokenpace_set_rates(core, {"a": {"rate": 0}})["status"] == 400
    assert seen == [{"a": (5.0, 3)}]
    unpaced = SimpleNamespace(scheduler=SimpleNamespace())
    assert tokenpace_set_rates(unpaced, {"a": {"rate": 5}})["status"] == 403
