"""The ``adapters`` section: LoRA adapters, each over a base model the engines serve."""

from __future__ import annotations

from typing import Any

from ._fields import ConfigError, _known, _mapping
from ._models import _cost
from ._values import AdapterConfig, ModelConfig


def _adapters(items: list[Any], models: tuple[ModelConfig, ...]) -> tuple[AdapterConfig, ...]:
    """Names unique and apart from the models' names and aliases; a base is a served name
    (an alias is resolved), never another adapter."""
    aliases = {alias: m.name for m in models for alias in m.aliases}
    taken = {m.name for m in models} | set(aliases)
    out: list[AdapterConfig] = []
    for i, item in enumerate(items):
        where = f"adapters[{i}]"
        m = _mapping(item, where)
        _known(m, where, ("name", "base", "path", "tenants", "cost"))
        name, base, path = m.get("name"), m.get("base"), m.get("path")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: required, the model name clients send for it")
        if not isinstance(base, str) or not base:
            raise ConfigError(f"{where}.base: required, the served name of the model it "
                              "adapts (an engine's --served-model-name)")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}.path: required, the adapter's folder as the engines "
                              "see it (what vLLM's /v1/load_lora_adapter loads); an adapter "
                              "an engine lists already needs no entry")
        if name in taken:
            raise ConfigError(f"{where}.name: {name!r} is already a model, an alias or an "
                              "adapter")
        taken.add(name)
        tenants = m.get("tenants")
        if tenants is not None and (not isinstance(tenants, list)
                                    or not all(isinstance(t, str) and t for t in tenants)):
            raise ConfigError(f"{where}.tenants: expected a list of tenant ids (the only "
                              "tenants that may use it), or null for any")
        cost = _cost(m["cost"], f"{where}.cost") if m.get("cost") is not None else None
        out.append(AdapterConfig(name, aliases.get(base, base), path,
                                 None if tenants is None else tuple(tenants), cost))
    names = {a.name for a in out}
    for i, adapter in enumerate(out):
        if adapter.base in names:
            raise ConfigError(f"adapters[{i}].base: {adapter.base!r} is an adapter; an "
                              "adapter adapts a model the engines serve")
    return tuple(out)
