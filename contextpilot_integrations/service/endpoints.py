"""The endpoints of the index service's HTTP API, and how their calls run.

Each endpoint is a small coroutine that reads its app's :class:`ServiceCalls`
(``request.app.state.calls``), so one process can serve several apps (no module-level state).
:func:`api_router` lays them out (paths, response models, the API-key dependency).

Tenants: with keys configured, :func:`caller_tenant` maps the request's
``Authorization: Bearer <key>`` to its tenant (401 for a missing or unknown key), and every
call runs as that tenant (:class:`~.index_service.IndexService`'s ``caller``); a body that
names another tenant gets a 403.

Concurrency: nothing that takes a lock of the index, the conversation store or the engine link
runs on the event loop. Plans are parsed, planned and encoded in worker threads; batches wait
for one of ``max_batch_threads``; evictions, usage reports, forgets, statistics, metrics and
saves for one of ``max_call_threads`` (so a call stuck in the engine link, e.g. a hung mirror
walk, holds one thread, not the server: ``/health`` and plans go on). A request cancelled
meanwhile (a client gone, a shutdown) abandons its thread instead of waiting for it. A plan
takes its in-flight ticket as it arrives (:mod:`.in_flight`), so a forget of its conversation
sent after it (a client that gave up on it) waits for its turn to be recorded. The plan
bodies are read raw and validated where the work runs: a large body's JSON parse and
validation would otherwise hold the event loop as long as the build itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute, APIRouter
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from contextpilot_integrations import __version__
from contextpilot_integrations.client.schemas import (
    BatchPlanResponse,
    ErrorResponse,
    EvictRequest,
    EvictResponse,
    ForgetConversationRequest,
    ForgetConversationResponse,
    HealthResponse,
    LayoutModel,
    PlanBatchRequest,
    PlanRequestModel,
    PlanResponse,
    SnapshotResponse,
    UsageReport,
    UsageResponse,
    UsageTotalsResponse,
)
from contextpilot_integrations.service.errors import (
    JSON,
    InvalidInput,
    ServiceClosing,
    json_response,
    validate_json,
)
from contextpilot_integrations.service.index_service import IndexService, ServiceClosingError

__all__ = ["API_PREFIX", "ServiceCalls", "add_body_schemas", "api_router", "caller_tenant"]

T = TypeVar("T")

API_PREFIX = "/v1"
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "The body cannot be read as JSON."},
    401: {"model": ErrorResponse, "description": "Missing or unknown API key."},
    403: {
        "model": ErrorResponse,
        "description": "The body names another tenant than the API key's.",
    },
    409: {"model": ErrorResponse, "description": "The rid is already indexed or being planned."},
    413: {"model": ErrorResponse, "description": "Request body too large."},
    422: {"model": ErrorResponse, "description": "Invalid input (the message names it)."},
    503: {"model": ErrorResponse, "description": "The service is stopping."},
}
# A stateless scheme description (what the OpenAPI document shows); the keys are per app.
_BEARER = HTTPBearer(auto_error=False, description="The API key of the caller's tenant.")
_RAW_BODIES: tuple[type[BaseModel], ...] = (PlanRequestModel, PlanBatchRequest)


class ServiceCalls:
    """What the endpoints of one app share: its service and how calls run.

    Args:
        service: the service the app serves.
    """

    def __init__(self, service: IndexService) -> None:
        self.service = service
        settings = service.config
        self._sizes = {"batch": settings.max_batch_threads, "call": settings.max_call_threads}
        self._limiters: dict[str, anyio.CapacityLimiter] = {}  # made inside the event loop

    def limiter(self, kind: str) -> anyio.CapacityLimiter | None:
        """The worker-thread limiter of ``kind`` (``plan``: anyio's default)."""
        if kind == "plan":
            return None
        if kind not in self._limiters:
            self._limiters[kind] = anyio.CapacityLimiter(self._sizes[kind])
        return self._limiters[kind]

    async def run(self, call: Callable[[], T], kind: str) -> T:
        """``call()`` in a worker thread of ``kind`` (``plan``, ``batch``, ``call``); its
        ``TypeError`` / ``ValueError`` (bad input, named by the core) becomes
        :class:`InvalidInput` (422; 409 for a rid conflict, 403 for another tenant), a
        stopping service a 503, anything else a 500."""
        try:
            return await anyio.to_thread.run_sync(
                call, abandon_on_cancel=True, limiter=self.limiter(kind)
            )
        except (TypeError, ValueError) as exc:
            raise InvalidInput(exc) from exc
        except ServiceClosingError as exc:
            raise ServiceClosing(str(exc)) from exc


def _calls(request: Request) -> ServiceCalls:
    calls: ServiceCalls = request.app.state.calls
    return calls


async def caller_tenant(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
) -> str | None:
    """The tenant of the request's ``Authorization: Bearer <key>`` (401 for a missing or
    unknown key); None on a service without keys."""
    tenancy = _calls(request).service.tenancy
    if not tenancy.keyed:
        return None
    tenant = tenancy.tenant_of(credentials.credentials) if credentials is not None else None
    if tenant is None:
        raise StarletteHTTPException(401, "missing or wrong API key (Authorization: Bearer)")
    return tenant


Caller = Annotated["str | None", Depends(caller_tenant)]


# --------------------------------------------------------------------------------------------
# Endpoints
# --------------------------------------------------------------------------------------------


async def plan(request: Request, caller: Caller) -> Response:
    """``PlanRequest`` -> ``PlanResponse`` (``ContextPilot.plan``)."""
    calls = _calls(request)
    in_flight = calls.service.in_flight
    ticket = in_flight.arrive()  # before the body is read: a forget sent after waits for it
    try:
        raw = await request.body()

        def parse_plan_encode() -> Response:
            core = validate_json(PlanRequestModel, raw).to_core()
            plan = calls.service.plan(core, caller=caller, ticket=ticket)
            return json_response(PlanResponse.encode(plan))

        return await calls.run(parse_plan_encode, "plan")
    finally:
        in_flight.done_reading(ticket)


async def plan_batch(request: Request, caller: Caller) -> Response:
    """``{"requests": [PlanRequest, ...]}`` -> ``BatchPlanResponse``
    (``ContextPilot.plan_batch``)."""
    calls = _calls(request)
    in_flight = calls.service.in_flight
    ticket = in_flight.arrive()
    try:
        raw = await request.body()

        def parse_plan_encode() -> Response:
            batch = validate_json(PlanBatchRequest, raw).to_core()
            plans = calls.service.plan_batch(batch, caller=caller, ticket=ticket)
            return json_response(BatchPlanResponse.encode(plans))

        return await calls.run(parse_plan_encode, "batch")
    finally:
        in_flight.done_reading(ticket)


async def evict(body: EvictRequest, request: Request, caller: Caller) -> Response:
    """Drop one of the caller's rids from the index."""
    calls = _calls(request)
    call = functools.partial(calls.service.evict, body.rid, caller=caller)
    return json_response({"evicted": await calls.run(call, "call")})


async def forget_conversation(
    body: ForgetConversationRequest, request: Request, caller: Caller
) -> Response:
    """Drop one of the caller's conversations' de-duplication records."""
    calls = _calls(request)
    call = functools.partial(
        calls.service.forget_conversation, body.tenant, body.conversation_id, caller=caller
    )
    return json_response({"forgotten": await calls.run(call, "call")})


async def usage(body: UsageReport, request: Request, caller: Caller) -> Response:
    """Record the engine's ``usage`` of one of the caller's planned requests."""
    calls = _calls(request)
    call = functools.partial(
        calls.service.record_usage,
        body.rid,
        body.prompt_tokens,
        body.cached_tokens,
        cache_write_tokens=body.cache_write_tokens,
        caller=caller,
    )
    return json_response({"indexed": await calls.run(call, "call")})


async def usage_totals(request: Request, caller: Caller) -> Response:
    """``IndexService.usage()``: the caller tenant's running totals, its own conversations
    only; with the proxy, after the usage of the answers it has given is recorded."""
    calls = _calls(request)
    proxy = request.app.state.proxy
    if proxy is not None:
        await proxy.usage_settled()
    return json_response(
        await calls.run(functools.partial(calls.service.usage, caller=caller), "call")
    )


async def snapshot(request: Request, caller: Caller) -> Response:
    """Save a checkpoint of the snapshot now (every tenant's state; calls that arrive during a
    save share the next one)."""
    calls = _calls(request)
    return json_response({"saved": await calls.run(calls.service.save_snapshot, "call")})


async def layout(request: Request, caller: Caller) -> LayoutModel:
    """The prompt layout plans are rendered with."""
    return LayoutModel.from_core(_calls(request).service.layout)


async def stats(request: Request, caller: Caller) -> Response:
    """``IndexService.stats()`` of the caller's tenant; a proxy with replicas adds ``proxy``:
    the caller's replica router and its planning window (``ReplicaRouting.tenant_stats``)."""
    calls = _calls(request)
    out = await calls.run(functools.partial(calls.service.stats, caller=caller), "call")
    proxy = request.app.state.proxy
    if proxy is not None and proxy.routing is not None:
        out["proxy"] = await calls.run(
            functools.partial(proxy.routing.tenant_stats, caller), "call"
        )
    return json_response(out)


async def metrics(request: Request, caller: Caller) -> Response:
    """Prometheus text exposition (service-wide counts)."""
    calls = _calls(request)
    body, content_type = await calls.run(calls.service.metrics.exposition, "call")
    return Response(content=body, media_type=content_type)


async def health(request: Request) -> Response:
    """Liveness and the engine link (never authenticated; takes no lock that an event could
    hold). A proxy whose every replica is down answers 503 ``replicas_down``, so a load
    balancer takes it out of rotation; a replica without KV events is asked its own
    ``/health`` in the background (:mod:`.proxy.replica_health`; docs/DESIGN.md, "The
    proxy")."""
    service = _calls(request).service
    proxy = request.app.state.proxy
    routing = proxy.routing if proxy is not None else None
    replicas = replicas_up = None
    if routing is not None:
        replicas = len(routing.fleet.router.replicas)
        up = routing.replicas_up()
        probes = proxy.replica_probes
        if probes is not None:  # the replicas without KV events: their own /health
            probes.refresh()
            silent = probes.down()
            up = [name for name in up if name not in silent]
        replicas_up = len(up)
    down = replicas_up == 0
    health = HealthResponse(
        status="replicas_down" if down else "ok",
        version=__version__,
        boot_id=service.boot_id,
        cache_model=service.cache_model,
        engine_connected=service.engine_connected,
        resync_pending=service.resync_pending,
        replicas=replicas,
        replicas_up=replicas_up,
    )
    return json_response(health.model_dump(), status_code=503 if down else 200)


async def openapi_document(request: Request, caller: Caller) -> Response:
    """The OpenAPI document (with keys configured, it needs one like the API)."""
    return json_response(request.app.openapi())


# --------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------


class _PathRoute(APIRoute):
    """An API route whose 405 answer lists in ``Allow`` every method its path serves: the
    router answers a method no route of a path serves from that path's first route, and
    ``/v1/usage`` has two (``POST`` reports usage, ``GET`` reads the totals)."""

    path_methods: frozenset[str] = frozenset()

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.path_methods and scope["method"] not in (self.methods or ()):
            allow = ", ".join(sorted(self.path_methods))
            raise StarletteHTTPException(405, headers={"Allow": allow})
        await super().handle(scope, receive, send)


def api_router(*, keyed: bool) -> APIRouter:
    """Every endpoint; ``keyed``: the service has API keys, so ``/openapi.json`` is served
    here behind a key (FastAPI's own is off then)."""
    router = APIRouter(route_class=_PathRoute)
    post = functools.partial(router.add_api_route, methods=["POST"], responses=ERRORS)
    get = functools.partial(router.add_api_route, methods=["GET"], responses=ERRORS)
    post(
        f"{API_PREFIX}/plan",
        plan,
        response_model=PlanResponse,
        summary="Plan one request",
        openapi_extra=_json_body(PlanRequestModel),
    )
    post(
        f"{API_PREFIX}/plan_batch",
        plan_batch,
        response_model=BatchPlanResponse,
        summary="Plan and schedule a batch",
        openapi_extra=_json_body(PlanBatchRequest),
    )
    post(
        f"{API_PREFIX}/evict",
        evict,
        response_model=EvictResponse,
        summary="Drop a request from the index",
    )
    post(
        f"{API_PREFIX}/conversations/forget",
        forget_conversation,
        response_model=ForgetConversationResponse,
        summary="Forget a conversation's de-duplication records",
    )
    post(
        f"{API_PREFIX}/usage",
        usage,
        response_model=UsageResponse,
        summary="Report the engine's token usage for a planned request",
    )
    get(
        f"{API_PREFIX}/usage",
        usage_totals,
        response_model=UsageTotalsResponse,
        summary="The caller tenant's tokens removed and engine cached tokens, per conversation",
    )
    post(
        f"{API_PREFIX}/snapshot",
        snapshot,
        response_model=SnapshotResponse,
        summary="Save a checkpoint of the snapshot now",
    )
    get(
        f"{API_PREFIX}/layout",
        layout,
        response_model=LayoutModel,
        summary="The prompt layout plans are rendered with",
    )
    get(f"{API_PREFIX}/stats", stats, summary="Index, conversation, sync and usage statistics")
    get(
        "/metrics",
        metrics,
        summary="Prometheus metrics (text exposition format)",
        responses={
            **ERRORS,
            200: {
                "description": "Prometheus text exposition format.",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
        },
    )
    router.add_api_route(  # open: a load balancer probes it without the key
        "/health",
        health,
        methods=["GET"],
        response_model=HealthResponse,
        summary="Liveness and engine link",
        responses={503: {"model": HealthResponse, "description": "Every replica is down."}},
    )
    if keyed:
        router.add_api_route(
            "/openapi.json", openapi_document, methods=["GET"], include_in_schema=False
        )
    served: dict[str, set[str]] = {}
    for route in router.routes:
        if isinstance(route, _PathRoute):
            served.setdefault(route.path, set()).update(route.methods or ())
    for route in router.routes:
        if isinstance(route, _PathRoute):
            route.path_methods = frozenset(served[route.path])
    return router


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of an endpoint that validates ``model`` itself."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {JSON: {"schema": schema}}}}


def add_body_schemas(app: FastAPI, models: Sequence[type[BaseModel]] = _RAW_BODIES) -> None:
    """Put the models of :func:`_json_body` bodies into ``app``'s OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
