"""JSON responses and the error bodies of the index service's HTTP API.

Every 4xx/5xx body is an :class:`~contextpilot_integrations.client.schemas.ErrorResponse`
(``message``, ``error_type``, ``fields``) whose ``message`` names the field and the value:

- a body that does not match its model: 422, ``ValueError``, one entry in ``fields`` per
  invalid field (``body.blocks[2]: Input should be a valid string, got 5``);
- a ``TypeError`` / ``ValueError`` the core raised for the input (a rule across fields, e.g. a
  turn without a conversation): 422 with the core's message and type;
  :class:`~contextpilot_integrations.core.request.RidConflictError`: 409;
  :class:`~contextpilot_integrations.service.tenants.TenantMismatchError` (the body names
  another tenant than the API key's): 403;
- a body over the size limit: 413; a missing or wrong API key: 401, ``PermissionError``;
- a service that is stopping: 503, ``ServiceClosingError`` (the client falls back);
- anything else: 500, ``InternalError`` (logged with its traceback, never echoed).
"""

from __future__ import annotations

import logging
import math
from typing import Any, TypeVar

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from contextpilot_integrations.core.request import RidConflictError
from contextpilot_integrations.service.tenants import TenantMismatchError

__all__ = [
    "JSON",
    "BodyTooLarge",
    "InvalidInput",
    "ServiceClosing",
    "error_body",
    "install_error_handlers",
    "json_response",
    "validate_json",
]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

JSON = "application/json"
_VALUE_CHARS = 200  # longest echo of a rejected value
_MESSAGE_CHARS = 1000


class BodyTooLarge(Exception):
    """The streamed body went over the limit (a body without Content-Length)."""


class InvalidInput(Exception):
    """A ``TypeError`` / ``ValueError`` the service raised for the request's input."""

    _STATUS: dict[type[Exception], int] = {RidConflictError: 409, TenantMismatchError: 403}

    def __init__(self, cause: TypeError | ValueError) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.status_code = self._STATUS.get(type(cause), 422)

    @property
    def error_type(self) -> str:
        if type(self.cause) in self._STATUS:
            return type(self.cause).__name__
        return "ValueError" if isinstance(self.cause, ValueError) else "TypeError"


class ServiceClosing(Exception):
    """The service is stopping (503)."""


def json_response(content: Any, status_code: int = 200) -> Response:
    """``content`` serialised by pydantic-core (no response-model validation)."""
    return Response(
        content=pydantic_core.to_json(content), status_code=status_code, media_type=JSON
    )


def error_body(
    message: str, error_type: str, fields: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """An ``ErrorResponse`` as a dict."""
    return {"message": message, "error_type": error_type, "fields": fields or []}


def validate_json(model: type[M], raw: bytes) -> M:
    """Validate a JSON body; errors become a ``RequestValidationError`` located in ``body``."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]
        raise RequestValidationError(errors) from None


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` with an ``ErrorResponse``."""
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(InvalidInput, _invalid_input)
    app.add_exception_handler(BodyTooLarge, _body_too_large)
    app.add_exception_handler(ServiceClosing, _closing)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)


# --------------------------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------------------------


async def _invalid_request(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    fields = [_field_error(error) for error in exc.errors()]
    if not fields:
        fields.append({"field": "body", "message": "invalid request", "value": None})
    first = fields[0]
    summary = f"{first['field']}: {first['message']}"
    if first["value"] is not None:
        summary += f", got {first['value']!r:.{_VALUE_CHARS}}"
    if len(fields) > 1:
        summary += f" (and {len(fields) - 1} more invalid fields)"
    return json_response(error_body(summary, "ValueError", fields), 422)


async def _invalid_input(_: Request, exc: Exception) -> Response:
    # The core names the field and the value in its TypeError / ValueError messages.
    assert isinstance(exc, InvalidInput)
    message = str(exc.cause)[:_MESSAGE_CHARS]
    return json_response(error_body(message, exc.error_type), exc.status_code)


async def _body_too_large(_: Request, exc: Exception) -> Response:
    return json_response(error_body(str(exc), "ValueError"), 413)


async def _closing(_: Request, exc: Exception) -> Response:
    return json_response(error_body(str(exc), "ServiceClosingError"), 503)


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc.__cause__, BodyTooLarge):  # FastAPI wraps it as a parse error
        return json_response(error_body(str(exc.__cause__), "ValueError"), 413)
    error_type = "PermissionError" if exc.status_code in (401, 403) else "HTTPError"
    message = str(exc.detail)
    if exc.status_code == 400 and exc.__cause__ is not None:
        error_type = "ValueError"
        message = f"body: cannot be read as JSON ({type(exc.__cause__).__name__})"
    response = json_response(error_body(message, error_type), exc.status_code)
    response.headers.update(exc.headers or {})  # e.g. Allow on a 405
    if exc.status_code == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return json_response(error_body(f"internal error: {type(exc).__name__}", "InternalError"), 500)


# --------------------------------------------------------------------------------------------
# Field errors
# --------------------------------------------------------------------------------------------


def _field_error(error: Any) -> dict[str, Any]:
    path = _field_path(tuple(error.get("loc", ())))
    message = str(error.get("msg", "invalid"))
    value = _echo(error.get("input"))
    if error.get("type") == "json_invalid":  # the input is the whole body: not echoed
        message = f"invalid JSON: {error.get('ctx', {}).get('error', message)}"
        value = None
    return {"field": path, "message": message, "value": value}


def _field_path(location: tuple[Any, ...]) -> str:
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or "body"


def _echo(value: Any) -> Any:
    """A short, JSON-safe copy of a rejected value."""
    if value is None or isinstance(value, (bool, int)):
        return value if not isinstance(value, int) or abs(value) < 2**63 else repr(value)[:40]
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        text = value[:_VALUE_CHARS]
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return repr(value)[:_VALUE_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")
