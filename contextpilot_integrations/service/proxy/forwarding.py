"""One request forwarded to the upstream and its answer streamed back as it arrives.

:class:`ForwardedAnswer` is the ASGI answer of a proxied request. It sends the request on the
pooled client (:mod:`.upstream`) and passes the upstream's status, headers and every chunk of
its body to the client the moment it arrives (server-sent events included: nothing is
buffered), while a watcher listens for the client's ``http.disconnect``: a client that goes
cancels the upstream request (its connection is closed, so the engine stops generating).

Failures (docs/DESIGN.md, "The proxy"): an upstream that cannot be reached or does not answer
within the connect timeout is a 502 in the API's error shape naming the upstream (504 when it
accepted the connection but sent nothing within the read timeout); an upstream that fails after
its answer started has its answer cut short (the connection is closed, so the client's SDK sees
an incomplete answer, never a silently truncated one). The upstream's own error answers pass
with their status and body.

With a ``reroute`` (the proxy in front of several replicas), an upstream that cannot be reached
(a refused connection, a connect timeout: nothing was sent) is replaced by the one ``reroute``
gives, with its answer headers, and the request goes there; the 502 comes only when it gives
none.

A connection the upstream closes before any byte of an answer (a pooled keep-alive connection
the upstream shut as the request went out: an ASGI server closes one after an unhandled
exception's 500 without announcing it) is retried once (:data:`RETRIED_ONCE`); a second such
failure is the 502. aiohttp retries such a failure of an idempotent request (``GET``, ``PUT``,
``DELETE``, ...) once itself, so the proxy retries only the others (``POST``, ``PATCH``).
Timeouts and refused connections are never retried.

A client that goes before the answer ended, whether it had started or not, has the request
metered with the status :data:`CLIENT_GONE` (nginx's "client closed request"), never as the
upstream's status or a server error; one that goes before the answer started gets no answer:
the answer's start goes to the server, which drops it for a closed connection. Every answer
is metered once, when it is over. An answer has ended for the client once the upstream's has
ended and every byte of it went to the server: a client that closes after the last event (an
SDK that stops reading at ``data: [DONE]``) before the proxy's own end of the body is no
client gone.

A call holds a slot of its upstream's :class:`~.connection_gate.ConnectionGate` from before
its request goes out until its answer is over, however it ends (streamed, broken off, the
client gone, cancelled); one that finds no slot within the pool timeout is a 503 with
``Retry-After`` in the API's error shape, counted ``pool_timeout``, and nothing is sent.

After the answer, the usage read from it (:mod:`.usage_watch`) goes to ``on_usage``, which hands
it to a thread and returns at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

import aiohttp
import anyio
from prometheus_client import Counter
from starlette.responses import Response
from yarl import URL

from contextpilot_integrations.llm_call.engine_fields import Usage
from contextpilot_integrations.service.middleware import AnswerProgress
from contextpilot_integrations.service.proxy.api_errors import ErrorApi, error_bytes
from contextpilot_integrations.service.proxy.connection_gate import PoolBusy
from contextpilot_integrations.service.proxy.upstream import Upstream, answer_headers
from contextpilot_integrations.service.proxy.usage_watch import UsageWatch

__all__ = ["CLIENT_GONE", "RETRIED_ONCE", "ForwardedAnswer", "ProxyCounters", "Reroute"]

logger = logging.getLogger(__name__)

CLIENT_GONE = 499
"""The status a request is metered with when its client went before the answer ended."""

RETRIED_ONCE = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientConnectionResetError,
    aiohttp.ClientOSError,
)
"""What sending raises for a connection closed before the answer's first byte (an end of stream
where the status line was due, a reset, a write to a closing connection); the request is sent
once more. A failure to connect (``aiohttp.ClientConnectorError``, a ``ClientOSError`` too) is
not one of them."""

_RETRIED_BY_AIOHTTP = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
"""The idempotent methods aiohttp sends once more itself after such a failure (module
docstring)."""

Message = MutableMapping[str, Any]

Reroute = Callable[[], "tuple[Upstream, Sequence[tuple[bytes, bytes]]] | None"]
"""Blocking (run in a worker thread): another upstream for a request whose upstream could not
be reached, and the report headers that go with it; ``None``: none left. An exception it
raises leaves the answer unsent and propagates out of it (within an exception group): the hop
to a peer proxy plans the call where it arrived instead (docs/DESIGN.md, "Proxy peers")."""

_REROUTED = object()


class ProxyCounters:
    """The proxy's Prometheus counters (on the service's registry).

    - ``contextpilot_proxy_requests_total{endpoint, status}``: answers given, by the path's
      kind (``chat_completions``, ``messages``, ``pass_through``) and status
      (:data:`CLIENT_GONE` for a client that went before the answer ended);
    - ``contextpilot_proxy_upstream_failures_total{kind}``: ``unreachable``, ``timeout``,
      ``broken`` (failed after its answer started), ``cancelled`` (the client went before the
      answer ended), ``pool_timeout`` (no connection of the pool free within the pool
      timeout: a 503, nothing sent).

    ``prefix`` replaces ``contextpilot_proxy`` in the names (the hop to a peer proxy counts
    its own: docs/DESIGN.md, "Proxy peers").
    """

    def __init__(self, registry: Any, prefix: str = "contextpilot_proxy") -> None:
        self.requests = Counter(
            f"{prefix}_requests",
            "Proxied requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=registry,
        )
        self.failures = Counter(
            f"{prefix}_upstream_failures",
            "Proxied requests the upstream did not answer in full, by kind.",
            ["kind"],
            registry=registry,
        )


class ForwardedAnswer(Response):
    """The answer of one proxied request (an ASGI app; module docstring).

    Args:
        upstream: the upstream and its pool.
        method: the HTTP method.
        path: the proxy's path (``/v1/...``).
        query: the raw query string.
        headers: the request headers to send upstream.
        body: the request body to send.
        api: the error shape of the client's API.
        endpoint: the metrics' endpoint label.
        counters: the proxy's counters.
        report: headers added to the answer (what the proxy found and changed).
        on_usage: called with the usage read from a successful answer, on the event loop,
            so it must return at once (``None``: the answer is not watched).
        reroute: another upstream for a request whose upstream cannot be reached
            (:data:`Reroute`; module docstring).
        pass_headers: the upstream answer's raw headers as the client gets them (default
            :func:`~.upstream.answer_headers`).
        pool_tenant: whose share of the pool's connections the call takes (``None``: a
            service without tenants, or with one: the whole pool; :mod:`.connection_gate`).
    """

    def __init__(
        self,
        upstream: Upstream,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        api: ErrorApi,
        endpoint: str,
        counters: ProxyCounters,
        report: Sequence[tuple[bytes, bytes]] = (),
        on_usage: Callable[[Usage], None] | None = None,
        reroute: Reroute | None = None,
        pass_headers: Callable[[Sequence[tuple[bytes, bytes]]], list[tuple[bytes, bytes]]] = (
            answer_headers
        ),
        pool_tenant: str | None = None,
    ) -> None:
        super().__init__(status_code=200)
        self._pass_headers = pass_headers
        self._pool_tenant = pool_tenant
        self._reroute = reroute
        self._path_query = (path, query)
        self._upstream = upstream
        self._method = method
        # Sent as given: the path keeps the client's percent-encoding (:mod:`.routes`).
        self._url = URL(upstream.url(path, query), encoded=True)
        self._sent_headers = headers
        self._body = body
        self._api: ErrorApi = api
        self._endpoint = endpoint
        self._counters = counters
        self._report = list(report)
        self._on_usage = on_usage
        self._watch: UsageWatch | None = None
        self._answer: aiohttp.ClientResponse | None = None
        self.admit: Callable[[], Awaitable[None]] | None = None
        """Awaited before the request is sent (while the client's disconnect is watched):
        the replica's door (:mod:`.replica_order`)."""
        self.on_started: Callable[[], None] | None = None
        """Called once, on the event loop, when the upstream's answer starts: its first body
        bytes (a streaming engine's first token), or its end."""
        self.on_headers: Callable[[Mapping[str, str]], None] | None = None
        """Called once, on the event loop, with the upstream's answer headers (a gateway's
        word on where the call went: :mod:`.gateway_workers`); an error in it is logged, the
        answer goes on."""
        self.on_refused: Callable[[], None] | None = None
        """Called once, on the event loop, when the upstream answers with a 4xx status (it
        refused the request, so nothing of it was prefilled); an error in it is logged."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        progress = AnswerProgress()
        gone = False
        found: Usage | None = None

        async def send_tracked(message: Message) -> None:
            progress.sent(message)  # before the send: a disconnect during it is no cancel
            await send(message)

        try:
            async with anyio.create_task_group() as group:

                async def until_disconnect() -> None:
                    nonlocal gone
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            # A server reports a disconnect once the client has the whole
                            # answer too (it closed or reused the connection): no cancel
                            # then, nor once the upstream's answer has ended and every byte
                            # of it went to the server (a client that closes after the last
                            # event, before the body's end).
                            if not progress.whole and not self._upstream_ended():
                                gone = True
                                self._counters.failures.labels("cancelled").inc()
                                group.cancel_scope.cancel()
                            return

                group.start_soon(until_disconnect)
                try:
                    found = await self._forward(send_tracked)
                finally:
                    group.cancel_scope.cancel()
        finally:
            status = CLIENT_GONE if gone else progress.status
            if status is not None:
                self._counters.requests.labels(self._endpoint, str(status)).inc()
        if gone and not progress.started:
            await self._client_gone(send)
        if found is None and gone and self._watch is not None:
            # The prompt was processed whatever the client did after: a usage already seen
            # (OpenAI's usage chunk, Anthropic's message_start) is the engine's real figure.
            found = self._watch.usage()
        if found is not None and self._on_usage is not None:
            try:
                self._on_usage(found)
            except Exception:
                logger.exception("recording the upstream's usage failed")

    async def _client_gone(self, send: Any) -> None:
        """End a request whose client went before its answer started (module docstring)."""
        try:
            await send({"type": "http.response.start", "status": CLIENT_GONE, "headers": []})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # a server that raises on a closed connection (ASGI allows it)
            pass

    async def _forward(self, send: Any) -> Usage | None:
        """Send the request, stream the answer; the usage read (successful answers only). An
        unreachable upstream is replaced while ``reroute`` gives another."""
        if self.admit is not None:
            await self.admit()
        while True:
            found = await self._forward_once(send)
            if found is not _REROUTED:
                return found  # type: ignore[return-value]

    async def _rerouted(self) -> bool:
        """Whether ``reroute`` gave another upstream (the request then goes there)."""
        if self._reroute is None:
            return False
        other = await anyio.to_thread.run_sync(self._reroute)
        if other is None:
            return False
        self._upstream, report = other
        self._report = list(report)
        path, query = self._path_query
        self._url = URL(self._upstream.url(path, query), encoded=True)
        return True

    async def _forward_once(self, send: Any) -> Usage | None | object:
        """One upstream's try of :meth:`_forward` (:data:`_REROUTED`: try the next), holding
        a slot of its pool while it runs."""
        gate = self._upstream.gate
        try:
            await gate.acquire(self._pool_tenant)
        except PoolBusy as exc:
            self._counters.failures.labels("pool_timeout").inc()
            where = self._upstream.config.upstream_url
            retry_after = str(max(1, math.ceil(gate.timeout_s))).encode("ascii")
            await self._error(
                send, 503, f"upstream {where}: {exc}", [(b"retry-after", retry_after)]
            )
            return None
        try:
            return await self._forward_held(send)
        finally:
            gate.release(self._pool_tenant)

    async def _forward_held(self, send: Any) -> Usage | None | object:
        """:meth:`_forward_once` once its slot is held."""
        where = self._upstream.config.upstream_url
        try:
            try:
                response = await self._send()
            except RETRIED_ONCE as exc:
                if (
                    isinstance(exc, aiohttp.ClientConnectorError)
                    or self._method in _RETRIED_BY_AIOHTTP
                ):
                    raise
                logger.info("upstream %s closed the connection unanswered (%s): sent again",
                            where, _what(exc))  # fmt: skip
                response = await self._send()
        except aiohttp.ServerTimeoutError as exc:
            connecting = isinstance(exc, aiohttp.ConnectionTimeoutError)
            kind, status = ("unreachable", 502) if connecting else ("timeout", 504)
            self._counters.failures.labels(kind).inc()
            if connecting and await self._rerouted():
                return _REROUTED
            await self._error(send, status, f"upstream {where} did not answer: {_what(exc)}")
            return None
        except aiohttp.ClientConnectorError as exc:
            self._counters.failures.labels("unreachable").inc()
            if await self._rerouted():
                return _REROUTED
            await self._error(send, 502, f"upstream {where} cannot be reached: {_what(exc)}")
            return None
        except (aiohttp.ClientError, OSError) as exc:
            self._counters.failures.labels("unreachable").inc()
            await self._error(send, 502, f"upstream {where} gave no answer: {_what(exc)}")
            return None
        ended = False
        self._answer = response
        try:
            status = response.status
            self._read_headers(response.headers)
            if 400 <= status < 500:
                self._refused()
            watch = (
                UsageWatch(response.headers.get("content-type", ""))
                if self._on_usage is not None and 200 <= status < 300
                else None
            )
            self._watch = watch
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": self._pass_headers(response.raw_headers) + self._report,
                }
            )
            try:
                async for chunk in response.content.iter_any():
                    self._started()
                    if watch is not None:
                        watch.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                # The status is sent: end the connection without ending the body, so the
                # client sees an incomplete answer.
                self._counters.failures.labels("broken").inc()
                logger.warning("upstream %s broke off its answer: %s", where, _what(exc))
                return None
            ended = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return watch.usage() if watch is not None else None
        finally:
            # A whole answer's connection goes back to the pool; any other is closed, so the
            # upstream stops (a cancelled or broken answer).
            if ended:
                response.release()
            else:
                response.close()

    def _upstream_ended(self) -> bool:
        """Whether the upstream's answer has ended and all of its body was read. A chunk read
        goes to the server before anything else runs (no wait between the read and the send),
        so then every byte of it was handed to the server."""
        return self._answer is not None and self._answer.content.at_eof()

    def _read_headers(self, headers: Mapping[str, str]) -> None:
        """Tell :attr:`on_headers` once."""
        read, self.on_headers = self.on_headers, None
        if read is not None:
            try:
                read(headers)
            except Exception:
                logger.exception("reading the upstream's answer headers failed")

    def _refused(self) -> None:
        """Tell :attr:`on_refused` once."""
        refused, self.on_refused = self.on_refused, None
        if refused is not None:
            try:
                refused()
            except Exception:
                logger.exception("following the upstream's refusal failed")

    def _started(self) -> None:
        """Tell :attr:`on_started` once."""
        started, self.on_started = self.on_started, None
        if started is not None:
            started()

    async def _send(self) -> aiohttp.ClientResponse:
        """The upstream's answer, its status and headers read (its body not yet)."""
        return await self._upstream.client.request(
            self._method,
            self._url,
            headers=self._sent_headers,
            data=self._body or None,
            allow_redirects=False,
        )

    async def _error(
        self,
        send: Any,
        status: int,
        message: str,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        body = error_bytes(self._api, status, message)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode("ascii")),
                    *headers,
                    *self._report,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _what(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
