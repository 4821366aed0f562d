"""The HTTP metering middleware: a request whose client left before any answer started is
counted as 499, one whose handler failed without answering as 500, each under its endpoint."""

from __future__ import annotations

import asyncio
from typing import Any

from contextpilot_integrations.service.metrics import ServiceMetrics
from contextpilot_integrations.service.middleware import MeteringMiddleware


async def _waits_for_the_client(scope: Any, receive: Any, send: Any) -> None:
    # A handler that answers only once the body is in, and stops when the client hangs up.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _fails(scope: Any, receive: Any, send: Any) -> None:
    raise RuntimeError("handler failed")


def _count(metrics: ServiceMetrics, endpoint: str, status: str) -> float:
    value = metrics.registry.get_sample_value(
        "contextpilot_http_requests_total", {"endpoint": endpoint, "status": status}
    )
    return value or 0.0


def _call(app: Any, metrics: ServiceMetrics) -> None:
    middleware = MeteringMiddleware(
        app, metrics=metrics, max_body_bytes=1_000, known_paths=frozenset({"/v1/plan"})
    )
    messages = iter(
        [{"type": "http.request", "body": b"{}", "more_body": True}, {"type": "http.disconnect"}]
    )

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError(f"nothing is sent to a client that left: {message}")

    scope = {"type": "http", "path": "/v1/plan", "method": "POST", "headers": []}
    asyncio.run(middleware(scope, receive, send))


def test_a_client_that_left_before_the_answer_is_counted_499() -> None:
    metrics = ServiceMetrics(dict)
    _call(_waits_for_the_client, metrics)
    assert _count(metrics, "/v1/plan", "499") == 1
    assert _count(metrics, "/v1/plan", "500") == 0


def test_a_handler_that_failed_without_answering_is_counted_500() -> None:
    metrics = ServiceMetrics(dict)
    try:
        _call(_fails, metrics)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the handler's error is not swallowed")
    assert _count(metrics, "/v1/plan", "500") == 1
    assert _count(metrics, "/v1/plan", "499") == 0
