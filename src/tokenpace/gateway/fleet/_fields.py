"""The request fields each engine reads, from its OpenAPI document.

vLLM ignores a request's top-level fields that its request models do not declare, after
its API server has parsed them: a client can make every engine behind the gateway parse
megabytes it then drops. vLLM's API server (FastAPI) publishes those models at
``/openapi.json``; the fields each ``POST`` route's request model declares are read from
there once per engine, at its first good health check after a large body was sent to it
(building the document costs vLLM's API server a moment, so an engine that never gets
one is never asked) and again when it comes back; a large body's fields outside them are
not forwarded (``server``'s proxy). Until they are known, for an engine that publishes no
document (``--disable-fastapi-docs``), and for a route whose model cannot be read from it,
every field is forwarded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from ..engines import Upstream, UpstreamError

logger = logging.getLogger("tokenpace.gateway")

OPENAPI_PATH = "/openapi.json"
OPENAPI_TIMEOUT_S = 10.0
_MAX_DEPTH = 8  # $ref and anyOf/oneOf/allOf levels followed to reach a model's properties


def request_fields(document: Mapping[str, Any]) -> dict[str, frozenset[str]]:
    """Path -> the top-level fields of its ``POST`` request body, for each route of an
    OpenAPI document whose JSON body schema resolves to named properties (a union: the
    fields of all its members). Routes it cannot resolve are left out."""
    out: dict[str, frozenset[str]] = {}
    components = document.get("components")
    schemas = components.get("schemas") if isinstance(components, dict) else None
    paths = document.get("paths")
    if not isinstance(paths, dict) or not isinstance(schemas, dict):
        return out
    for path, item in paths.items():
        post = item.get("post") if isinstance(item, dict) else None
        body = post.get("requestBody") if isinstance(post, dict) else None
        content = body.get("content") if isinstance(body, dict) else None
        media = content.get("application/json") if isinstance(content, dict) else None
        schema = media.get("schema") if isinstance(media, dict) else None
        fields = _properties(schema, schemas, 0)
        if fields:
            out[str(path)] = fields
    return out


def _properties(schema: Any, schemas: Mapping[str, Any], depth: int) -> frozenset[str] | None:
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return _properties(schemas.get(ref.rsplit("/", 1)[-1]), schemas, depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        members = schema.get(key)
        if isinstance(members, list):
            found: set[str] = set()
            for member in members:
                fields = _properties(member, schemas, depth + 1)
                if fields is None:
                    return None  # a member we cannot read: every field may be its
                found |= fields
            return frozenset(found) or None
    props = schema.get("properties")
    return frozenset(props) if isinstance(props, dict) and props else None


async def learn_request_fields(url: str, upstream: Upstream) -> dict[str, frozenset[str]]:
    """The engine's routes' request fields (empty when it publishes no usable document).
    Cost: one fetch and parse of the document (hundreds of kB for vLLM), per engine start."""
    try:
        status, _, content = await upstream.fetch("GET", OPENAPI_PATH, OPENAPI_TIMEOUT_S)
    except (UpstreamError, TimeoutError):
        return {}
    if status != 200:
        return {}
    try:
        document = json.loads(content)
    except ValueError:
        return {}
    fields = request_fields(document) if isinstance(document, dict) else {}
    if fields:
        logger.info("engine %s: request fields read from %s for %d routes", url,
                    OPENAPI_PATH, len(fields))
    return fields
