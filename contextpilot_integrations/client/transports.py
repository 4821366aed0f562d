"""How the service client sends: one blocking transport, one async transport per event loop,
and the two drivers that run a call written once as a generator of HTTP requests.

A call (:data:`Steps`) yields each :class:`httpx.Request` to send and is sent back the read
:class:`httpx.Response`, or thrown the transport's exception (``httpx.TransportError``: the
service is unreachable or timed out); its return value is the call's result.
:meth:`Transports.run` drives it with the blocking transport, :meth:`Transports.arun` with the
running event loop's async transport, so the body encoding, the decoding, the error mapping
and the fallback decision of every call exist once for both twins of
:class:`~contextpilot_integrations.client.client.ContextPilotClient`.

An async transport's connections belong to the event loop that opened them, so each loop gets
its own, made on its first request and closed on that loop when it shuts down: one client
serves ``asyncio.run`` after ``asyncio.run``, or one event loop per test.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Generator
from typing import TypeVar

import httpx

__all__ = ["Steps", "Transports"]

T = TypeVar("T")

Steps = Generator[httpx.Request, httpx.Response, T]
"""One call: yields the HTTP requests to send, is sent each response (or thrown the
transport's error), returns the call's result."""


class Transports:
    """The client's transports and drivers.

    Args:
        transport: the blocking transport (default a new ``httpx.HTTPTransport``, a
            keep-alive connection pool, closed by :meth:`close`; one given is the caller's to
            close). Requests go to the transport directly, without ``httpx.Client``'s auth,
            redirect and cookie handling, which the service needs none of (their cost per
            call: ``benchmarks/micro/bench_service.py``).
        async_transport_factory: makes the async transport of each event loop (default
            ``httpx.AsyncHTTPTransport``); a loop's transport is closed by :meth:`aclose` on
            that loop, or when the loop shuts down (``asyncio.run``, ``asyncio.Runner``).

    Thread-safe.
    """

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        async_transport_factory: Callable[[], httpx.AsyncBaseTransport] | None = None,
    ) -> None:
        self._transport = transport or httpx.HTTPTransport()
        self._owns_transport = transport is None
        self._new_async_transport = async_transport_factory or httpx.AsyncHTTPTransport
        self._lock = threading.Lock()
        self._per_loop: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[httpx.AsyncBaseTransport, AsyncGenerator[None, None]]
        ] = weakref.WeakKeyDictionary()

    def run(self, steps: Steps[T]) -> T:
        """Run a call with the blocking transport; returns its result."""
        try:
            request = next(steps)
            while True:
                try:
                    response = self._send(request)
                except Exception as exc:
                    request = steps.throw(exc)
                else:
                    request = steps.send(response)
        except StopIteration as done:
            result: T = done.value
            return result

    async def arun(self, steps: Steps[T]) -> T:
        """Run a call with the running event loop's async transport; returns its result."""
        try:
            request = next(steps)
            while True:
                try:
                    response = await self._asend(request)
                except Exception as exc:
                    request = steps.throw(exc)
                else:
                    request = steps.send(response)
        except StopIteration as done:
            result: T = done.value
            return result

    def close(self) -> None:
        """Close the blocking transport (if made here) and drop the async ones (a loop's
        connections are closed by :meth:`aclose` on it, or when it shuts down)."""
        if self._owns_transport:
            self._transport.close()
        with self._lock:
            self._per_loop.clear()

    async def aclose(self) -> None:
        """Close the running loop's async transport, then as :meth:`close`."""
        with self._lock:
            entry = self._per_loop.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry[1].aclose()  # closes the transport
        self.close()

    async def _closed_with_loop(
        self, loop: asyncio.AbstractEventLoop, transport: httpx.AsyncBaseTransport
    ) -> AsyncGenerator[None, None]:
        """Holds ``loop``'s transport until the loop shuts down.

        Started once and left at its ``yield``, it is one of the loop's open async generators,
        which ``asyncio.run`` and ``asyncio.Runner.close`` finalise
        (``loop.shutdown_asyncgens``) before closing the loop: the ``finally`` then closes the
        connections on the loop that opened them and forgets the loop. (Kept past its loop, a
        transport would keep the loop alive through its connections, which the garbage
        collector would reclaim only with the client, a ``ResourceWarning`` for each socket.)
        """
        try:
            yield
        finally:
            with self._lock:
                entry = self._per_loop.get(loop)
                if entry is not None and entry[0] is transport:
                    del self._per_loop[loop]
            await transport.aclose()

    def _send(self, request: httpx.Request) -> httpx.Response:
        response = self._transport.handle_request(request)
        try:
            response.read()
        finally:
            response.close()
        return response

    async def _asend(self, request: httpx.Request) -> httpx.Response:
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._per_loop.get(loop)
            new = entry is None
            if entry is None:
                transport = self._new_async_transport()
                entry = self._per_loop[loop] = (transport, self._closed_with_loop(loop, transport))
        if new:
            await entry[1].__anext__()  # runs to its yield at once: no other task interleaves
        response = await entry[0].handle_async_request(request)
        try:
            await response.aread()
        finally:
            await response.aclose()
        return response
