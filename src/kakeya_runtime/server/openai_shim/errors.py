"""OpenAI-shaped errors: `{"error": {message, type, param, code}}` with an HTTP status, and the session errors'
translation into them."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kakeya_runtime.sessions.errors import ErrorKind, InvariantViolation, SessionError

_log = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400: the request is wrong (nothing was started)."""
    return OpenAIError(400, message, param=param, code=code)


def too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(413, f"request body of {size} bytes exceeds this server's limit of {limit} bytes "
                            "(sized to the model's context)", code="request_too_large")


def internal(log_message: str) -> OpenAIError:
    """A 500 with a bug id that the log line repeats."""
    bug = uuid.uuid4()
    _log.exception("%s (bug id %s)", log_message, bug)
    return OpenAIError(500, f"internal error; bug id {bug}", type="server_error", code="internal_error")


async def call(awaitable: Awaitable[Any]) -> Any:
    """Await a session-service call, answering its typed errors as OpenAI errors."""
    try:
        return await awaitable
    except SessionError as e:
        raise from_session_error(e) from None


def from_session_error(e: SessionError) -> OpenAIError:
    if isinstance(e, InvariantViolation):
        bug = uuid.uuid4()
        _log.error("invariant violation in a shim session (bug id %s): %s", bug, e.message)
        return OpenAIError(500, f"internal cache invariant violation; bug id {bug}", type="internal_error",
                           code="kv_cache_inv_violation")
    if e.kind is ErrorKind.INVALID_ARGUMENT:
        return bad(e.message)
    if e.kind is ErrorKind.RESOURCE_EXHAUSTED:
        return OpenAIError(429, e.message, type="rate_limit_error", code="resource_exhausted",
                           headers={"retry-after": "1"})
    if e.kind is ErrorKind.UNAVAILABLE:
        return OpenAIError(503, e.message, type="server_error", code="unavailable", headers={"retry-after": "5"})
    return OpenAIError(500, e.message, type="server_error", code=e.kind.value)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405s, OpenAI-shaped."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return OpenAIError(exc.status_code, message, code=code).response()
