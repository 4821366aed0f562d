"""The endpoints of the index service's HTTP API, and how their calls run.

Each endpoint is a small coroutine that reads its app's :class:`ServiceCalls`
(``request.app.state.calls``), so one process can serve several apps (no module-level state).
:func:`api_router` lays them out (paths, response models, the API-key dependency).

Concurrency: a single plan whose body is at most ``ServiceConfig.inline_plan_bytes`` bytes is
parsed, planned and encoded on the event loop (a thread hop would cost more than the plan);
larger plans and every batch are parsed, built and encoded in worker threads
(``anyio.to_thread``; batches at most ``max_batch_threads`` at once), so a long batch does not
hold up other requests (``tests/service/test_concurrency.py``). The plan bodies are read raw
and validated where the work runs: a large body's JSON parse and validation would otherwise
hold the event loop as long as the build itself.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRouter
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from contextpilot_integrations import __version__
from contextpilot_integrations.service.errors import (
    JSON,
    InvalidInput,
    json_response,
    validate_json,
)
from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.schemas import (
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
)

__all__ = ["API_PREFIX", "ServiceCalls", "add_body_schemas", "api_router"]

T = TypeVar("T")

API_PREFIX = "/v1"
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "The body cannot be read as JSON."},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key."},
    409: {"model": ErrorResponse, "description": "The rid is already indexed or being planned."},
    413: {"model": ErrorResponse, "description": "Request body too large."},
    422: {"model": ErrorResponse, "description": "Invalid input (the message names it)."},
}
# A stateless scheme description (what the OpenAPI document shows); the key is per app.
_BEARER = HTTPBearer(auto_error=False, description="The service's shared API key.")
_RAW_BODIES: tuple[type[BaseModel], ...] = (PlanRequestModel, PlanBatchRequest)


class ServiceCalls:
    """What the endpoints of one app share: its service, its API key, and how calls run.

    Args:
        service: the service the app serves.
    """

    def __init__(self, service: IndexService) -> None:
        self.service = service
        settings = service.config
        self.api_key = settings.api_key.encode("utf-8") if settings.api_key else None
        self.inline_plan_bytes = settings.inline_plan_bytes
        self._max_batch_threads = settings.max_batch_threads
        self._batch_limiter: anyio.CapacityLimiter | None = None  # made inside the loop

    async def in_thread(self, call: Callable[[], T], *, batch: bool = False) -> T:
        """``call()`` in a worker thread (a batch waits for one of ``max_batch_threads``)."""
        limiter = None
        if batch:
            if self._batch_limiter is None:
                self._batch_limiter = anyio.CapacityLimiter(self._max_batch_threads)
            limiter = self._batch_limiter
        return await anyio.to_thread.run_sync(call, limiter=limiter)

    async def run(self, call: Callable[[], T], *, inline: bool, batch: bool = False) -> T:
        """Run a service call; its ``TypeError`` / ``ValueError`` (bad input, named by the
        core) becomes :class:`InvalidInput` (422; 409 for a rid conflict), anything else a
        500."""
        try:
            return call() if inline else await self.in_thread(call, batch=batch)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(exc) from exc


def _calls(request: Request) -> ServiceCalls:
    calls: ServiceCalls = request.app.state.calls
    return calls


async def require_key(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
) -> None:
    """401 unless the request carries ``Authorization: Bearer <the app's key>``."""
    expected = _calls(request).api_key
    assert expected is not None  # only installed when a key is set
    given = credentials.credentials.encode("utf-8") if credentials is not None else b""
    if not hmac.compare_digest(given, expected):
        raise StarletteHTTPException(401, "missing or wrong API key (Authorization: Bearer)")


# --------------------------------------------------------------------------------------------
# Endpoints
# --------------------------------------------------------------------------------------------


async def plan(request: Request) -> Response:
    """``PlanRequest`` -> ``PlanResponse`` (``ContextPilot.plan``)."""
    calls = _calls(request)
    raw = await request.body()

    def parse_plan_encode() -> Response:
        planned = calls.service.plan(validate_json(PlanRequestModel, raw).to_core())
        return json_response(PlanResponse.encode(planned))

    return await calls.run(parse_plan_encode, inline=len(raw) <= calls.inline_plan_bytes)


async def plan_batch(request: Request) -> Response:
    """``{"requests": [PlanRequest, ...]}`` -> ``BatchPlanResponse``
    (``ContextPilot.plan_batch``)."""
    calls = _calls(request)
    raw = await request.body()

    def parse_plan_encode() -> Response:
        batch = calls.service.plan_batch(validate_json(PlanBatchRequest, raw).to_core())
        return json_response(BatchPlanResponse.encode(batch))

    return await calls.run(parse_plan_encode, inline=False, batch=True)


async def evict(body: EvictRequest, request: Request) -> Response:
    """Drop one rid from the index."""
    calls = _calls(request)
    evicted = await calls.run(functools.partial(calls.service.evict, body.rid), inline=True)
    return json_response({"evicted": evicted})


async def forget_conversation(body: ForgetConversationRequest, request: Request) -> Response:
    """Drop a conversation's de-duplication records."""
    calls = _calls(request)
    call = functools.partial(calls.service.forget_conversation, body.tenant, body.conversation_id)
    return json_response({"forgotten": await calls.run(call, inline=True)})


async def usage(body: UsageReport, request: Request) -> Response:
    """Record the engine's ``usage`` of a planned request."""
    calls = _calls(request)
    call = functools.partial(
        calls.service.record_usage, body.rid, body.prompt_tokens, body.cached_tokens
    )
    return json_response({"indexed": await calls.run(call, inline=True)})


async def snapshot(request: Request) -> Response:
    """Save the snapshot now."""
    calls = _calls(request)
    return json_response({"saved": await calls.in_thread(calls.service.save_snapshot)})


async def layout(request: Request) -> LayoutModel:
    """The prompt layout plans are rendered with."""
    return LayoutModel.from_core(_calls(request).service.layout)


async def stats(request: Request) -> Response:
    """``IndexService.stats()``."""
    calls = _calls(request)
    return json_response(await calls.in_thread(calls.service.stats))


async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    calls = _calls(request)
    body, content_type = await calls.in_thread(calls.service.metrics.exposition)
    return Response(content=body, media_type=content_type)


async def health(request: Request) -> HealthResponse:
    """Liveness and the engine link (never authenticated)."""
    service = _calls(request).service
    return HealthResponse(
        status="ok",
        version=__version__,
        cache_model=service.cache_model,
        engine_connected=service.engine_connected,
        resync_pending=service.resync_pending,
    )


# --------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------


def api_router(*, authenticated: bool) -> APIRouter:
    """Every endpoint; ``authenticated``: all but ``/health`` need the API key."""
    guarded = [Depends(require_key)] if authenticated else []
    router = APIRouter()
    post = functools.partial(
        router.add_api_route, methods=["POST"], dependencies=guarded, responses=ERRORS
    )
    get = functools.partial(
        router.add_api_route, methods=["GET"], dependencies=guarded, responses=ERRORS
    )
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
    post(
        f"{API_PREFIX}/snapshot",
        snapshot,
        response_model=SnapshotResponse,
        summary="Save the snapshot now",
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
    )
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
