"""Admission: who is asking, for what, and whether the request may wait for an engine slot.

``identify`` (API key -> tenant and application) and ``route`` (model -> pool) decide from
memory; ``admit`` checks the per-request caps, counts or bounds the prompt, takes the
request limits and reserves the budgets (enforced, then observed). Each refusal is a
``GatewayError`` made in ``_refusals``, with OpenAI's headers.
"""

from ._admit import (
    MAX_BYTES_PER_TOKEN,
    Admission,
    admit,
    count_request,
    prompt_bytes,
    read_body,
    read_paced_body,
)
from ._identity import (
    adapter_of,
    authenticate,
    authorization_of,
    bearer_key,
    identify,
    route,
    tenant_models,
)
from ._parse import LARGE_BODY_BYTES, parse_body
from ._refusals import (
    body_rate_limited,
    budget_error,
    queue_full,
    request_limit_error,
    retry_headers,
    state_unavailable,
)

__all__ = [
    "adapter_of",
    "MAX_BYTES_PER_TOKEN",
    "Admission",
    "admit",
    "authenticate",
    "authorization_of",
    "bearer_key",
    "body_rate_limited",
    "budget_error",
    "count_request",
    "identify",
    "LARGE_BODY_BYTES",
    "parse_body",
    "prompt_bytes",
    "queue_full",
    "read_body",
    "read_paced_body",
    "request_limit_error",
    "retry_headers",
    "route",
    "state_unavailable",
    "tenant_models",
]
