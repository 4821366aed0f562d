"""The index service's HTTP API: a FastAPI app built around one :class:`IndexService`.

``create_app(config)`` returns a new app with its own service, metrics registry and state (no
module-level state), so tests and embedders can run several. Run one app per index in one
server process (uvicorn ``workers=1``): the index lives in that process, and many client
processes share it over HTTP.

Endpoints (JSON bodies, :mod:`.schemas`):

=======  ============================  ======================================================
POST     ``/v1/plan``                  ``ContextPilot.plan`` -> ``PlanResponse``
POST     ``/v1/plan_batch``            ``ContextPilot.plan_batch`` -> ``BatchPlanResponse``
POST     ``/v1/evict``                 drop one rid from the index
POST     ``/v1/conversations/forget``  drop a conversation's de-duplication records
POST     ``/v1/usage``                 report the engine's ``usage`` for a planned request
POST     ``/v1/snapshot``              save the snapshot now
GET      ``/v1/layout``                the prompt layout plans are rendered with
GET      ``/v1/stats``                 index, conversation, sync and usage statistics
GET      ``/metrics``                  Prometheus text exposition
GET      ``/health``                   liveness and the engine link (never authenticated)
=======  ============================  ======================================================

Errors: every 4xx/5xx body is an ``ErrorResponse`` whose ``message`` names the field and the
value (``body.blocks[2]: Input should be a valid string, got 5``); invalid input is a 422 and
never changes the index. With an API key set, other endpoints than ``/health`` answer 401
without ``Authorization: Bearer <key>``.

Concurrency: handlers are coroutines. A single plan whose body is at most
``ServiceConfig.inline_plan_bytes`` bytes is parsed, planned and encoded on the event loop (a
thread hop would cost more than the plan); larger plans and every batch are parsed, built and
encoded in worker threads (``anyio.to_thread``; batches at most ``max_batch_threads`` at once),
so a long batch does not hold up other requests (``tests/service/test_concurrency.py``).
"""

from __future__ import annotations

import functools
import hmac
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

import anyio
import pydantic_core
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from contextpilot_integrations import __version__
from contextpilot_integrations.service.index_service import (
    IndexService,
    RequestConflictError,
    ServiceConfig,
)
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
    PlanRequest,
    PlanResponse,
    UsageReport,
    UsageResponse,
    visibility_to_core,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

API_PREFIX = "/v1"
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "The body cannot be read as JSON."},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key."},
    409: {"model": ErrorResponse, "description": "The rid is already indexed or being planned."},
    413: {"model": ErrorResponse, "description": "Request body too large."},
    422: {"model": ErrorResponse, "description": "Invalid input (the message names it)."},
}
_JSON = "application/json"
# A stateless scheme description (what the OpenAPI document shows); the key is per app.
_BEARER = HTTPBearer(auto_error=False, description="The service's shared API key.")
_VALUE_CHARS = 200  # longest echo of a rejected value

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def create_app(
    config: ServiceConfig | None = None, *, service: IndexService | None = None
) -> FastAPI:
    """A new service app.

    Args:
        config: the service settings (ignored when ``service`` is given).
        service: an existing :class:`IndexService` to serve (its lifecycle is then bound to
            the app's lifespan all the same).

    Returns:
        The FastAPI app; ``app.state.service`` is its :class:`IndexService`. The lifespan
        starts the service (snapshot restore, engine sync) and stops it (snapshot save).

    Raises:
        ValueError: an invalid configuration (the message names the field).
    """
    service = service or IndexService(config)
    settings = service.config

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await anyio.to_thread.run_sync(service.start)
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(service.stop)

    app = FastAPI(
        title="ContextPilot index service",
        version=__version__,
        description="One shared context index for many app processes (plan, plan_batch, "
        "evict, conversations), following the engine's KV cache.",
        lifespan=lifespan,
    )
    app.state.service = service
    _install_error_handlers(app)
    known_paths = {
        f"{API_PREFIX}/{name}"
        for name in (
            "plan",
            "plan_batch",
            "evict",
            "conversations/forget",
            "usage",
            "snapshot",
            "layout",
            "stats",
        )
    } | {"/metrics", "/health"}
    app.add_middleware(
        _MeteringMiddleware,  # type: ignore[arg-type]
        service=service,
        known_paths=frozenset(known_paths),
    )

    expected = settings.api_key.encode("utf-8") if settings.api_key else None

    async def require_key(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> None:
        assert expected is not None  # only installed when a key is set
        given = credentials.credentials.encode("utf-8") if credentials is not None else b""
        if not hmac.compare_digest(given, expected):
            raise StarletteHTTPException(401, "missing or wrong API key (Authorization: Bearer)")

    # Without a key there is nothing to check (and no dependency to resolve per request).
    guarded = [Depends(require_key)] if expected is not None else []
    batch_limiter: list[anyio.CapacityLimiter] = []  # made on first use, inside the loop

    async def in_thread(call: Callable[[], T], *, batch: bool = False) -> T:
        limiter = None
        if batch:
            if not batch_limiter:
                batch_limiter.append(anyio.CapacityLimiter(settings.max_batch_threads))
            limiter = batch_limiter[0]
        return await anyio.to_thread.run_sync(call, limiter=limiter)

    async def run(call: Callable[[], T], *, inline: bool, batch: bool = False) -> T:
        """Run a service call; its TypeError / ValueError (bad input, named by the core) is a
        422, anything else a 500."""
        try:
            return call() if inline else await in_thread(call, batch=batch)
        except RequestConflictError as exc:
            raise _InvalidInput(exc, 409) from exc
        except (TypeError, ValueError) as exc:
            raise _InvalidInput(exc, 422) from exc

    # The plan bodies are read raw and validated where the work runs: a large body's JSON
    # parse and validation would otherwise hold the event loop as long as the build itself.
    @app.post(
        f"{API_PREFIX}/plan",
        response_model=PlanResponse,
        responses=_ERRORS,
        dependencies=guarded,
        summary="Plan one request",
        openapi_extra=_json_body(PlanRequest),
    )
    async def plan(request: Request) -> Response:
        raw = await request.body()

        def parse_plan_encode() -> Response:
            body = _validate(PlanRequest, raw)
            plan = service.plan(
                body.query,
                body.blocks,
                rid=body.rid,
                conversation_id=body.conversation_id,
                tenant=body.tenant,
                turn=body.turn,
                visibility=visibility_to_core(body.visibility),
            )
            return _json(PlanResponse.encode(plan))

        return await run(parse_plan_encode, inline=len(raw) <= settings.inline_plan_bytes)

    @app.post(
        f"{API_PREFIX}/plan_batch",
        response_model=BatchPlanResponse,
        responses=_ERRORS,
        dependencies=guarded,
        summary="Plan and schedule a batch",
        openapi_extra=_json_body(PlanBatchRequest),
    )
    async def plan_batch(request: Request) -> Response:
        raw = await request.body()

        def parse_plan_encode() -> Response:
            items = _validate(PlanBatchRequest, raw).requests
            rids: list[str] | None = None
            if any(item.rid is not None for item in items):
                # The core takes every rid or none: the missing ones get new ids, as it would.
                rids = [item.rid or f"cp-{uuid.uuid4().hex}" for item in items]
            batch = service.plan_batch(
                [item.query for item in items],
                [item.blocks for item in items],
                rids=rids,
                conversation_ids=[item.conversation_id for item in items],
                tenants=[item.tenant for item in items],
                turns=[item.turn for item in items],
                visibilities=[visibility_to_core(item.visibility) for item in items],
            )
            return _json(BatchPlanResponse.encode(batch))

        return await run(parse_plan_encode, inline=False, batch=True)

    @app.post(
        f"{API_PREFIX}/evict",
        response_model=EvictResponse,
        responses=_ERRORS,
        dependencies=guarded,
        summary="Drop a request from the index",
    )
    async def evict(body: EvictRequest) -> Response:
        evicted = await run(functools.partial(service.evict, body.rid), inline=True)
        return _json({"evicted": evicted})

    @app.post(
        f"{API_PREFIX}/conversations/forget",
        response_model=ForgetConversationResponse,
        responses=_ERRORS,
        dependencies=guarded,
        summary="Forget a conversation's de-duplication records",
    )
    async def forget_conversation(body: ForgetConversationRequest) -> Response:
        call = functools.partial(service.forget_conversation, body.tenant, body.conversation_id)
        forgotten = await run(call, inline=True)
        return _json({"forgotten": forgotten})

    @app.post(
        f"{API_PREFIX}/usage",
        response_model=UsageResponse,
        responses=_ERRORS,
        dependencies=guarded,
        summary="Report the engine's token usage for a planned request",
    )
    async def usage(body: UsageReport) -> Response:
        call = functools.partial(
            service.record_usage, body.rid, body.prompt_tokens, body.cached_tokens
        )
        indexed = await run(call, inline=True)
        return _json({"indexed": indexed})

    @app.post(
        f"{API_PREFIX}/snapshot",
        responses=_ERRORS,
        dependencies=guarded,
        summary="Save the snapshot now",
    )
    async def snapshot() -> dict[str, bool]:
        return {"saved": await in_thread(service.save_snapshot)}

    @app.get(
        f"{API_PREFIX}/layout",
        response_model=LayoutModel,
        responses=_ERRORS,
        dependencies=guarded,
        summary="The prompt layout plans are rendered with",
    )
    async def layout() -> LayoutModel:
        return LayoutModel.from_core(service.layout)

    @app.get(
        f"{API_PREFIX}/stats",
        responses=_ERRORS,
        dependencies=guarded,
        summary="Index, conversation, sync and usage statistics",
    )
    async def stats() -> Response:
        return _json(await in_thread(service.stats))

    @app.get(
        "/metrics",
        dependencies=guarded,
        summary="Prometheus metrics (text exposition format)",
        responses={
            **_ERRORS,
            200: {
                "description": "Prometheus text exposition format.",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
        },
    )
    async def metrics() -> Response:
        body, content_type = await in_thread(service.metrics.exposition)
        return Response(content=body, media_type=content_type)

    @app.get("/health", response_model=HealthResponse, summary="Liveness and engine link")
    async def health() -> HealthResponse:
        return HealthResponse(
            status="ok",
            version=__version__,
            cache_model=service.cache_model,
            engine_connected=service.engine_connected,
            resync_pending=service.resync_pending,
        )

    _add_body_schemas(app, [PlanRequest, PlanBatchRequest])
    return app


# --------------------------------------------------------------------------------------------
# Responses and errors
# --------------------------------------------------------------------------------------------


def _json(content: Any, status_code: int = 200) -> Response:
    return Response(
        content=pydantic_core.to_json(content), status_code=status_code, media_type=_JSON
    )


def _error(
    status_code: int, message: str, error_type: str, fields: list[dict[str, Any]] | None = None
) -> Response:
    body = {"message": message, "error_type": error_type, "fields": fields or []}
    return _json(body, status_code)


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of an endpoint that validates ``model`` itself."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {_JSON: {"schema": schema}}}}


def _validate(model: type[M], raw: bytes) -> M:
    """Validate a JSON body; errors become a RequestValidationError located in ``body``."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]
        raise RequestValidationError(errors) from None


def _add_body_schemas(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Put the models of :func:`_json_body` bodies into the OpenAPI components."""
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


class _InvalidInput(Exception):
    """A TypeError / ValueError the service raised for the request's input."""

    def __init__(self, cause: TypeError | ValueError, status_code: int) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.status_code = status_code


def _field_path(location: tuple[Any, ...]) -> str:
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or "body"


def _echo(value: Any) -> Any:
    """A short, JSON-safe copy of a rejected value."""
    if value is None or isinstance(value, (bool, int)):
        return value if not isinstance(value, int) or abs(value) < 2**63 else repr(value)[:40]
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        text = value[:_VALUE_CHARS]
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return repr(value)[:_VALUE_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")


def _install_error_handlers(app: FastAPI) -> None:
    async def invalid_request(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        fields = []
        for error in exc.errors():
            path = _field_path(tuple(error.get("loc", ())))
            message = str(error.get("msg", "invalid"))
            value = _echo(error.get("input"))
            if error.get("type") == "json_invalid":  # the input is the whole body: not echoed
                message = f"invalid JSON: {error.get('ctx', {}).get('error', message)}"
                value = None
            fields.append({"field": path, "message": message, "value": value})
        if not fields:
            fields.append({"field": "body", "message": "invalid request", "value": None})
        first = fields[0]
        summary = f"{first['field']}: {first['message']}"
        if first["value"] is not None:
            summary += f", got {first['value']!r:.{_VALUE_CHARS}}"
        if len(fields) > 1:
            summary += f" (and {len(fields) - 1} more invalid fields)"
        return _error(422, summary, "ValueError", fields)

    async def invalid_input(_: Request, exc: Exception) -> Response:
        # The core names the field and the value in its TypeError / ValueError messages.
        assert isinstance(exc, _InvalidInput)
        error_type = "ValueError" if isinstance(exc.cause, ValueError) else "TypeError"
        return _error(exc.status_code, str(exc.cause)[:1000], error_type)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if isinstance(exc.__cause__, _BodyTooLarge):  # FastAPI wraps it as a parse error
            return _error(413, str(exc.__cause__), "ValueError")
        error_type = "PermissionError" if exc.status_code in (401, 403) else "HTTPError"
        message = str(exc.detail)
        if exc.status_code == 400 and exc.__cause__ is not None:
            error_type = "ValueError"
            message = f"body: cannot be read as JSON ({type(exc.__cause__).__name__})"
        response = _error(exc.status_code, message, error_type)
        response.headers.update(exc.headers or {})  # e.g. Allow on a 405
        if exc.status_code == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        return response

    async def server_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}", "InternalError")

    app.add_exception_handler(RequestValidationError, invalid_request)

    async def body_too_large(_: Request, exc: Exception) -> Response:
        return _error(413, str(exc), "ValueError")

    app.add_exception_handler(_InvalidInput, invalid_input)
    app.add_exception_handler(_BodyTooLarge, body_too_large)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)


# --------------------------------------------------------------------------------------------
# Metering and body limit (plain ASGI: cheaper than a BaseHTTPMiddleware)
# --------------------------------------------------------------------------------------------


class _BodyTooLarge(Exception):
    """The streamed body went over the limit (a body without Content-Length)."""


class _MeteringMiddleware:
    """Counts and times every HTTP request; refuses bodies over ``max_body_bytes`` (413)."""

    def __init__(self, app: Any, *, service: IndexService, known_paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = service.metrics
        self.max_body_bytes = service.config.max_body_bytes
        self.known_paths = known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        path = scope["path"]
        endpoint = path if path in self.known_paths else "other"
        status = [500]

        async def send_metered(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            declared = _content_length(scope)
            if declared is not None and declared > self.max_body_bytes:
                await _send_error(
                    send_metered,
                    413,
                    f"body: {declared} bytes exceeds the limit of {self.max_body_bytes} bytes",
                )
                return
            received = [0]

            async def receive_limited() -> Message:
                message = await receive()
                if message["type"] == "http.request":
                    received[0] += len(message.get("body", b""))
                    if received[0] > self.max_body_bytes:
                        raise _BodyTooLarge(
                            f"body: more than the limit of {self.max_body_bytes} bytes"
                        )
                return message

            await self.app(scope, receive_limited, send_metered)
        finally:
            self.metrics.http_requests.labels(endpoint, str(status[0])).inc()
            self.metrics.http_latency.labels(endpoint).observe(time.perf_counter() - started)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_error(send: Send, status_code: int, message: str) -> None:
    body = pydantic_core.to_json(
        {
            "message": message,
            "error_type": "ValueError",
            "fields": [{"field": "body", "message": message}],
        }
    )
    await send(
        {
            "type": "http.response.start",
            "status": status_code,
            "headers": [
                (b"content-type", _JSON.encode()),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
