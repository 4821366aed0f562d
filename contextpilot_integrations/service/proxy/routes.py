"""The proxy's endpoints (docs/DESIGN.md, "The proxy").

=======  ==========================  ======================================================
POST     ``/v1/chat/completions``    OpenAI chat: messages planned, engine fields added,
                                     forwarded; the answer (JSON or SSE) streamed back
POST     ``/v1/messages``            Anthropic messages: the same
any      ``/v1/{path}``              every other path passed through unchanged
                                     (``/v1/models``, ``/v1/completions``,
                                     ``/v1/embeddings``, ...)
=======  ==========================  ======================================================

The service's own paths (``/v1/plan``, ``/v1/usage``, ...) are matched first and keep working;
a method they do not serve is a 405 here, never forwarded. A passed-through path goes upstream
as the client encoded it (``/v1/models/org%2Fname`` stays one segment); one with a ``.`` or
``..`` segment, plain or percent-encoded, is a 404 never forwarded: the upstream (or the URL's
normalisation) would resolve it to a path outside ``/v1/``, reached with the proxy's key.

The conversation header (:data:`~.conversation_key.SESSION_HEADER`) is read as UTF-8 where its
bytes are UTF-8 (HTTP carries header bytes; ASGI frameworks decode them as Latin-1), so the id
planned and reported is the text the client sent.

Tenants: on a service with keys, a request's tenant is the one its key belongs to: the
``x-contextpilot-api-key`` header, else ``Authorization: Bearer <key>``, else ``x-api-key``
(what the Anthropic SDK sends); a missing or unknown key, or keys of two tenants, is a 401 and
nothing is forwarded. The key is not forwarded; with ``pass_client_key`` the tenant key is read
from ``x-contextpilot-api-key`` alone, as the client's own ``Authorization`` and ``x-api-key``
go upstream (:mod:`.upstream`).

With a fleet (:mod:`.replica_routing`), each call goes to the replica its tenant's router
chooses (its base URL, or the gateway with the routing key header), ``x-contextpilot-replica``
names it, a replica that refuses the connection is routed around, and passed-through requests
go to the first replica up (or the gateway).

The two planned paths are served by :class:`PlannedRoutes`, plain ASGI beneath the service's
middleware and ahead of FastAPI's router (their FastAPI routes answer the same); the usage of
each answer is handed to one usage thread without waiting (docs/DESIGN.md, "The proxy").

Each answer carries what the proxy found and changed (:func:`.request_planning.
report_headers`); the usage read from it is recorded as ``POST /v1/usage`` records it, under
the call's rid, for the tenant (its totals in ``GET /v1/usage``, the usage counters of
``/metrics``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

import anyio
from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRouter
from starlette.datastructures import Headers

from contextpilot_integrations.core.messages import MessagePlan
from contextpilot_integrations.core.messages.message_shapes import Api
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.replicas.replica_planning import ReplicaChoice
from contextpilot_integrations.core.request import Scope
from contextpilot_integrations.llm_call.engine_fields import Usage
from contextpilot_integrations.service.errors import BodyTooLarge
from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.proxy.api_errors import ErrorApi, error_answer
from contextpilot_integrations.service.proxy.conversation_key import SESSION_HEADER
from contextpilot_integrations.service.proxy.forwarding import (
    CLIENT_GONE,
    ForwardedAnswer,
    ProxyCounters,
    Reroute,
)
from contextpilot_integrations.service.proxy.gateway_workers import upstream_probe
from contextpilot_integrations.service.proxy.peers import Peers
from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
from contextpilot_integrations.service.proxy.replica_health import ReplicaProbes
from contextpilot_integrations.service.proxy.replica_routing import REPLICA_HEADER, ReplicaRouting
from contextpilot_integrations.service.proxy.request_planning import (
    BadRequest,
    PreparedCall,
    ProxyPlanning,
    report_headers,
)
from contextpilot_integrations.service.proxy.task_cancel import TaskCancel, raise_failure
from contextpilot_integrations.service.proxy.upstream import TENANT_KEY_HEADER, Upstream

logger = logging.getLogger(__name__)

__all__ = ["PROXY_PATHS", "PlannedRoutes", "Proxy", "proxy_router"]

PROXY_PATHS = ("/v1/chat/completions", "/v1/messages")
"""The paths the proxy plans (metered under their own names)."""

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]

_PLANNED: dict[str, tuple[Api, str]] = {
    "/v1/chat/completions": ("openai", "chat_completions"),
    "/v1/messages": ("anthropic", "messages"),
}
"""The planned paths: the client's API (its error shape) and the metrics' endpoint label."""

ASGIScope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

BODY_READ_TIMEOUT_S = 60.0
"""Longest a request's body may take to arrive, from its headers on; a body trickled slower
(a slowloris) is a 408, so no client holds a connection and its coroutine for good."""


PREPARE_THREADS_PER_WINDOW_CALL = 2
"""Calls prepared at once in worker threads, per call a planning window may gather (the
service's ``window_max_batch``): a call waiting for its window holds one, so a full window
and the next one filling up both fit; a pool of the proxy's own, apart from anyio's 40 shared
threads."""


class Proxy:
    """What the proxy's endpoints of one app share.

    Args:
        config: the upstream and its credentials.
        service: the index service (tenants, usage, totals, metrics).
        service_paths: the service's own paths and the methods each serves (a request for
            one of them with another method is a 405, not forwarded).
    """

    def __init__(
        self,
        config: ProxyConfig,
        service: IndexService,
        service_paths: Mapping[str, frozenset[str]],
    ) -> None:
        self.config = config
        self.service = service
        self.routing: ReplicaRouting | None = None
        if config.fleet is not None:
            self.routing = ReplicaRouting(
                config,
                service.tenancy,
                service.metrics.registry,
                layout=service.config.layout,
                max_requests=service.config.max_requests,
                window_ms=service.config.window_ms,
                window_max_batch=service.config.window_max_batch,
            )
        # The replicas /health learns of only from their own /health (direct: the proxy
        # reaches them; the others have a KV-event link that reports them).
        self.replica_probes: ReplicaProbes | None = None
        if config.fleet is not None and config.fleet.direct:
            silent = {
                spec.name: spec.base_url
                for spec in config.fleet.router.replicas
                if spec.cache_sync is None and spec.base_url is not None
            }
            self.replica_probes = ReplicaProbes(silent) if silent else None
        # Behind a gateway, or a direct fleet's first replica (credentials, headers).
        first = config.fleet.router.replicas[0].base_url if config.fleet is not None else None
        self.upstream = Upstream(
            config if config.upstream_url is not None
            else dataclasses.replace(config, upstream_url=first, fleet=None)
        )  # fmt: skip
        routing = self.routing
        self.planning = ProxyPlanning(
            service.tenancy,
            config.upstream_kind,
            record=self._record_plan,
            pilot_of=routing.planner_of if routing is not None else service.planner_of,
            route=routing.route if routing is not None else None,
            undo=self.undo,
        )
        self.counters = ProxyCounters(service.metrics.registry)
        # One tenant (or none) has the whole pool; several share it (:mod:`.connection_gate`).
        self._pool_by_tenant = len(service.tenancy.tenants) > 1
        self.service_paths = dict(service_paths)
        self.peers: Peers | None = None
        if config.peers is not None:
            self.peers = Peers(
                config.peers,
                config,
                service.metrics.registry,
                pool_by_tenant=self._pool_by_tenant,
            )
        # One thread records every answer's usage in arrival order; the event loop hands a
        # record over without waiting for it (docs/DESIGN.md, "The proxy").
        self._usage_thread = _usage_thread()
        self._prepare_threads: ThreadPoolExecutor | None = None  # made on first use

    def prepare_threads(self) -> ThreadPoolExecutor:
        """The worker threads calls are prepared in (:data:`PREPARE_THREADS_PER_WINDOW_CALL`
        per call a window may gather)."""
        if self._prepare_threads is None:
            self._prepare_threads = ThreadPoolExecutor(
                PREPARE_THREADS_PER_WINDOW_CALL * self.service.config.window_max_batch,
                thread_name_prefix="contextpilot-prepare",
            )
        return self._prepare_threads

    def tenant_of(self, headers: Mapping[str, str]) -> str | None:
        """The tenant of the key in a request's ``headers`` (``None`` on a service without
        keys). With ``pass_client_key`` only ``x-contextpilot-api-key`` is read: the client's
        ``Authorization`` and ``x-api-key`` are its upstream credentials and go upstream, so a
        tenant key read from them would be forwarded.

        Raises:
            PermissionError: a missing or unknown key, or keys of two tenants.
        """
        tenancy = self.service.tenancy
        if not tenancy.keyed:
            return None
        key = headers.get(TENANT_KEY_HEADER)
        if self.upstream.config.pass_client_key:
            tenant = tenancy.tenant_of(key) if key else None
            if tenant is None:
                raise PermissionError(
                    f"missing or wrong API key ({TENANT_KEY_HEADER}: with the client's key "
                    "passed upstream, the tenant key goes only there)"
                )
            return tenant
        scheme, _, token = headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" and token.strip() else None
        keys = [k for k in (key, bearer, headers.get("x-api-key")) if k]
        tenant = tenancy.tenant_of(keys[0]) if keys else None
        if tenant is None:
            raise PermissionError(
                f"missing or wrong API key ({TENANT_KEY_HEADER}, Authorization: Bearer, or "
                "x-api-key)"
            )
        # Fail closed on a request that carries two tenants' keys: which one it means is
        # the client's to say, not the proxy's to pick.
        if any(tenancy.tenant_of(other) not in (None, tenant) for other in keys[1:]):
            raise PermissionError("keys of two tenants in one request")
        return tenant

    def _record_plan(
        self,
        tenant: str | None,
        rid: str,
        scope: Scope,
        plan: MessagePlan,
        documents: Plan | None,
    ) -> None:
        """The call's message plan into the tenant's totals; a call whose documents the
        pilot planned is one plan already (``ContextPilot.plan`` counts itself under the same
        rid), so only the message plan's figures are added to it."""
        pointers = plan.pointers
        # Behind a fleet the documents were planned by a replica's pilot, whose totals are
        # not the service's: their figures are added here.
        counted = documents is not None and self.routing is None
        if counted and not pointers and not plan.tokens_removed:
            return
        figures = documents.dedup_figures if documents is not None and not counted else None
        self.service.pilot_of(tenant).count_plan(
            rid,
            scope,
            plan.tokens_removed + (figures.tokens_saved if figures else 0),
            blocks_replaced=sum(1 for p in pointers if p.document is None)
            + (figures.blocks_replaced if figures else 0),
            sub_blocks_replaced=sum(1 for p in pointers if p.document is not None)
            + (figures.sub_blocks_replaced if figures else 0),
            plans=0 if counted else 1,
        )

    def usage_recorder(self, tenant: str | None, rid: str) -> Callable[[Usage], None]:
        """What records the usage of the call ``rid``: it returns at once (called on the
        event loop); the usage thread runs :meth:`record_usage`."""

        def hand_over(usage: Usage) -> None:
            self._usage_thread.submit(self._record_logged, tenant, rid, usage)

        return hand_over

    async def usage_settled(self) -> None:
        """Wait until the usage handed to the usage thread so far is recorded, so a
        ``GET /v1/usage`` after an answer counts that answer's usage (the thread records in
        the order it was handed work)."""
        try:
            done = self._usage_thread.submit(_nothing)
        except RuntimeError:  # shut down: the proxy is closing, nothing more is recorded
            return
        await asyncio.wrap_future(done)

    def _record_logged(self, tenant: str | None, rid: str, usage: Usage) -> None:
        try:
            self.record_usage(tenant, rid, usage)
        except Exception:
            logger.exception("recording the upstream's usage of %s failed", rid)

    def record_usage(self, tenant: str | None, rid: str, usage: Usage) -> None:
        """``usage`` of the call ``rid`` into the tenant's figures (blocking)."""
        self.service.record_usage(
            rid,
            usage.prompt_tokens,
            usage.cached_tokens,
            cache_write_tokens=usage.cache_write_tokens,
            caller=tenant,
        )
        if self.routing is not None:
            self.routing.record_usage(tenant, rid, usage)

    def forwarded(
        self,
        choice: ReplicaChoice | None,
        tenant: str | None,
        rid: str | None,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        ordered: bool = False,
        **options: Any,
    ) -> Response:
        """The answer of a request forwarded to ``choice``'s replica (the one upstream
        without a fleet): its routing key header added, ``x-contextpilot-replica`` reported,
        a replica that refuses the connection routed around, the in-flight load ended. An
        ``ordered`` call (one with documents) waits at the replica's door first
        (:class:`~.replica_order.ReplicaOrder`)."""
        routing = self.routing
        options["pool_tenant"] = tenant if self._pool_by_tenant else None
        if routing is None:
            return ForwardedAnswer(self.upstream, method, path, query, headers, body, **options)
        report = list(options.pop("report", ()))
        reroute: Reroute | None = None
        sent: list[tuple[str, str]] = []
        headers = routing.without_gateway_controls(headers)
        if choice is not None:
            sent = routing.request_headers(choice)
            headers = headers + sent
            report.append(_replica_header(choice))
            routing.sent(choice)
            tried: set[str] = set()
            current = [choice]

            def reroute() -> tuple[Upstream, list[tuple[bytes, bytes]]] | None:
                found = routing.reroute(tenant, rid, tried, current[0].replica)
                if found is None:
                    return None
                current[0] = found
                kept = [h for h in report if h[0] != REPLICA_HEADER.encode("ascii")]
                return routing.upstream_of(found, self.upstream), [*kept, _replica_header(found)]

        answer = ForwardedAnswer(
            routing.upstream_of(choice, self.upstream), method, path, query, headers, body,
            report=report, reroute=reroute, **options,
        )  # fmt: skip
        if rid is None:
            return answer
        if choice is not None and not routing.fleet.direct:
            answer.on_headers = functools.partial(self._answered, tenant, rid, choice, sent)
        if choice is not None:
            answer.on_refused = functools.partial(self._hand_refused, tenant, rid)
        over = None
        if ordered and choice is not None:
            order = routing.order
            answer.admit = functools.partial(order.enter, rid, choice.replica)
            answer.on_started = functools.partial(order.started, rid)
            over = functools.partial(order.finish, rid)
        return _Ended(answer, functools.partial(routing.ended, tenant, rid), over)

    def _answered(
        self,
        tenant: str | None,
        rid: str,
        choice: ReplicaChoice,
        sent: list[tuple[str, str]],
        headers: Mapping[str, str],
    ) -> None:
        """The gateway's answer to ``rid`` started (on the event loop): where it says the call
        went is handed to the usage thread (the router learns it there, in order with the
        call's usage)."""
        assert self.routing is not None
        landed = self.routing.answered(choice, sent, headers)
        if landed is not None:
            self._usage_thread.submit(self._landed_logged, tenant, rid, landed)

    def _hand_refused(self, tenant: str | None, rid: str) -> None:
        """The upstream refused ``rid`` (on the event loop): handed to the usage thread, in
        order with the calls' usage."""
        self._usage_thread.submit(self._refused_logged, tenant, rid)

    def _refused_logged(self, tenant: str | None, rid: str) -> None:
        """The upstream refused ``rid`` (usage thread): out of its replica's index and load."""
        assert self.routing is not None
        try:
            self.routing.refused(tenant, rid)
        except Exception:
            logger.exception("withdrawing the refused call %s failed", rid)

    def _landed_logged(self, tenant: str | None, rid: str, replica: str) -> None:
        assert self.routing is not None
        try:
            self.routing.landed(tenant, rid, replica)
        except Exception:
            logger.exception("following where the gateway sent %s failed", rid)

    async def calibrate_workers(self) -> None:
        """Learn the gateway's worker index of each replica (the fleet's ``target_workers``;
        :mod:`.gateway_workers`); returns at once without it. Runs on the event loop until
        the gateway decided, then recalibrates whenever targeting turns off (the service's
        lifespan starts it and cancels it)."""
        if self.routing is None or not self.routing.workers.enabled:
            return
        probe = upstream_probe(self.upstream)
        await self.routing.workers.calibrate(probe)
        await self.routing.workers.recalibrate(probe)

    async def learn_kv_capacity(self) -> None:
        """Learn the KV capacity of each replica that leaves it to its engine
        (:meth:`.replica_routing.ReplicaRouting.learn_kv_capacity`); returns at once without
        a fleet. Runs on the event loop (the service's lifespan starts it and cancels it)."""
        if self.routing is not None and self.routing.fleet.learn_kv_capacity:
            await self.routing.learn_kv_capacity()

    def abandoned(self, tenant: str | None, call: PreparedCall) -> None:
        """``call`` was prepared for a client that left before it was forwarded (while it
        waited in a planning window, say): its documents' plan is undone (the rid evicted
        from the index that planned it, so no later call counts on a prefix never sent) and
        its in-flight load ended. Blocking."""
        if call.documents is not None:
            self.undo(tenant, call.rid)
        elif self.routing is not None and call.replica is not None:
            self.routing.ended(tenant, call.rid)

    def undo(self, tenant: str | None, rid: str) -> None:
        """The documents' plan of the call ``rid``, which is never sent, undone: the rid
        evicted from the index that planned it, its ticket at the replica's door and its
        in-flight load ended (each a no-op where there is none). Blocking."""
        routing = self.routing
        owner = routing.router_of(tenant) if routing is not None else None
        (owner or self.service.pilot_of(tenant)).evict(rid)
        if routing is not None:
            routing.order.finish(rid)
            routing.ended(tenant, rid)

    def start(self) -> None:
        """Start the replicas' engine links (with a fleet)."""
        if self.routing is not None:
            self.routing.start()

    async def aclose(self) -> None:
        """Close the upstreams' pools, record the usage handed over, and stop the replicas'
        engine links."""
        await self.upstream.aclose()
        if self.peers is not None:
            await self.peers.aclose()
        if self.replica_probes is not None:
            await self.replica_probes.aclose()
        preparing, self._prepare_threads = self._prepare_threads, None
        if preparing is not None:  # a call still waiting for its window is not waited for
            preparing.shutdown(wait=False)
        used, self._usage_thread = self._usage_thread, _usage_thread()
        await anyio.to_thread.run_sync(used.shutdown)
        if self.routing is not None:
            await self.routing.aclose()
            await anyio.to_thread.run_sync(self.routing.stop)


class _Preparing:
    """A call being prepared in a worker thread whose client may leave meanwhile: the thread
    runs on (it cannot be stopped), and a call prepared for nobody is handed to ``on_abandoned``
    in that thread."""

    def __init__(
        self, prepare: Callable[[], PreparedCall], on_abandoned: Callable[[PreparedCall], None]
    ) -> None:
        self._prepare = prepare
        self._on_abandoned = on_abandoned
        self._lock = threading.Lock()
        self._call: PreparedCall | None = None
        self._gone = False

    def run(self) -> PreparedCall:
        call = self._prepare()
        with self._lock:
            self._call = call
            gone = self._gone
        if gone:
            self._on_abandoned(call)
        return call

    def give_up(self) -> None:
        """The client left (on the event loop): a call already prepared is undone in a thread
        of its own, one still being prepared when it is."""
        with self._lock:
            self._gone = True
            call = self._call
        if call is not None:
            threading.Thread(target=self._on_abandoned, args=(call,), daemon=True).start()


class _Ended(Response):
    """A forwarded answer, then ``over`` (on the event loop; it returns at once) and
    ``on_end`` (in a worker thread) however it ended."""

    def __init__(
        self,
        answer: Response,
        on_end: Callable[[], None],
        over: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(status_code=200)
        self._answer = answer
        self._on_end = on_end
        self._over = over

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self._answer(scope, receive, send)
        finally:
            if self._over is not None:
                self._over()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._on_end)


def _nothing() -> None:
    """A no-op for a thread to run (a marker in its queue)."""


def _usage_thread() -> ThreadPoolExecutor:
    """The proxy's usage thread (started on its first record)."""
    return ThreadPoolExecutor(1, thread_name_prefix="contextpilot-usage")


def _replica_header(choice: ReplicaChoice) -> tuple[bytes, bytes]:
    return (REPLICA_HEADER.encode("ascii"), choice.replica.encode("ascii"))


def _proxy(request: Request) -> Proxy:
    proxy: Proxy = request.app.state.proxy
    return proxy


class PlannedRoutes:
    """The planned paths (``POST /v1/chat/completions`` and ``/v1/messages``) served as plain
    ASGI beneath the app's middleware, ahead of its router: the hot path skips the
    framework's route matching, dependency layer and request objects (docs/DESIGN.md, "The
    proxy"). Every other request goes to ``app``, which serves these paths too, with the same
    answers, for a stack without this layer.

    Args:
        app: the ASGI app to wrap (the service's router stack).
        proxy: the proxy.
    """

    def __init__(self, app: Any, *, proxy: Proxy) -> None:
        self.app = app
        self.proxy = proxy

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            planned = _PLANNED.get(_route_path(scope))
            if planned is not None:
                answer = await _planned(self.proxy, scope, receive, *planned)
                if answer is not None:
                    await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _route_path(scope: ASGIScope) -> str:
    """The path the app's router matches: the scope's, less the ``root_path`` it starts
    with (as Starlette's router reads it)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        return path[len(root) :]
    return path


async def chat_completions(request: Request) -> Response:
    """OpenAI's chat completions, planned and forwarded."""
    return await _planned_answer(request, "openai", "chat_completions")


async def messages(request: Request) -> Response:
    """Anthropic's messages, planned and forwarded."""
    return await _planned_answer(request, "anthropic", "messages")


async def _planned_answer(request: Request, api: Api, endpoint: str) -> Response:
    answer = await _planned(_proxy(request), request.scope, request.receive, api, endpoint)
    return answer if answer is not None else Response(status_code=CLIENT_GONE)


async def pass_through(request: Request, path: str) -> Response:
    """Any other ``/v1/`` request, forwarded unchanged (but for the credentials)."""
    proxy = _proxy(request)
    decoded = request.url.path
    if any(segment in (".", "..") for segment in decoded.split("/")):
        return error_answer(
            "openai", 404, f"path {decoded!r:.200} has a '.' or '..' segment; not forwarded",
            "path",
        )  # fmt: skip
    served = proxy.service_paths.get(decoded)
    if served is not None:  # a service path asked with a method it does not serve
        allow = ", ".join(sorted(served))
        return error_answer(
            "openai", 405, f"{request.method} is not served on {request.url.path}", None,
            {"Allow": allow},
        )  # fmt: skip
    admitted = await _admit(proxy, request.headers, request.receive, "openai", "pass_through")
    if isinstance(admitted, Response):
        return admitted
    if admitted is None:
        return Response(status_code=CLIENT_GONE)
    tenant, body = admitted
    headers = proxy.upstream.request_headers(request.scope["headers"])
    raw_path = request.scope.get("raw_path")
    choice = None
    if proxy.routing is not None:
        choice = await anyio.to_thread.run_sync(proxy.routing.pass_through_choice)
    return proxy.forwarded(
        choice,
        tenant,
        None,
        request.method,
        raw_path.decode("latin-1") if raw_path else quote(decoded),
        request.scope.get("query_string", b""),
        headers,
        body,
        api="openai",
        endpoint="pass_through",
        counters=proxy.counters,
    )


async def _planned(
    proxy: Proxy, scope: ASGIScope, receive: Receive, api: Api, endpoint: str
) -> Response | None:
    """The answer of a planned call (``None``: the client went before its body was read); with
    peers, passed to its owner first (docs/DESIGN.md, "Proxy peers")."""
    request_headers = Headers(scope=scope)
    encoding = request_headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":  # the planner reads the body's JSON as sent
        proxy.counters.requests.labels(endpoint, "415").inc()
        return error_answer(
            api, 415, f"content-encoding {encoding!r:.40} is not read here; send the body "
            "uncompressed", "content-encoding",
        )  # fmt: skip
    admitted = await _admit(proxy, request_headers, receive, api, endpoint)
    if admitted is None or isinstance(admitted, Response):
        return admitted
    tenant, raw = admitted
    session = _session_header(request_headers)
    here = functools.partial(
        _planned_here, proxy, scope, receive, api, endpoint, tenant, raw, session
    )
    if proxy.peers is not None:
        hop = await proxy.peers.route(scope, raw, api, tenant, session, here)
        if hop is not None:
            return hop
    return await here()


async def _planned_here(
    proxy: Proxy,
    scope: ASGIScope,
    receive: Receive,
    api: Api,
    endpoint: str,
    tenant: str | None,
    raw: bytes,
    session: str | None,
) -> Response | None:
    """The call planned in this process and forwarded (``None``: the client went while it
    was prepared; the call is undone, :meth:`Proxy.abandoned`, and never forwarded)."""
    prepare = _Preparing(
        functools.partial(proxy.planning.prepare, raw, api, tenant, session),
        functools.partial(proxy.abandoned, tenant),
    )
    call: PreparedCall | None = None
    gone = False
    loop = asyncio.get_running_loop()
    # Abandoned, not stopped, when cancelled: a thread cannot be (:class:`_Preparing`).
    prepared = loop.run_in_executor(proxy.prepare_threads(), prepare.run)

    async def until_disconnect() -> None:
        # A server does not cancel a call whose client hangs up: the call is watched, so
        # one that leaves while it waits (in a planning window) is undone.
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        prepared.cancel()

    watcher = loop.create_task(until_disconnect())
    try:
        call = await prepared
    except asyncio.CancelledError:
        prepare.give_up()
        if not gone:
            raise
    except BadRequest as exc:
        proxy.counters.requests.labels(endpoint, str(exc.status)).inc()
        return error_answer(api, exc.status, exc.message, exc.field)
    finally:
        watcher.cancel()
    raise_failure(watcher)
    if gone or call is None:
        if call is not None:  # prepared just as the client left
            prepare.give_up()
        proxy.counters.requests.labels(endpoint, str(CLIENT_GONE)).inc()
        return None
    headers = proxy.upstream.request_headers(scope["headers"], identity=True)
    headers = [(k, v) for k, v in headers if k != "content-type"]
    headers.append(("content-type", "application/json"))
    return proxy.forwarded(
        call.replica,
        tenant,
        call.rid,
        "POST",
        scope["path"],
        scope.get("query_string", b""),
        headers,
        call.body,
        api=api,
        endpoint=endpoint,
        counters=proxy.counters,
        report=report_headers(call) + (proxy.peers.report if proxy.peers is not None else []),
        on_usage=proxy.usage_recorder(tenant, call.rid),
        ordered=call.documents is not None,
    )


def _session_header(headers: Mapping[str, str]) -> str | None:
    """The conversation header as text: its bytes as UTF-8 where they are (module docstring),
    else as the Latin-1 text the framework read."""
    value = headers.get(SESSION_HEADER)
    if value is None or value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


async def _admit(
    proxy: Proxy, headers: Mapping[str, str], receive: Receive, api: ErrorApi, endpoint: str
) -> tuple[str | None, bytes] | Response | None:
    """The request's tenant and body, the error answer that refuses it (401, 413), or
    ``None``: the client went before its body was read."""
    try:
        tenant = proxy.tenant_of(headers)
    except PermissionError as exc:
        proxy.counters.requests.labels(endpoint, "401").inc()
        return error_answer(api, 401, str(exc), None, {"WWW-Authenticate": "Bearer"})
    chunks: list[bytes] = []
    late = TaskCancel()
    deadline = asyncio.get_running_loop().call_later(BODY_READ_TIMEOUT_S, late.cancel)
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                proxy.counters.requests.labels(endpoint, str(CLIENT_GONE)).inc()
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
    except BodyTooLarge as exc:
        proxy.counters.requests.labels(endpoint, "413").inc()
        return error_answer(api, 413, str(exc), "body")
    except asyncio.CancelledError:
        if not late.caught():
            raise
        proxy.counters.requests.labels(endpoint, "408").inc()
        return error_answer(
            api, 408, f"the body did not arrive within {BODY_READ_TIMEOUT_S:.0f} s", "body"
        )
    finally:
        deadline.cancel()
    return tenant, b"".join(chunks)


def proxy_router() -> APIRouter:
    """The proxy's routes; include it after the service's own, which then match first."""
    router = APIRouter()
    router.add_api_route(
        "/v1/chat/completions",
        chat_completions,
        methods=["POST"],
        summary="OpenAI chat completions, planned and forwarded to the upstream",
    )
    router.add_api_route(
        "/v1/messages",
        messages,
        methods=["POST"],
        summary="Anthropic messages, planned and forwarded to the upstream",
    )
    router.add_api_route(
        "/v1/{path:path}",
        pass_through,
        methods=_METHODS,
        summary="Any other /v1/ request, passed through to the upstream",
        include_in_schema=False,
    )
    return router
