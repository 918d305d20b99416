"""An engine's ``headers``: the header names and templates a router in front of engines
reads, checked completely here so that rendering a request's values cannot fail."""

from __future__ import annotations

import string
from typing import Any

from ._fields import ConfigError, _mapping


ROUTER_HEADER_PLACEHOLDERS = ("tenant", "application", "lane", "model", "end_user")
"""What an ``engines[].headers`` template may name, in braces (``{{``/``}}``: a brace)."""
MAX_ROUTER_HEADERS = 32
_TCHAR = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
                   "ABCDEFGHIJKLMNOPQRSTUVWXYZ")  # RFC 9110's token characters
_OWN_HEADERS = {
    "host": "the gateway sets it from the engine's url",
    "content-length": "the gateway sets it from the body it sends",
    "content-type": "the gateway sends JSON",
    "transfer-encoding": "the gateway sends a content-length",
    "connection": "it is hop-by-hop; the gateway keeps its connections alive",
    "keep-alive": "it is hop-by-hop",
    "te": "it is hop-by-hop",
    "trailer": "it is hop-by-hop",
    "upgrade": "it is hop-by-hop",
    "expect": "the gateway sends the body at once and would wait for an interim answer",
    "authorization": "give the engine's key as api_key (or api_key_env)",
    "x-request-id": "the gateway sends its request id there",
}


def _router_headers(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    """``engines[].headers``: header name -> template, checked completely here so that
    rendering a request's values cannot fail (``engines.RouterHeaders`` compiles them)."""
    if value is None:
        return ()
    m = _mapping(value, where)
    if len(m) > MAX_ROUTER_HEADERS:
        raise ConfigError(f"{where}: at most {MAX_ROUTER_HEADERS} headers, got {len(m)}")
    out: dict[str, str] = {}
    for raw, template in m.items():
        if not isinstance(raw, str) or not raw or not set(raw) <= _TCHAR:
            raise ConfigError(f"{where}: {raw!r} is not a header name (letters, digits and "
                              "!#$%&'*+-.^_`|~ only)")
        name = raw.lower()
        key = f"{where}.{name}"
        why = _OWN_HEADERS.get(name) or ("it is hop-by-hop (proxy-*)"
                                        if name.startswith("proxy-") else None)
        if why is not None:
            raise ConfigError(f"{key}: not allowed ({why})")
        if name in out:
            raise ConfigError(f"{key}: given twice (header names are case-insensitive)")
        out[name] = _router_template(template, key)
    return tuple(out.items())


def _router_template(template: Any, where: str) -> str:
    if not isinstance(template, str):
        raise ConfigError(f"{where}: expected a string template such as \"{{tenant}}\", got "
                          f"{template!r} (quote it in YAML)")
    if not template:
        raise ConfigError(f"{where}: empty (a header without a value is never sent)")
    if not all(" " <= c <= "~" for c in template):
        raise ConfigError(f"{where}: printable ASCII only (no control characters, no "
                          f"non-ASCII), got {template!r}")
    if template != template.strip(" "):
        raise ConfigError(f"{where}: leading or trailing spaces are dropped by HTTP; got "
                          f"{template!r}")
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc} in {template!r} (write {{{{ or }}}} for a brace)") \
            from None
    for _, field_name, spec, conversion in parts:
        if field_name is None:
            continue
        if field_name not in ROUTER_HEADER_PLACEHOLDERS or spec or conversion:
            shown = "{" + field_name + (f"!{conversion}" if conversion else "") \
                + (f":{spec}" if spec else "") + "}"
            raise ConfigError(f"{where}: unknown placeholder {shown} in {template!r}; known: "
                              f"{', '.join('{' + p + '}' for p in ROUTER_HEADER_PLACEHOLDERS)}")
    return template
