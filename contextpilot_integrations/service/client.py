"""The index service's client: the planner contract over HTTP, with sync and async twins.

:class:`ContextPilotClient` implements
:class:`~contextpilot_integrations.core.planner_protocol.Planner`, as the in-process
:class:`~contextpilot_integrations.core.pilot.ContextPilot` does, so every adapter takes
either: ``plan`` / ``aplan`` take the arguments of a
:class:`~contextpilot_integrations.core.request.PlanRequest`, ``plan_batch`` / ``aplan_batch``
a list of them, and they return the core's own
:class:`~contextpilot_integrations.core.plan.Plan` /
:class:`~contextpilot_integrations.core.plan.BatchPlan`, rebuilt from the service's JSON and
rendered with the server's :class:`PromptLayout` (fetched once from ``GET /v1/layout``).
Coroutines await the ``a``-twins, which send over an async transport (one per event loop, so
one client serves ``asyncio.run`` after ``asyncio.run``) and never block the loop.

One implementation serves both twins: each call is written once as a generator of HTTP
requests (body encoding, response decoding, error mapping, the fallback decision), which a
blocking and an async driver run (:mod:`.transports`).

Errors, as in process: a request is checked by building the core's ``PlanRequest`` (and
``check_batch``) before anything is sent, so bad input raises the core's ``TypeError`` /
``ValueError`` naming the field; the server's own refusals raise the same types with the
core's message, :class:`~contextpilot_integrations.core.request.RidConflictError` for a rid
already indexed or being planned (409), ``PermissionError`` for a wrong API key (401) or a
body naming another tenant than the key's (403), and :class:`ServiceError` for anything else.

The service being down never fails a request (DESIGN.md invariant 5): when the service cannot
be reached, times out or answers 5xx, plans are made by a local in-process ``ContextPilot``
with the same layout (less reuse: it shares no index with other processes), the failure is
counted (``stats()["client"]``) and logged once at warning level; ``evict`` and the other calls
return False (``evict`` asks the local pilot). After a failure the service is retried no sooner
than ``retry_interval_s`` later, so an outage costs one connection attempt per interval, not
one per request. Pass ``fallback=False`` to get :class:`ServiceUnavailableError` instead.

Timeouts: a plan waits at most ``timeout`` (default 0.5 s to connect, 1 s for the answer), so
a service that accepts connections but never answers costs about a second before the local
plan; batches, statistics and snapshot saves wait ``batch_timeout`` (default 30 s).

No wrong hints across the fallback (DESIGN.md invariant 9):

- a local plan never de-duplicates: it is made without the conversation (the local pilot has
  not seen the conversation's earlier turns, and would number them from 1), so it shows every
  block in full; its ``scope`` is the request's (conversation id, and the turn only when the
  caller gave one);
- a call that failed after it was sent (a timeout, a 5xx, a broken connection) may have been
  planned and recorded by the service although the caller never got that plan (a phantom
  turn, which a later hint could point to). The client remembers such conversations (and
  explicit rids) in a bounded LRU (``max_unsettled``), and before its next service call for
  one of them asks the service to forget the conversation (``/v1/conversations/forget``; the
  service's tombstone keeps its turn numbers going) and to evict the rid; if that fails, the
  request is planned locally again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import pydantic
import pydantic_core

from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import BatchPlan, Plan
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import (
    NO_SCOPE,
    PlanRequest,
    RidConflictError,
    Scope,
    check_batch,
)
from contextpilot_integrations.service.schemas import (
    BatchPlanResponse,
    LayoutModel,
    PlanResponse,
    plan_batch_json,
    plan_request_json,
)
from contextpilot_integrations.service.transports import Steps, Transports

__all__ = ["ContextPilotClient", "ServiceError", "ServiceUnavailableError"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = httpx.Timeout(1.0, connect=0.5)
"""Plans and the small calls: 0.5 s to connect, 1 s for each read and write."""

BATCH_READ_TIMEOUT_S = 30.0
"""Batches, statistics and snapshot saves: the default read timeout, seconds."""

DEFAULT_MAX_UNSETTLED = 10_000

_PATHS = {
    "plan": "/v1/plan",
    "plan_batch": "/v1/plan_batch",
    "evict": "/v1/evict",
    "forget": "/v1/conversations/forget",
    "usage": "/v1/usage",
    "snapshot": "/v1/snapshot",
    "layout": "/v1/layout",
    "stats": "/v1/stats",
    "health": "/health",
}


class ServiceError(RuntimeError):
    """The service refused a call for another reason than bad input or authentication.

    Attributes:
        status_code: the HTTP status (0 when no response came back).
    """

    def __init__(self, message: str, status_code: int = 0) -> None:
        super().__init__(message)
        self.status_code = status_code


class ServiceUnavailableError(ServiceError):
    """The service could not be reached or failed (5xx), and the fallback is off."""


_RAISED_AS: dict[str, type[Exception]] = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "RidConflictError": RidConflictError,
}

_UNAVAILABLE = (httpx.TransportError, ServiceUnavailableError)
"""Failures that mean "the service is not there": fall back, never raise to the user."""

_NOT_DELIVERED = (httpx.ConnectError, httpx.ConnectTimeout)
"""Failures before the request reached the service: it cannot have planned it."""


class ContextPilotClient:
    """The index service, called like an in-process ``ContextPilot`` (a ``Planner``).

    Args:
        base_url: the service, e.g. ``"http://127.0.0.1:8765"``.
        api_key: the API key of the caller's tenant (sent as ``Authorization: Bearer``).
        timeout: limit of a plan and of the small calls (evict, usage, forget, layout,
            health): seconds for every phase, or an ``httpx.Timeout`` (default
            :data:`DEFAULT_TIMEOUT`: 0.5 s to connect, 1 s to read).
        batch_timeout: limit of ``plan_batch``, ``stats`` and ``save_snapshot`` (default
            ``timeout`` with a read timeout of at least 30 s).
        fallback: plan locally when the service is unreachable or fails (default True).
        fallback_layout: layout of local plans made before the server's layout is known.
        retry_interval_s: after a failure, seconds before the service is tried again.
        max_unsettled: most conversations and rids remembered as possibly planned by the
            service after a failed call (LRU; module docstring).
        transport: the httpx transport the blocking calls send with (default a keep-alive
            ``httpx.HTTPTransport``; give one for TLS settings, proxies or a Unix socket; the
            caller closes it; :class:`~.transports.Transports`).
        async_transport_factory: makes the async transport of each event loop the coroutines
            run on (default ``httpx.AsyncHTTPTransport``); a loop's transport is closed by
            :meth:`aclose` on that loop or when the loop shuts down.

    Raises:
        ValueError: a malformed ``base_url``, an empty ``api_key``, a negative
            ``retry_interval_s`` or a ``max_unsettled`` below 1.

    Thread-safe: one client may be shared by threads and event loops.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        *,
        batch_timeout: float | httpx.Timeout | None = None,
        fallback: bool = True,
        fallback_layout: PromptLayout | None = None,
        retry_interval_s: float = 1.0,
        max_unsettled: int = DEFAULT_MAX_UNSETTLED,
        transport: httpx.BaseTransport | None = None,
        async_transport_factory: Callable[[], httpx.AsyncBaseTransport] | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty str or None")
        if retry_interval_s < 0:
            raise ValueError(f"retry_interval_s must be >= 0, got {retry_interval_s!r}")
        if isinstance(max_unsettled, bool) or not isinstance(max_unsettled, int):
            raise ValueError(f"max_unsettled must be an int >= 1, got {max_unsettled!r}")
        self.base_url = base_url.rstrip("/")
        self.fallback = fallback
        self.retry_interval_s = retry_interval_s
        plan_timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        if batch_timeout is None:
            read = max(plan_timeout.read or 0.0, BATCH_READ_TIMEOUT_S)
            batch_timeout = httpx.Timeout(
                connect=plan_timeout.connect,
                read=read,
                write=plan_timeout.write,
                pool=plan_timeout.pool,
            )
        elif not isinstance(batch_timeout, httpx.Timeout):
            batch_timeout = httpx.Timeout(batch_timeout)
        self._timeouts = {
            "plan": {"timeout": plan_timeout.as_dict()},
            "batch": {"timeout": batch_timeout.as_dict()},
        }
        self._headers = {"content-type": "application/json", "accept": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._urls = {name: httpx.URL(f"{self.base_url}{path}") for name, path in _PATHS.items()}
        self._transports = Transports(transport, async_transport_factory)
        self._lock = threading.Lock()
        self._server_layout: PromptLayout | None = None
        self._fallback_layout = fallback_layout
        self._local: ContextPilot | None = None
        self._down_until = 0.0
        self._warned = False
        self._unsettled: LRU[tuple[str, ...], None] = LRU(max_unsettled)
        self._counters = {
            "calls": 0,
            "service_failures": 0,
            "fallback_plans": 0,
            "settled": 0,
            "unsettled_dropped": 0,
        }

    # ------------------------------------------------------------------ Public API: Planner
    @property
    def layout(self) -> PromptLayout:
        """The server's prompt layout (fetched once, blocking); while the service is
        unreachable, the local fallback's layout (the failure counted, tried again later).

        Raises:
            PermissionError: the service refused the API key.
        """
        layout = self._server_layout
        if layout is None:
            layout = self._transports.run(self._layout())
        return layout if layout is not None else self._local_pilot().layout

    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        """As :meth:`ContextPilot.plan`, on the shared index.

        Raises:
            TypeError / ValueError: bad input (the message names the field and the value).
            RidConflictError: ``rid`` is already indexed or being planned.
            PermissionError: the service refused the API key, or ``scope.tenant`` is another
                tenant's than the key's.
            ServiceUnavailableError: the service is unreachable and ``fallback=False``.
        """
        request = PlanRequest(query, blocks, rid, scope or NO_SCOPE)
        plan = self._transports.run(self._plan(request))
        return plan if plan is not None else self._fallback_plan(request)

    async def aplan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        """:meth:`plan` without blocking the event loop (the fallback plans in a thread)."""
        request = PlanRequest(query, blocks, rid, scope or NO_SCOPE)
        plan = await self._transports.arun(self._plan(request))
        if plan is not None:
            return plan
        return await asyncio.to_thread(self._fallback_plan, request)

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """As :meth:`ContextPilot.plan_batch`, on the shared index (errors as :meth:`plan`;
        the batch is checked by ``check_batch`` first)."""
        batch = check_batch(requests)
        plans = self._transports.run(self._plan_batch(batch))
        return plans if plans is not None else self._fallback_batch(batch)

    async def aplan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """:meth:`plan_batch` without blocking the event loop."""
        batch = check_batch(requests)
        plans = await self._transports.arun(self._plan_batch(batch))
        if plans is not None:
            return plans
        return await asyncio.to_thread(self._fallback_batch, batch)

    def evict(self, rid: str) -> bool:
        """Drop ``rid`` from the shared index; False if unknown. While the service is down,
        the local fallback's index is asked."""
        return self._transports.run(self._evict(rid))

    async def aevict(self, rid: str) -> bool:
        """:meth:`evict` without blocking the event loop."""
        return await self._transports.arun(self._evict(rid))

    # ------------------------------------------------------------------ Public API: service
    def record_usage(self, rid: str, prompt_tokens: int, cached_tokens: int) -> bool:
        """Report the engine's usage of a planned request (``usage.prompt_tokens`` and
        ``usage.prompt_tokens_details.cached_tokens``); True if the rid is indexed, False
        also when the service is down.

        Raises:
            ValueError: ``cached_tokens > prompt_tokens`` or a negative figure (the core's).
        """
        return self._transports.run(self._record_usage(rid, prompt_tokens, cached_tokens))

    async def arecord_usage(self, rid: str, prompt_tokens: int, cached_tokens: int) -> bool:
        """:meth:`record_usage` without blocking the event loop."""
        return await self._transports.arun(self._record_usage(rid, prompt_tokens, cached_tokens))

    def forget_conversation(self, conversation_id: str, tenant: str = "") -> bool:
        """Drop a conversation's de-duplication records; False if unknown or the service is
        down (then it is forgotten before the service plans it again; local plans record
        none)."""
        return self._transports.run(self._forget(conversation_id, tenant))

    async def aforget_conversation(self, conversation_id: str, tenant: str = "") -> bool:
        """:meth:`forget_conversation` without blocking the event loop."""
        return await self._transports.arun(self._forget(conversation_id, tenant))

    def stats(self) -> dict[str, Any]:
        """The service's statistics (``IndexService.stats()``: the index's keys at the top
        level, as ``ContextPilot.stats()``), plus ``client`` counters and
        ``service_reachable``; while the service is down, the local fallback's."""
        return self._transports.run(self._stats())

    async def astats(self) -> dict[str, Any]:
        """:meth:`stats` without blocking the event loop."""
        return await self._transports.arun(self._stats())

    def save_snapshot(self) -> bool:
        """Ask the service to save a checkpoint of its snapshot now; False when it has none
        or is down."""
        return self._transports.run(self._save_snapshot())

    async def asave_snapshot(self) -> bool:
        """:meth:`save_snapshot` without blocking the event loop."""
        return await self._transports.arun(self._save_snapshot())

    def health(self) -> dict[str, Any]:
        """``GET /health`` (``HealthResponse``).

        Raises:
            ServiceUnavailableError: the service is unreachable (no fallback, not counted).
        """
        return self._transports.run(self._health())

    async def ahealth(self) -> dict[str, Any]:
        """:meth:`health` without blocking the event loop."""
        return await self._transports.arun(self._health())

    def close(self) -> None:
        """Close the blocking connections (if this client opened them) and drop the async
        transports (a loop's connections are closed by :meth:`aclose` on it, or when it shuts
        down)."""
        self._transports.close()

    async def aclose(self) -> None:
        """Close this event loop's connections, then as :meth:`close`."""
        await self._transports.aclose()

    def __enter__(self) -> ContextPilotClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> ContextPilotClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ the calls, written once
    def _plan(self, request: PlanRequest) -> Steps[Plan | None]:
        """POST /v1/plan; None: plan locally."""
        return self._planning("plan", [request], plan_request_json(request), PlanResponse)

    def _plan_batch(self, batch: list[PlanRequest]) -> Steps[BatchPlan | None]:
        """POST /v1/plan_batch; None: plan locally."""
        return self._planning("plan_batch", batch, plan_batch_json(batch), BatchPlanResponse)

    def _planning(
        self,
        name: str,
        requests: list[PlanRequest],
        body: dict[str, Any],
        response_model: type[PlanResponse] | type[BatchPlanResponse],
    ) -> Steps[Any]:
        content = _encode(body)
        self._count("calls")
        if self._skipping_service():
            return None
        touched = _touched(requests)
        sent = False
        try:
            layout = self._server_layout
            if layout is None:
                layout = self._set_layout((yield self._request("GET", "layout")))
            for key in self._unsettled_among(touched):
                yield from self._settle(key)
            sent = True
            timeout = "batch" if name == "plan_batch" else "plan"
            response = self._checked((yield self._request("POST", name, content, timeout)))
            try:
                result = response_model.model_validate_json(response.content).to_core(layout)
            except pydantic.ValidationError as exc:
                raise ServiceUnavailableError(f"unreadable answer to POST {_PATHS[name]}") from exc
        except _UNAVAILABLE as exc:
            if sent and not isinstance(exc, _NOT_DELIVERED):
                self._remember_unsettled(touched)
            self._failed(f"POST {_PATHS[name]}", exc)
            return None
        self._recovered()
        return result

    def _settle(self, key: tuple[str, ...]) -> Steps[None]:
        """Undo what a failed call may have left on the service: forget the conversation
        (``("conversation", tenant, id)``) or evict the rid (``("rid", rid)``)."""
        if key[0] == "conversation":
            body = {"conversation_id": key[2], "tenant": key[1]}
            self._checked((yield self._request("POST", "forget", _encode(body))))
        else:
            self._checked((yield self._request("POST", "evict", _encode({"rid": key[1]}))))
        with self._lock:
            self._unsettled.pop(key)
            self._counters["settled"] += 1

    def _layout(self) -> Steps[PromptLayout | None]:
        """GET /v1/layout; None while the service is unavailable."""
        if self._holding_off():
            return None
        try:
            layout = self._set_layout((yield self._request("GET", "layout")))
        except _UNAVAILABLE as exc:
            self._failed("GET /v1/layout", exc, raise_without_fallback=False)
            return None
        self._recovered()
        return layout

    def _evict(self, rid: str) -> Steps[bool]:
        result = yield from self._call("POST", "evict", {"rid": rid})
        if result is not None:
            return bool(result["evicted"])
        local = self._local
        return local.evict(rid) if local is not None else False

    def _record_usage(self, rid: str, prompt_tokens: int, cached_tokens: int) -> Steps[bool]:
        body = {"rid": rid, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens}
        result = yield from self._call("POST", "usage", body)
        return bool(result["indexed"]) if result is not None else False

    def _forget(self, conversation_id: str, tenant: str) -> Steps[bool]:
        body = {"conversation_id": conversation_id, "tenant": tenant}
        result = yield from self._call("POST", "forget", body)
        if result is None:  # the service keeps it for now: forget it before it plans again
            self._remember_unsettled([("conversation", tenant, conversation_id)])
            return False
        return bool(result["forgotten"])

    def _stats(self) -> Steps[dict[str, Any]]:
        result = yield from self._call("GET", "stats", None, "batch")
        if result is None:
            local = self._local_pilot().stats() if self.fallback else {}
            return {**local, "client": self._counts(), "service_reachable": False}
        return {**result, "client": self._counts(), "service_reachable": True}

    def _save_snapshot(self) -> Steps[bool]:
        result = yield from self._call("POST", "snapshot", {}, "batch")
        return bool(result["saved"]) if result is not None else False

    def _health(self) -> Steps[dict[str, Any]]:
        try:
            response = yield self._request("GET", "health")
        except httpx.TransportError as exc:
            raise ServiceUnavailableError(f"index service {self.base_url}: {exc}") from exc
        health: dict[str, Any] = self._checked(response).json()
        return health

    def _call(
        self, method: str, name: str, body: dict[str, Any] | None, timeout: str = "plan"
    ) -> Steps[Any]:
        """One JSON call; its decoded answer, or None while the service is unavailable."""
        content = None if body is None else _encode(body)
        self._count("calls")
        if self._skipping_service():
            return None
        try:
            result = self._checked((yield self._request(method, name, content, timeout))).json()
        except _UNAVAILABLE as exc:
            self._failed(f"{method} {_PATHS[name]}", exc)
            return None
        self._recovered()
        return result

    # ------------------------------------------------------------------ requests and answers
    def _request(
        self, method: str, name: str, content: bytes | None = None, timeout: str = "plan"
    ) -> httpx.Request:
        return httpx.Request(
            method,
            self._urls[name],
            content=content,
            headers=self._headers,
            extensions=self._timeouts[timeout],
        )

    def _set_layout(self, response: httpx.Response) -> PromptLayout:
        layout = LayoutModel.model_validate_json(self._checked(response).content).to_core()
        self._server_layout = layout
        return layout

    def _checked(self, response: httpx.Response) -> httpx.Response:
        """Return a 2xx response; raise the error a 4xx stands for; a 5xx raises
        :class:`ServiceUnavailableError` (the caller may fall back)."""
        status = response.status_code
        if status < 400:
            return response
        try:
            error = response.json()
            message = str(error.get("message", response.text))
            error_type = str(error.get("error_type", ""))
        except (ValueError, AttributeError):
            message, error_type = response.text[:1000], ""
        if status >= 500:
            raise ServiceUnavailableError(f"service error {status}: {message}", status)
        if status == 401:
            raise PermissionError(f"index service refused the API key: {message}")
        if status == 403:
            raise PermissionError(f"index service refused the call: {message}")
        if status == 409:
            raise RidConflictError(message)
        raised = _RAISED_AS.get(error_type)
        if raised is None:
            raise ServiceError(f"service refused the call ({status}): {message}", status)
        raise raised(message)

    # ------------------------------------------------------------------ availability, fallback
    def _holding_off(self) -> bool:
        """True while an earlier failure says not to try the service yet."""
        return time.monotonic() < self._down_until

    def _skipping_service(self) -> bool:
        """:meth:`_holding_off`; without the fallback, raise :class:`ServiceUnavailableError`
        instead of skipping."""
        if not self._holding_off():
            return False
        if not self.fallback:
            raise ServiceUnavailableError(
                f"index service {self.base_url}: unavailable, tried again at most every "
                f"{self.retry_interval_s} s"
            )
        return True

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _counts(self) -> dict[str, int]:
        with self._lock:
            return {**self._counters, "unsettled": len(self._unsettled)}

    def _unsettled_among(self, touched: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
        with self._lock:
            return [key for key in touched if key in self._unsettled]

    def _remember_unsettled(self, touched: list[tuple[str, ...]]) -> None:
        with self._lock:
            dropped = sum(len(self._unsettled.put(key, None)) for key in touched)
            self._counters["unsettled_dropped"] += dropped
        if dropped:
            logger.warning(
                "index service client: %d conversations that failed calls may have left on "
                "the service are no longer remembered (max_unsettled=%d)",
                dropped,
                self._unsettled.max_entries,
            )

    def _failed(
        self, what: str, exc: BaseException, *, raise_without_fallback: bool = True
    ) -> None:
        """Count a service failure, warn once, hold off the service for a while; without the
        fallback, raise :class:`ServiceUnavailableError`."""
        with self._lock:
            self._counters["service_failures"] += 1
            first = not self._warned
            self._warned = True
            self._down_until = time.monotonic() + self.retry_interval_s
        level = logging.WARNING if first else logging.DEBUG
        fallback = "planning locally" if self.fallback else "no fallback"
        logger.log(
            level, "index service %s: %s failed (%s); %s", self.base_url, what, exc, fallback
        )
        if not self.fallback and raise_without_fallback:
            if isinstance(exc, ServiceUnavailableError):
                raise exc
            raise ServiceUnavailableError(f"index service {self.base_url}: {exc}") from exc

    def _recovered(self) -> None:
        self._down_until = 0.0

    def _local_pilot(self) -> ContextPilot:
        """The local fallback pilot (made on first use, with the server's layout if known)."""
        with self._lock:
            if self._local is None:
                layout = self._server_layout or self._fallback_layout or PromptLayout()
                self._local = ContextPilot(layout=layout)
            return self._local

    def _fallback_plan(self, request: PlanRequest) -> Plan:
        """A local plan of ``request``, made without its conversation (it never hints); its
        scope is the request's."""
        self._count("fallback_plans")
        plan = self._local_pilot().plan(
            request.query, request.blocks, rid=request.rid, scope=_without_conversation(request)
        )
        return dataclasses.replace(plan, scope=request.scope)

    def _fallback_batch(self, batch: list[PlanRequest]) -> BatchPlan:
        """Local plans of a batch, as :meth:`_fallback_plan`."""
        self._count("fallback_plans")
        local = self._local_pilot().plan_batch(
            [dataclasses.replace(r, scope=_without_conversation(r)) for r in batch]
        )
        plans = tuple(
            dataclasses.replace(plan, scope=request.scope)
            for plan, request in zip(local.plans, batch)
        )
        return dataclasses.replace(local, plans=plans)


def _without_conversation(request: PlanRequest) -> Scope:
    return Scope(tenant=request.scope.tenant)


def _touched(requests: list[PlanRequest]) -> list[tuple[str, ...]]:
    """What a call of these requests may leave on the service: their conversations and
    explicit rids."""
    touched: list[tuple[str, ...]] = []
    for request in requests:
        key = request.scope.conversation
        if key is not None:
            touched.append(("conversation", *key))
        if request.rid is not None:
            touched.append(("rid", request.rid))
    return touched


def _encode(body: dict[str, Any]) -> bytes:
    try:
        return pydantic_core.to_json(body)
    except pydantic_core.PydanticSerializationError as exc:
        raise TypeError(f"request cannot be sent as JSON: {exc}") from exc
