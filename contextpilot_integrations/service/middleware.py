"""The index service's ASGI middleware: every HTTP request counted and timed, bodies over the
limit refused (413), every answer stamped with the service's boot id.

Plain ASGI middleware (cheaper per request than Starlette's ``BaseHTTPMiddleware``). The
limit holds both for a declared ``Content-Length`` (refused before the body is read) and for a
streamed body without one (refused as soon as the received bytes pass it). The boot id
(:data:`~contextpilot_integrations.client.schemas.BOOT_HEADER`) goes on every answer, errors
and 413s included, so a client can tell a restarted service from any answer.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from contextpilot_integrations.client.schemas import BOOT_HEADER
from contextpilot_integrations.service.errors import BodyTooLarge
from contextpilot_integrations.service.metrics import ServiceMetrics

__all__ = ["AnswerProgress", "BootIdMiddleware", "MeteringMiddleware"]

ASGIScope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class MeteringMiddleware:
    """Counts and times every HTTP request; refuses bodies over ``max_body_bytes`` (413).

    Args:
        app: the ASGI app to wrap.
        metrics: where ``contextpilot_http_requests_total`` and the latency histogram go.
        max_body_bytes: the largest request body accepted.
        known_paths: paths metered under their own name; others count as ``other`` (so a
            scan of random paths cannot grow the label set).
    """

    def __init__(
        self,
        app: Any,
        *,
        metrics: ServiceMetrics,
        max_body_bytes: int,
        known_paths: frozenset[str],
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.known_paths = known_paths

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        path = scope["path"]
        endpoint = path if path in self.known_paths else "other"
        progress = AnswerProgress()
        gone = [False]

        async def send_metered(message: Message) -> None:
            progress.sent(message)  # before the send: a disconnect during it is no hang-up
            await send(message)

        async def receive_watched() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not progress.whole:
                gone[0] = True
            return message

        try:
            declared = _content_length(scope)
            if declared is not None and declared > self.max_body_bytes:
                # Refused at the first read, unread, by the route's own error handling, so
                # the answer has the shape of the route's API (the service's, OpenAI's or
                # Anthropic's through the proxy).
                refusal = f"body: {declared} bytes exceeds the limit of {self.max_body_bytes} bytes"
                await self.app(scope, _refusing(refusal), send_metered)
                return
            await self.app(scope, self._limited(receive_watched), send_metered)
        finally:
            # The client went before it had the whole answer, started or not, and the answer
            # never ended: 499 (nginx's "client closed request"); no answer started otherwise:
            # the app failed (500). An app may end the answer after the disconnect: the
            # proxy's forwarded answer does when the upstream's had ended and all its bytes
            # were sent (the client closed after the last byte, before the body's end).
            hung_up = gone[0] and not progress.whole
            code = 499 if hung_up else progress.status if progress.status is not None else 500
            self.metrics.http_requests.labels(endpoint, str(code)).inc()
            self.metrics.http_latency.labels(endpoint).observe(time.perf_counter() - started)

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` that raises :class:`BodyTooLarge` once the body passes the limit."""
        received = [0]

        async def receive_limited() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                received[0] += len(message.get("body", b""))
                if received[0] > self.max_body_bytes:
                    raise BodyTooLarge(f"body: more than the limit of {self.max_body_bytes} bytes")
            return message

        return receive_limited


class AnswerProgress:
    """How far an answer to the client got: ``status`` (its start sent; ``None`` before),
    ``whole`` (the client holds all of it: the declared ``content-length`` sent, or the body's
    end). A server reports a disconnect once the client has the whole answer too (it closed or
    reused the connection), so only a disconnect before ``whole`` is a client that hung up."""

    __slots__ = ("_left", "status", "whole")

    def __init__(self) -> None:
        self.status: int | None = None
        self.whole = False
        self._left: int | None = None

    @property
    def started(self) -> bool:
        """Whether the answer's start was sent."""
        return self.status is not None

    def sent(self, message: Message) -> None:
        """Note one ASGI message on its way to the client."""
        if message["type"] == "http.response.start":
            self.status = message["status"]
            for name, value in message.get("headers", ()):
                if name == b"content-length" and value.isdigit():
                    self._left = int(value)
        elif message["type"] == "http.response.body":
            if self._left is not None:
                self._left -= len(message.get("body", b""))
                self.whole = self.whole or self._left <= 0
            self.whole = self.whole or not message.get("more_body", False)


class BootIdMiddleware:
    """Adds the :data:`~contextpilot_integrations.client.schemas.BOOT_HEADER` header to every
    HTTP answer.

    Args:
        app: the ASGI app to wrap.
        boot_id: the service's boot id (``IndexService.boot_id``).
    """

    def __init__(self, app: Any, *, boot_id: str) -> None:
        self.app = app
        self._header = (BOOT_HEADER.encode(), boot_id.encode())

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self._header]
            await send(message)

        await self.app(scope, receive, send_stamped)


def _content_length(scope: ASGIScope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _refusing(message: str) -> Receive:
    """A ``receive`` that raises :class:`BodyTooLarge` with ``message`` at once (a body whose
    declared length is over the limit is never read)."""

    async def receive_refused() -> Message:
        raise BodyTooLarge(message)

    return receive_refused
