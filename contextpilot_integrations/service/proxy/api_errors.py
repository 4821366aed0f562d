"""Error answers of the proxy in the shape of the API the client speaks, so that its SDK
raises its own error types (``openai.APIStatusError`` subclasses, ``anthropic.APIStatusError``
subclasses) with the message.

- OpenAI (``/v1/chat/completions`` and the passed-through paths):
  ``{"error": {"message", "type", "param", "code"}}``;
- Anthropic (``/v1/messages``): ``{"type": "error", "error": {"type", "message"}}``.

The upstream's own error answers are never rewritten: they pass with their status and body.
"""

from __future__ import annotations

import json
from typing import Literal

from starlette.responses import Response

__all__ = ["ErrorApi", "error_answer", "error_bytes"]

ErrorApi = Literal["openai", "anthropic"]

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    502: "upstream_error",
    503: "upstream_busy",
    504: "upstream_timeout",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_bytes(api: ErrorApi, status: int, message: str, param: str | None = None) -> bytes:
    """The JSON error body of ``api`` for ``status`` (``param``: the field at fault)."""
    if api == "anthropic":
        kind = _ANTHROPIC_TYPES.get(status, "api_error")
        document: dict[str, object] = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        kind = _OPENAI_TYPES.get(status, "api_error")
        document = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return json.dumps(document, ensure_ascii=False).encode("utf-8")


def error_answer(
    api: ErrorApi,
    status: int,
    message: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """:func:`error_bytes` as a response."""
    return Response(
        error_bytes(api, status, message, param),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )
