"""Names of the pacing fields in a request's ``vllm_xargs`` (``sampling_params.extra_args``).

Kept apart from the scheduler so that the HTTP guard, ``tokenpace serve`` and a gateway can
use them without importing vLLM.
"""

from __future__ import annotations

USER_EXTRA_ARG = "output_rate_user"
"""The request's pacing identity."""

RATE_EXTRA_ARG = "output_rate_tokens_per_second"
"""The rate of the request's user, in output tokens per second; honoured only with
``trusted_gateway``, where a gateway that holds the tenants' rates sends it."""
