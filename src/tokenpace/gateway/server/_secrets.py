"""The secrets a gateway configuration holds, registered so no log line shows them.

The engines' API keys and the passwords of the ledger's, the batch store's and the state
store's URLs (``tokenpace._redact``): registered at start-up and with every reload, so
that a message or a library's exception that prints one shows ``***`` instead. Tenants'
and admins' keys are kept as digests only and never logged; a ``Bearer`` token anywhere
in a line is masked by the pattern.
"""

from __future__ import annotations

from ..._redact import add_secrets, url_password
from ..config import GatewayConfig


def register_secrets(config: GatewayConfig) -> None:
    """Register ``config``'s secrets with the process's log redaction. O(engines)."""
    add_secrets([*(e.api_key for e in config.engines),
                 *(url_password(u) for u in (config.ledger, config.batch.store,
                                             config.state.url))])
