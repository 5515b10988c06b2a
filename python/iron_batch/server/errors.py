"""The one error type of the HTTP layer, and the one body every error is sent with.

Every endpoint answers a failure with the same JSON (OpenAI's shape, so the official client
raises its typed exceptions)::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

``type`` follows from the status unless given: 401 ``authentication_error``, 404
``not_found_error``, 5xx ``server_error``, any other 4xx ``invalid_request_error``.
"""

from __future__ import annotations

import json
from typing import Any

#: Seconds a client is told to wait (Retry-After) when the server cannot take work now.
RETRY_AFTER_S = 1

_TYPE_BY_STATUS = {401: "authentication_error", 404: "not_found_error"}


def _default_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return _TYPE_BY_STATUS.get(status, "invalid_request_error")


class ApiError(Exception):
    """An HTTP error response: status, the error body's fields and extra headers."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type or _default_type(status)
        self.code = code
        self.param = param
        self.headers = headers or {}

    def payload(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        return json.dumps(self.payload()).encode()


def unauthorized() -> ApiError:
    return ApiError(
        "invalid or missing API key (send 'Authorization: Bearer KEY')",
        status=401,
        code="invalid_api_key",
    )


def unavailable(message: str, code: str) -> ApiError:
    """503 + Retry-After: the request is fine but the server cannot take it now."""
    return ApiError(
        message, status=503, code=code, headers={"Retry-After": str(RETRY_AFTER_S)}
    )


#: Engine admission errors (``TokenEvent.error_type`` of a "rejected" event) -> (status, code).
_REJECTIONS = {"DuplicateRequest": (409, "duplicate_request_id")}


def rejected(message: str | None, error_type: str | None) -> ApiError:
    """The error for a request the engine refused at admission (never fits, duplicate id)."""
    status, code = _REJECTIONS.get(error_type or "", (400, None))
    return ApiError(message or "request rejected", status=status, code=code)


def generation_failed(message: str | None) -> ApiError:
    """The backend failed while generating (after admission)."""
    return ApiError(message or "generation failed", status=500)
