"""The vLLM adapter: paced scheduler subclasses and their configuration.

Importing this package imports vLLM; the pure policy lives in ``tokenpace.pacing``.
"""

from ._config import PacingConfig, PacingConfigError
from ._scheduler import ANONYMOUS_USER, PacedAsyncScheduler, PacedScheduler, request_user

__all__ = [
    "ANONYMOUS_USER",
    "PacedAsyncScheduler",
    "PacedScheduler",
    "PacingConfig",
    "PacingConfigError",
    "request_user",
]
