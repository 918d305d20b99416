"""The ``models`` section (names, aliases, per-model cost) and the ``cost`` mappings it
and the top level share."""

from __future__ import annotations

from typing import Any

from ...fairness import CostModel
from ._fields import ConfigError, _batch_cost, _known, _mapping, _name_list
from ._values import EngineConfig, ModelConfig


def _models(items: list[Any], engines: tuple[EngineConfig, ...]) -> tuple[ModelConfig, ...]:
    """The ``models`` section: per-model aliases and costs, names and aliases unique."""
    out: list[ModelConfig] = []
    taken: dict[str, str] = {}  # every name and alias -> where it was given
    for i, item in enumerate(items):
        where = f"models[{i}]"
        m = _mapping(item, where)
        _known(m, where, ("name", "aliases", "cost", "batch_cost"))
        name = m.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: required, the name the engines serve "
                              "(their --served-model-name)")
        aliases = _name_list(m.get("aliases", []), f"{where}.aliases")
        for label, value in ((f"{where}.name", name),
                             *((f"{where}.aliases", a) for a in aliases)):
            if value in taken:
                raise ConfigError(f"{label}: {value!r} is already given at {taken[value]}")
            taken[value] = label
        cost = _cost(m["cost"], f"{where}.cost") if m.get("cost") is not None else None
        out.append(ModelConfig(name, aliases, cost, _batch_cost(m, where)))
    served = {name for e in engines for name in e.models or ()}
    for model in out:
        for alias in model.aliases:
            if alias in served:
                raise ConfigError(f"models: alias {alias!r} of {model.name!r} is also a name an "
                                  "engine serves")
    return tuple(out)


def _known_models(models: tuple[ModelConfig, ...],
                  engines: tuple[EngineConfig, ...]) -> frozenset[str] | None:
    """Every served name, when all engines list theirs (None: some are learned at run time)."""
    if any(e.models is None for e in engines):
        return None
    return frozenset(name for e in engines for name in e.models or ())


def _cost(value: Any, where: str = "cost") -> CostModel:
    if value is None:
        return CostModel()
    m = _mapping(value, where)
    _known(m, where, ("prompt", "cached_prompt", "completion"))
    try:
        # cached_prompt absent: the prompt coefficient (CostModel's default).
        return CostModel(m.get("prompt", 1.0), m.get("completion", 1.0), m.get("cached_prompt"))
    except ValueError as exc:
        raise ConfigError(str(exc).replace("cost.", f"{where}.", 1)) from None
