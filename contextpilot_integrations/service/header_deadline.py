"""uvicorn's HTTP protocol with a deadline on each request's line and headers.

uvicorn bounds the idle time between requests (``timeout_keep_alive``) but restarts it on
every byte received, and nothing bounds a request still arriving, so a client that sends its
headers one byte at a time holds a connection, and its slot of the server, for good (a
slowloris). :class:`HeaderDeadlineProtocol` closes a connection whose request line and
headers are not all in within :data:`HEADER_READ_TIMEOUT_S` of the connection's start or of
the request's first byte (docs/DESIGN.md, "The service"). The idle time between requests on a
kept-alive connection is uvicorn's ``timeout_keep_alive``'s alone: no deadline runs while no
request is arriving. The body has its own bound where it is read (the proxy's
``BODY_READ_TIMEOUT_S``), and an answer, however long it streams, is never cut: a request
whose first byte comes while an answer streams on the connection has its deadline from that
answer's end.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HEADER_READ_TIMEOUT_S", "HeaderDeadlineProtocol"]

logger = logging.getLogger(__name__)

HEADER_READ_TIMEOUT_S = 60.0
"""The longest a request's line and headers may take to arrive (nginx's
``client_header_timeout`` default)."""


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (``uvicorn.run(..., http=HeaderDeadlineProtocol)``) with
    the header deadline (module docstring); ``timeout_s`` is the deadline."""

    timeout_s: float = HEADER_READ_TIMEOUT_S

    _header_deadline: asyncio.TimerHandle | None = None
    _headers_arriving = False
    """A request's first byte came and its headers' end has not."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._headers_arriving = True
        if self.cycle is None or self.cycle.response_complete:
            self._arm_header_deadline()
        else:  # an answer streams: never cut; the deadline runs from its end
            self._disarm_header_deadline()

    def on_headers_complete(self) -> None:
        self._headers_arriving = False
        self._disarm_header_deadline()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._headers_arriving and not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.timeout_s, self._header_deadline_passed)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            logger.warning(
                "closed a connection from %s: its request's headers did not arrive within %.0f s",
                f"{self.client[0]}:{self.client[1]}" if self.client else "an unknown client",
                self.timeout_s,
            )
            self.transport.close()
