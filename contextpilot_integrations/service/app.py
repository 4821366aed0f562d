"""The index service's HTTP API: a FastAPI app built around one :class:`IndexService`.

``create_app(config)`` returns a new app with its own service, metrics registry and state (no
module-level state). Run one app per index in one server process (uvicorn ``workers=1``): the
index lives in that process, and client processes share it over HTTP.

Endpoints (JSON bodies, :mod:`contextpilot_integrations.client.schemas`; handlers in
:mod:`.endpoints`):

=======  ============================  ======================================================
POST     ``/v1/plan``                  one ``PlanRequest`` -> ``PlanResponse``
POST     ``/v1/plan_batch``            ``{"requests": [PlanRequest, ...]}`` ->
                                       ``BatchPlanResponse``
POST     ``/v1/evict``                 drop one rid from the index
POST     ``/v1/conversations/forget``  drop a conversation's de-duplication records
POST     ``/v1/usage``                 report the engine's ``usage`` for a planned request
POST     ``/v1/snapshot``              save the snapshot now
GET      ``/v1/layout``                the prompt layout plans are rendered with
GET      ``/v1/stats``                 index, conversation, sync and usage statistics
GET      ``/metrics``                  Prometheus text exposition
GET      ``/health``                   liveness, the engine link, a proxy's replicas up (never
                                       authenticated; 503 when every replica is down)
=======  ============================  ======================================================

With ``config.proxy`` (the proxy mode, :mod:`.proxy.routes`) the app also serves
``POST /v1/chat/completions`` and ``POST /v1/messages`` (planned and forwarded to the
upstream) and passes every other ``/v1/`` path through; the routes above match first.

Errors (:mod:`.errors`): every 4xx/5xx body is an ``ErrorResponse`` whose ``message`` names
the field and the value; invalid input is a 422 (a rid conflict a 409, a body naming another
tenant a 403) and never changes the index. Bodies over ``max_body_bytes`` get a 413, and every
answer carries the service's boot id (:mod:`.middleware`).

Keys (:mod:`.tenants`): with API keys configured, every endpoint but ``/health`` answers 401
without ``Authorization: Bearer <key>`` of a tenant, and runs as that key's tenant;
``/openapi.json`` needs a key too, and the browser pages ``/docs`` and ``/redoc`` are off (a
browser cannot send a bearer key). Without keys all three are served.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from fastapi.routing import APIRoute

from contextpilot_integrations import __version__
from contextpilot_integrations.service.endpoints import ServiceCalls, add_body_schemas, api_router
from contextpilot_integrations.service.errors import install_error_handlers
from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.middleware import BootIdMiddleware, MeteringMiddleware
from contextpilot_integrations.service.proxy.routes import (
    PROXY_PATHS,
    PlannedRoutes,
    Proxy,
    proxy_router,
)
from contextpilot_integrations.service.service_config import ServiceConfig

__all__ = ["create_app"]


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
        starts the service (resync with the engine, snapshot timer) and stops it (engine
        link stopped, snapshot saved).

    Raises:
        ValueError: an invalid configuration (the message names the field).
    """
    service = service or IndexService(config)
    keyed = service.tenancy.keyed
    app = FastAPI(
        title="ContextPilot index service",
        version=__version__,
        description="One shared context index for many app processes (plan, plan_batch, "
        "evict, conversations), following the engine's KV cache.",
        lifespan=_lifespan,
        openapi_url=None if keyed else "/openapi.json",
        docs_url=None if keyed else "/docs",
        redoc_url=None if keyed else "/redoc",
    )
    app.state.service = service
    app.state.calls = ServiceCalls(service)
    install_error_handlers(app)
    router = api_router(keyed=keyed)
    app.include_router(router)
    known_paths = frozenset(r.path for r in router.routes if isinstance(r, APIRoute))
    app.state.proxy = None
    if service.config.proxy is not None:
        served: dict[str, frozenset[str]] = {}
        for route in router.routes:
            if isinstance(route, APIRoute):
                served[route.path] = served.get(route.path, frozenset()) | (route.methods or set())
        app.state.proxy = Proxy(service.config.proxy, service, served)
        app.include_router(proxy_router())
        known_paths |= frozenset(PROXY_PATHS)
    add_body_schemas(app)
    if app.state.proxy is not None:  # innermost: beneath the metering, ahead of the router
        app.add_middleware(PlannedRoutes, proxy=app.state.proxy)  # type: ignore[arg-type]
    app.add_middleware(
        MeteringMiddleware,  # type: ignore[arg-type]
        metrics=service.metrics,
        max_body_bytes=service.config.max_body_bytes,
        known_paths=known_paths,
    )
    app.add_middleware(BootIdMiddleware, boot_id=service.boot_id)  # type: ignore[arg-type]
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    service: IndexService = app.state.service
    # Their own limiters: worker threads stuck in a call must not keep these from running.
    await anyio.to_thread.run_sync(service.start, limiter=anyio.CapacityLimiter(1))
    background: list[asyncio.Task[None]] = []
    if app.state.proxy is not None:
        await anyio.to_thread.run_sync(app.state.proxy.start, limiter=anyio.CapacityLimiter(1))
        background.append(asyncio.create_task(app.state.proxy.calibrate_workers()))
        background.append(asyncio.create_task(app.state.proxy.learn_kv_capacity()))
    try:
        yield
    finally:
        for task in background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if app.state.proxy is not None:
            await app.state.proxy.aclose()
        await anyio.to_thread.run_sync(
            service.stop, limiter=anyio.CapacityLimiter(1), abandon_on_cancel=True
        )
