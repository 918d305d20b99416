"""Errors in the client's wire format, so that SDKs raise their own exception classes.

The official ``openai`` client maps the status (401 -> ``AuthenticationError``, 400 ->
``BadRequestError``, 429 -> ``RateLimitError``) and reads ``error.message``; ``code`` and
``param`` let a program tell a budget refusal from a full queue without parsing text.
Requests to Anthropic's Messages API (``/v1/messages``) get Anthropic's error body
(``{"type": "error", "error": {"type": "rate_limit_error", "message": ...}}``), which the
``anthropic`` SDK reads; the gateway's ``code`` is kept beside the type there.
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

    def response(self, request_id: str | None = None, kind: str | None = None) -> Response:
        """The error as an HTTP response; ``kind`` ``"messages"``: in Anthropic's format."""
        headers = dict(self.headers)
        if request_id:
            headers["x-request-id"] = request_id
        if kind == "messages":
            return Response(json.dumps(anthropic_error_body(self.status, self.message, self.code)),
                            status_code=self.status, media_type="application/json",
                            headers=headers)
        return error_response(self.status, self.message, code=self.code, param=self.param,
                              headers=headers)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    kind = _TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str, code: str | None = None) -> dict:
    kind = _ANTHROPIC_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500
                                            else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message, "code": code}}


def stream_error_event(kind: str, status: int, message: str, code: str) -> bytes:
    """An error as the last event of a stream, in the route's own event format."""
    if kind == "messages":
        return (b"event: error\ndata: "
                + json.dumps(anthropic_error_body(status, message, code)).encode() + b"\n\n")
    if kind == "responses":
        return (b"event: error\ndata: " + json.dumps(
            {"type": "error", "code": code, "message": message, "param": None}).encode()
            + b"\n\n")
    return b"data: " + json.dumps(error_body(status, message, code)).encode() + b"\n\n"


def error_response(status: int, message: str, *, code: str | None = None,
                   param: str | None = None, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        json.dumps(error_body(status, message, code, param)),
        status_code=status,
        media_type="application/json",
        headers=dict(headers or {}),
    )
