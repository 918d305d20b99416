"""Errors in OpenAI's wire format, so that SDKs raise their own exception classes.

The official ``openai`` client maps the status (401 -> ``AuthenticationError``, 400 ->
``BadRequestError``, 429 -> ``RateLimitError``) and reads ``error.message``; ``code`` and
``param`` let a program tell a budget refusal from a full queue without parsing text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class GatewayError(Exception):
    """A refusal with its HTTP status; ``reason`` is the short name used in the ledger
    (``rejected:<reason>``) and in the rejection metric."""

    def __init__(self, status: int, message: str, *, reason: str, code: str | None = None,
                 param: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.code = code or reason
        self.param = param
        self.headers = dict(headers or {})

    def response(self, request_id: str | None = None) -> Response:
        headers = dict(self.headers)
        if request_id:
            headers["x-request-id"] = request_id
        return error_response(self.status, self.message, code=self.code, param=self.param,
                              headers=headers)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    kind = _TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, *, code: str | None = None,
                   param: str | None = None, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        json.dumps(error_body(status, message, code, param)),
        status_code=status,
        media_type="application/json",
        headers=dict(headers or {}),
    )
