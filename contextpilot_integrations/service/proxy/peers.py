"""Several proxy processes that plan as one: each planned call is handled by the process that
owns its key, whichever process it reached (docs/DESIGN.md, "Proxy peers").

The planners' memory of a conversation (replay, tool-result pointers, the messages sent with
documents) and a tenant's document index live in one process. So each call has an *owner
key* (:func:`owner_key`) and an owner: the peer first in the key's rendezvous order
(:func:`rendezvous_order`: every peer scored by a hash of the key and its URL, highest
first), which every process computes alike from the same peer list. A call that reaches
another process is forwarded once, raw (its body, path, query and headers as the client sent
them, the client's key included), to the owner, which handles it as if it came from the
client; its answer (headers, report and stream) is passed back as it arrives, and a client
that goes cancels it there too (:class:`~.forwarding.ForwardedAnswer`).

- *The mark.* A forwarded call carries :data:`PEER_HEADER` with the peers' shared secret; a
  process handles a call so marked itself, never forwarding it again (so no views of the
  group that differ can make a call loop). The mark is compared in constant time; a mark
  that does not match is ignored (counted) and the call follows the rule, so a client cannot
  make a process skip it.
- *A peer that is down* (a refused connection or a connect timeout: nothing was sent) is
  passed over for ``retry_down_s``: the call goes to the next in its order, and where that is
  this process it is planned here. Its conversation's memory then starts fresh here (a
  history replayed in full as new, which costs that call a prefix miss, never a pointer to
  text the request does not hold), and its later calls go back to the owner once it is up.
- A body whose key cannot be read (not JSON, not an object, a conversation header that
  cannot be an id) is handled here: its error then comes from here, in the client's API
  shape.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import anyio
import msgspec
from prometheus_client import Counter
from starlette.responses import Response

from contextpilot_integrations.client.schemas import BOOT_HEADER
from contextpilot_integrations.core.messages.message_shapes import Api
from contextpilot_integrations.service.proxy.conversation_key import conversation_key
from contextpilot_integrations.service.proxy.forwarding import ForwardedAnswer, ProxyCounters
from contextpilot_integrations.service.proxy.peer_config import PeerConfig
from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
from contextpilot_integrations.service.proxy.upstream import Upstream, answer_headers

__all__ = ["PEER_HEADER", "PLANNED_BY_HEADER", "Peers", "owner_key", "rendezvous_order"]

logger = logging.getLogger(__name__)

PEER_HEADER = "x-contextpilot-peer"
"""The request header that marks a call one peer forwarded to another (the shared secret)."""

PLANNED_BY_HEADER = "x-contextpilot-planned-by"
"""The answer header naming the process that planned the call (``peer-<i>``: its position in
the sorted peer URLs)."""

_OWN_PREFIX = b"x-contextpilot-"
_PEER_HEADER_BYTES = PEER_HEADER.encode("ascii")
_BOOT_HEADER_BYTES = BOOT_HEADER.encode("ascii")

_HOP_READ_MARGIN_S = 60.0

_ALIVE_FOR_S = 1.0
"""Seconds a peer that answered its ``GET /health`` is taken as alive; past them the next hop
to it asks again first (within :data:`_ALIVE_TIMEOUT_S`), so a peer that accepts connections
but answers nothing (stopped, its event loop blocked) is passed over like one that is down."""

_ALIVE_TIMEOUT_S = 5.0
"""Longest wait for a peer's ``GET /health`` answer: long enough for a busy peer on a loaded
machine (passing over one that is merely slow splits its conversations' memory), short
against the hop's read timeout a stopped peer would otherwise hold a call for."""
"""Added to the upstream's read timeout for the wait on a peer: the owner plans the call and
then waits for its upstream up to that timeout, answering 504 after it, so the hop's own wait
must outlast both."""


class _Extension(msgspec.Struct):
    """What the owner key reads of the body extension (the documents are not decoded)."""

    conversation_id: Any = None
    documents: msgspec.Raw = msgspec.Raw(b"null")


class _Head(msgspec.Struct):
    """What the owner key reads of a body (the messages are decoded up to the first user
    message, the rest skipped)."""

    messages: msgspec.Raw = msgspec.Raw(b"null")
    model: Any = None
    system: Any = None
    user: Any = None
    metadata: Any = None
    contextpilot: msgspec.Raw = msgspec.Raw(b"null")


def owner_key(raw: bytes, api: Api, tenant: str | None, session_header: str | None) -> str | None:
    """The key a call's owner is chosen by; ``None`` when it cannot be read (module
    docstring; the call is then handled where it arrived).

    The conversation's key as :func:`~.conversation_key.conversation_key` derives it, with the
    tenant: every call of a conversation meets its planner's memory. A call with documents and
    no named conversation (keyed by its opening only) is keyed by its tenant alone: such a call
    keeps no memory of its own (docs/DESIGN.md, "The proxy"), while the tenant's document index
    finds shared prefixes only among the calls it planned, so splitting those calls over the
    processes would only split the index.

    Blocking where the body must be read (no session header): run it in a worker thread.
    """
    tenant_text = tenant or ""
    if session_header is not None:
        try:
            key, _ = conversation_key(session_header, None, {}, api)
        except ValueError:
            return None
        return json.dumps(["conversation", tenant_text, key])
    head = _read_head(raw, api)
    if head is None:
        return None
    body, extension = head
    try:
        key, source = conversation_key(None, extension.get("conversation_id"), body, api)
    except ValueError:
        return None
    if source == "opening" and extension.get("documents") is not None:
        return json.dumps(["tenant", tenant_text])
    return json.dumps(["conversation", tenant_text, key])


def _read_head(raw: bytes, api: Api) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(the fields conversation_key reads, the extension's conversation_id and whether
    documents are given)``, ``None`` for a body that is not a JSON object with a messages list
    (or an extension that is not an object)."""
    try:
        head = msgspec.json.decode(raw, type=_Head)
        extension = msgspec.json.decode(head.contextpilot, type=_Extension | None)
        items = msgspec.json.decode(head.messages, type=list[msgspec.Raw])
        messages: list[Any] = []
        for item in items:
            message = msgspec.json.decode(item)
            messages.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        fields = {"model": head.model, "system": head.system, "user": head.user,
                  "metadata": head.metadata, "messages": messages}  # fmt: skip
        documents = extension is not None and bytes(extension.documents) != b"null"
        given = {
            "conversation_id": extension.conversation_id if extension is not None else None,
            "documents": True if documents else None,
        }
        return fields, given
    except (msgspec.DecodeError, RecursionError):
        pass
    # What msgspec refuses but json reads (NaN, a lone surrogate escape, a number past a
    # float's range): read whole, as the planning reads it.
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return None
    extension_body = body.get("contextpilot")
    if extension_body is None:
        extension_body = {}
    if not isinstance(extension_body, dict):
        return None
    return body, {
        "conversation_id": extension_body.get("conversation_id"),
        "documents": True if extension_body.get("documents") is not None else None,
    }


def rendezvous_order(key: str, urls: Iterable[str]) -> list[str]:
    """``urls`` in ``key``'s rendezvous order: highest score first, the score a 64-bit hash of
    the key and the URL (ties, practically never, by URL). Adding or removing a peer moves
    only the keys whose first choice it is or becomes."""

    def score(url: str) -> tuple[int, str]:
        digest = hashlib.blake2b(
            f"{key}\x00{url}".encode("utf-8", "surrogatepass"), digest_size=8
        ).digest()
        return -int.from_bytes(digest, "big"), url

    return sorted(urls, key=score)


class _HandleHere(Exception):
    """Raised by a hop's reroute when the next in the order is this process."""


class Peers:
    """This process's view of its peers: who owns a call, the hop to the owner, the peers
    that are down.

    Args:
        config: the peers and which one this is.
        proxy: the proxy's settings (the peer connection pool's size, the read timeout).
        registry: where the peer counters go (module docstring):
            ``contextpilot_proxy_peer_calls_total{outcome}`` (``owned``, ``forwarded``: a hop
            begun, ``from_peer``, ``fallback``: planned here as the owner was down,
            ``unreadable``, ``bad_mark``), and the hop's answers
            and failures as :class:`~.forwarding.ProxyCounters` counts them, under
            ``contextpilot_proxy_peer_``.
        clock: seconds, monotonic (for ``retry_down_s``).
    """

    def __init__(
        self,
        config: PeerConfig,
        proxy: ProxyConfig,
        registry: Any,
        *,
        pool_by_tenant: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._pool_by_tenant = pool_by_tenant
        self._alive_at: dict[str, float] = {}
        self._probes: dict[str, asyncio.Future[bool]] = {}  # on the event loop
        read = proxy.read_timeout_s
        self._upstreams = {
            url: Upstream(
                ProxyConfig(
                    url,
                    kind="openai-compatible",
                    pass_client_key=True,
                    connect_timeout_s=config.connect_timeout_s,
                    read_timeout_s=None if read is None else read + _HOP_READ_MARGIN_S,
                    max_connections=proxy.max_connections,
                    # The hop shares its pool between tenants as the upstream's does.
                    max_tenant_connections=proxy.max_tenant_connections,
                    pool_timeout_s=proxy.pool_timeout_s,
                )
            )
            for url in config.urls
            if url != config.own
        }
        self._mark = config.secret.encode("ascii")
        self._clock = clock
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self.counters = ProxyCounters(registry, prefix="contextpilot_proxy_peer")
        self.calls = Counter(
            "contextpilot_proxy_peer_calls",
            "Planned calls by where the peer rule put them.",
            ["outcome"],
            registry=registry,
        )
        name = f"peer-{sorted(config.urls).index(config.own)}"
        self.report: list[tuple[bytes, bytes]] = [
            (PLANNED_BY_HEADER.encode("ascii"), name.encode("ascii"))
        ]

    def marked(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """Whether the raw request ``headers`` carry the peers' mark (a wrong one is
        counted and ignored)."""
        given = [value for name, value in headers if name.lower() == _PEER_HEADER_BYTES]
        if not given:
            return False
        if len(given) == 1 and hmac.compare_digest(given[0], self._mark):
            return True
        self.calls.labels("bad_mark").inc()
        return False

    async def route(
        self,
        scope: Mapping[str, Any],
        raw: bytes,
        api: Api,
        tenant: str | None,
        session_header: str | None,
        here: Callable[[], Awaitable[Response | None]],
    ) -> Response | None:
        """The hop to the call's owner, or ``None`` where this process handles it (it owns
        the call, the call is marked by a peer, its key cannot be read).

        Args:
            scope: the client request's ASGI scope (method, raw path, query, headers).
            raw: the body as the client sent it.
            api: the client's API (the error shape).
            tenant: the tenant of the request's key.
            session_header: the conversation header as the routes read it.
            here: the answer of the call planned here (the fallback when no peer up owns it;
                ``None``: the client went meanwhile).
        """
        headers = scope["headers"]
        if self.marked(headers):
            self.calls.labels("from_peer").inc()
            return None
        if session_header is not None:
            key = owner_key(raw, api, tenant, session_header)
        else:
            key = await anyio.to_thread.run_sync(
                owner_key, raw, api, tenant, session_header, abandon_on_cancel=True
            )
        if key is None:
            self.calls.labels("unreadable").inc()
            return None
        order = rendezvous_order(key, self.config.urls)
        first = self._next_up(order, -1)
        while first != self.config.own and not await self._alive(first):
            first = self._next_up(order, order.index(first))
        if first == self.config.own:
            owner = order[0]
            self.calls.labels("owned" if owner == first else "fallback").inc()
            return None
        self.calls.labels("forwarded").inc()
        current = [first]

        def reroute() -> tuple[Upstream, Sequence[tuple[bytes, bytes]]]:
            self._down(current[0])
            found = self._next_up(order, order.index(current[0]))
            if found == self.config.own:
                raise _HandleHere
            current[0] = found
            return self._upstreams[found], ()

        raw_path = scope.get("raw_path")
        answer = ForwardedAnswer(
            self._upstreams[first],
            scope["method"],
            raw_path.decode("latin-1") if raw_path else scope["path"],
            scope.get("query_string", b""),
            self._hop_headers(self._upstreams[first], headers),
            raw,
            api=api,
            endpoint="peer_hop",
            counters=self.counters,
            reroute=reroute,
            pass_headers=_peer_answer_headers,
            pool_tenant=tenant if self._pool_by_tenant else None,
        )
        return _PeerHop(answer, here, self.calls)

    async def _alive(self, url: str) -> bool:
        """Whether the peer ``url`` answered ``GET /health`` within :data:`_ALIVE_TIMEOUT_S`
        (asked at most once per :data:`_ALIVE_FOR_S`; any status counts: it answers); one
        that did not is marked down. Calls that find the answer stale together share one
        probe (a caller that gives up leaves it to the others)."""
        if self._clock() - self._alive_at.get(url, -_ALIVE_FOR_S) < _ALIVE_FOR_S:
            return True
        probe = self._probes.get(url)
        if probe is None:
            probe = self._probes[url] = asyncio.ensure_future(self._probe(url))
            probe.add_done_callback(lambda done: self._probes.pop(url, None))
        return await asyncio.shield(probe)

    async def _probe(self, url: str) -> bool:
        """One ``GET /health`` of :meth:`_alive`."""
        try:
            with anyio.fail_after(_ALIVE_TIMEOUT_S):
                client = self._upstreams[url].client
                async with client.get(f"{url.rstrip('/')}/health") as answer:
                    await answer.read()
        except Exception:  # any failure to answer in time: refused, reset, timed out
            self._down(url)
            return False
        self._alive_at[url] = self._clock()
        return True

    def _next_up(self, order: Sequence[str], after: int) -> str:
        """The first peer of ``order`` past position ``after`` that is this process or not
        down; this process where none is."""
        now = self._clock()
        with self._lock:
            for url in order[after + 1 :]:
                if url == self.config.own or self._down_until.get(url, 0.0) <= now:
                    return url
        return self.config.own

    def _down(self, url: str) -> None:
        with self._lock:
            self._down_until[url] = self._clock() + self.config.retry_down_s
        logger.warning("peer %s cannot be reached: its calls are planned by the next peer for "
                       "%.0f s", url, self.config.retry_down_s)  # fmt: skip

    def _hop_headers(
        self, upstream: Upstream, given: Sequence[tuple[bytes, bytes]]
    ) -> list[tuple[str, str]]:
        """The client's headers as the owner gets them: as sent (credentials included), but
        for the hop-by-hop ones, and the mark in place of any the client gave. The values of
        the proxy's own headers are decoded as UTF-8 where they are, so the owner reads the
        bytes the client sent (a conversation header is read as UTF-8)."""
        out = upstream.request_headers(given)  # keeps the client's credentials
        for name, value in given:
            lowered = name.lower()
            if lowered.startswith(_OWN_PREFIX) and lowered != _PEER_HEADER_BYTES:
                try:
                    text = value.decode("utf-8")
                except UnicodeDecodeError:
                    text = value.decode("latin-1")
                out.append((lowered.decode("latin-1"), text))
        out.append((PEER_HEADER, self.config.secret))
        return out

    async def aclose(self) -> None:
        """Close the peer connection pools."""
        for upstream in self._upstreams.values():
            await upstream.aclose()


def _peer_answer_headers(given: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A peer's answer headers as the client gets them: as from an upstream, plus the peer's
    own report (its ``x-contextpilot-*`` headers: the owner's, which it made itself), but for
    its boot id (this process stamps its own)."""
    given = list(given)
    own = [
        (name.lower(), value)
        for name, value in given
        if name.lower().startswith(_OWN_PREFIX) and name.lower() != _BOOT_HEADER_BYTES
    ]
    return answer_headers(given) + own


class _PeerHop(Response):
    """The owner's answer passed back; the call planned here when no peer up owns it."""

    def __init__(
        self,
        answer: ForwardedAnswer,
        here: Callable[[], Awaitable[Response | None]],
        calls: Counter,
    ) -> None:
        super().__init__(status_code=200)
        self._answer = answer
        self._here = here
        self._calls = calls

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self._answer(scope, receive, send)
            return
        except Exception as exc:  # a task group's exception group holds the reroute's
            if not _only_handle_here(exc):
                raise
        self._calls.labels("fallback").inc()
        answer = await self._here()
        if answer is not None:  # None: the client went while the call was prepared
            await answer(scope, receive, send)


def _only_handle_here(exc: BaseException) -> bool:
    """Whether ``exc`` is :class:`_HandleHere`, or a group of nothing else."""
    inner = getattr(exc, "exceptions", None)
    if inner is None:
        return isinstance(exc, _HandleHere)
    return all(_only_handle_here(e) for e in inner)
