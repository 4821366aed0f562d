"""The service client's errors, and what each HTTP answer of the service raises.

:func:`checked` maps an answer to the error the in-process ``ContextPilot`` would raise: the
core's ``TypeError`` / ``ValueError`` with the core's message (422, the body's
``error_type``), :class:`~contextpilot_integrations.core.request.RidConflictError` (409),
``PermissionError`` (401: a wrong API key; 403: a body naming another tenant than the key's),
:class:`ServiceError` for any other refusal and :class:`ServiceUnavailableError` for a 5xx
(the client may plan locally then). :data:`UNAVAILABLE` and :data:`NOT_DELIVERED` sort the
transport's failures for the fallback (:mod:`.fallback`).
"""

from __future__ import annotations

import httpx

from contextpilot_integrations.core.request import RidConflictError

__all__ = [
    "NOT_DELIVERED",
    "UNAVAILABLE",
    "ServiceError",
    "ServiceUnavailableError",
    "checked",
]


class ServiceError(RuntimeError):
    """The service refused a call for another reason than bad input or authentication.

    Attributes:
        status_code: the HTTP status (0 when no response came back).
    """

    def __init__(self, message: str, status_code: int = 0) -> None:
        super().__init__(message)
        self.status_code = status_code


class ServiceUnavailableError(ServiceError):
    """The service could not be reached or failed (5xx), and the fallback is off."""


UNAVAILABLE = (httpx.TransportError, ServiceUnavailableError)
"""Failures that mean "the service is not there": fall back, never raise to the user."""

NOT_DELIVERED = (httpx.ConnectError, httpx.ConnectTimeout)
"""Failures before the request reached the service: it cannot have planned it."""

_RAISED_AS: dict[str, type[Exception]] = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "RidConflictError": RidConflictError,
}


def checked(response: httpx.Response) -> httpx.Response:
    """Return a 2xx (or 3xx) response; raise the error a 4xx stands for; a 5xx raises
    :class:`ServiceUnavailableError` (the caller may fall back).

    Raises:
        TypeError / ValueError / RidConflictError: the core's error the service reported
            (422, 409), with its message.
        PermissionError: a 401 (wrong or missing API key) or a 403 (another tenant named).
        ServiceError: any other 4xx.
        ServiceUnavailableError: a 5xx.
    """
    status = response.status_code
    if status < 400:
        return response
    try:
        error = response.json()
        message = str(error.get("message", response.text))
        error_type = str(error.get("error_type", ""))
    except (ValueError, AttributeError):
        message, error_type = response.text[:1000], ""
    if status >= 500:
        raise ServiceUnavailableError(f"service error {status}: {message}", status)
    if status == 401:
        raise PermissionError(f"index service refused the API key: {message}")
    if status == 403:
        raise PermissionError(f"index service refused the call: {message}")
    if status == 409:
        raise RidConflictError(message)
    raised = _RAISED_AS.get(error_type)
    if raised is None:
        raise ServiceError(f"service refused the call ({status}): {message}", status)
    raise raised(message)
