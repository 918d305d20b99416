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

RATE_VERSION_EXTRA_ARG = "output_rate_version"
"""With a rate: its version, an integer that the gateway raises with every change of the
user's rate. The engine adopts a rate only when its version is at least the last one it
adopted for that user, so a request that carried an older rate and reached the engine
late cannot undo a newer, lower one sent since (the gateway lowers one engine's share of
a tenant's rate before it raises another's; see ``tokenpace.engine`` rate control)."""

END_USER_EXTRA_ARG = "output_rate_end_user"
"""The end user a request is for, inside its user (a gateway's tenant): paced at the
end-user rate inside the user's rate when one is set (``end_user_output_tokens_per_second``
in the engine's configuration, or sent by a trusted gateway)."""

END_USER_RATE_EXTRA_ARG = "output_rate_end_user_tokens_per_second"
"""The end-user rate of the request's user; honoured only with ``trusted_gateway``."""

APPLICATION_EXTRA_ARG = "output_rate_application"
"""The application a request comes from, inside its user (a gateway's tenant): paced at
the application's rate inside the user's when a trusted gateway sent one."""

APPLICATION_RATE_EXTRA_ARG = "output_rate_application_tokens_per_second"
"""The rate of the request's application (every request of that application of that
user, from now on); honoured only with ``trusted_gateway``."""

APPLICATION_END_USER_RATE_EXTRA_ARG = "output_rate_application_end_user_tokens_per_second"
"""The rate of the end users of the request's application, when it has one of its own: its
end users are then its own (not shared with the user's other applications) and paced at
this rate; honoured only with ``trusted_gateway``."""
