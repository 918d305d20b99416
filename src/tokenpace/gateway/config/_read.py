"""Reading ``gateway.yaml`` (or the same document as JSON) from a file into the plain
lists and mappings ``parse_config`` checks, with the collector paused and the YAML node tree
freed piecewise so that a reload in a worker thread does not hold the GIL for long.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ._fields import ConfigError
from ._gateway import GatewayConfig
from ._gc import paused_gc
from ._parse import parse_config


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a YAML file; relative ledger paths are relative to the file."""
    with paused_gc():
        return _load_config(Path(path))


def _load_config(p: Path) -> GatewayConfig:
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {str(p)!r}: {exc.strerror}") from None
    try:
        data = _parse_text(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    return parse_config(data, base_dir=p.resolve().parent, source=p)


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser where PyYAML has it (the pure-Python one otherwise: same documents,
slower)."""


def _parse_text(text: str) -> Any:
    """The document in ``text``: JSON when it is a JSON object, otherwise YAML.

    JSON is YAML too, and the same document; but Python's JSON parser reads it many times
    faster than PyYAML, even with libyaml, which builds a node per scalar in Python.
    Generated tenant lists should be written as JSON.
    """
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except ValueError:
            pass  # not JSON after all (YAML's flow style): YAML says what is wrong
    loader = _YAML_LOADER(text)
    try:
        node = loader.get_single_node()
        data = None if node is None else _construct(loader, node)
    finally:
        loader.dispose()
    _drop_gradually(node)
    return data


_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct(loader: Any, node: Any) -> Any:
    """``loader.construct_document(node)``'s value, built faster: plain strings, lists and
    mappings here (PyYAML's constructor makes a generator per collection), every other
    scalar (numbers, booleans, null, dates) and any mapping with a merge key (``<<``) by
    PyYAML's own safe constructor. O(nodes), recursion as deep as the document."""
    if isinstance(node, yaml.ScalarNode):
        return node.value if node.tag == _STR_TAG else loader.construct_object(node, deep=True)
    if isinstance(node, yaml.SequenceNode) and node.tag == "tag:yaml.org,2002:seq":
        return [_construct(loader, item) for item in node.value]
    if isinstance(node, yaml.MappingNode) and node.tag == "tag:yaml.org,2002:map" and not any(
            key.tag == _MERGE_TAG for key, _ in node.value):
        out = {}
        for key_node, value_node in node.value:
            key = _construct(loader, key_node)
            try:
                out[key] = _construct(loader, value_node)
            except TypeError:  # an unhashable key: PyYAML's own message
                return loader.construct_object(node, deep=True)
        return out
    return loader.construct_object(node, deep=True)


def _drop_gradually(node: Any) -> None:
    """Free a YAML node tree one node at a time.

    Dropped at once, the tree (O(scalars in the file) nodes with their marks) is freed in
    one chain of deallocations that holds the GIL throughout: a reload reads the file in a
    worker thread, and the event loop would wait that out. Taken apart here, the
    interpreter can hand the GIL over between nodes.
    """
    stack = [node] if node is not None else []
    while stack:
        current = stack.pop()
        value = current.value
        if isinstance(value, list):
            current.value = None
            for item in value:
                if isinstance(item, tuple):
                    stack.extend(item)
                else:
                    stack.append(item)
