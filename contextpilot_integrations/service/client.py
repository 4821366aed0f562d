"""Clients of the index service with the interface of the in-process ``ContextPilot``.

:class:`ContextPilotClient` (blocking) and :class:`AsyncContextPilotClient` (coroutines) take
the arguments of :meth:`ContextPilot.plan` / :meth:`ContextPilot.plan_batch` and return the
core's own :class:`~contextpilot_integrations.core.pilot.Plan` /
:class:`~contextpilot_integrations.core.pilot.BatchPlan`, rebuilt from the service's JSON and
rendered with the server's :class:`PromptLayout` (fetched once from ``GET /v1/layout``). So an
adapter written against ``ContextPilot`` takes either.

Errors, as in process: bad input raises the ``TypeError`` / ``ValueError`` the core raised on
the server (its message names the field and the value); a wrong API key raises
``PermissionError``; other refusals raise :class:`ServiceError`.

The service being down never fails a request (DESIGN.md invariant 5): when the service cannot
be reached, times out or answers 5xx, ``plan`` / ``plan_batch`` are answered by a local
in-process ``ContextPilot`` with the same layout (less reuse: it shares no index with other
processes), the failure is counted (``stats()["client"]``) and logged once at warning level;
``evict`` and the conversation calls return False. After a failure the service is retried no
sooner than ``retry_interval_s`` later, so an outage costs one connection attempt per interval,
not one per request. Pass ``fallback=False`` to get :class:`ServiceUnavailableError` instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import anyio
import httpx
import pydantic_core

from contextpilot_integrations.core.conversation import TurnVisibility
from contextpilot_integrations.core.pilot import BatchPlan, ContextPilot, Plan
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.service.schemas import (
    BatchPlanResponse,
    LayoutModel,
    PlanResponse,
    visibility_from_core,
)

__all__ = [
    "AsyncContextPilotClient",
    "ContextPilotClient",
    "ServiceError",
    "ServiceUnavailableError",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0


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
    "PermissionError": PermissionError,
}


class _ClientCore:
    """What both clients share: request bodies, decoding, errors, the local fallback."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout: float | httpx.Timeout,
        fallback: bool,
        fallback_layout: PromptLayout | None,
        retry_interval_s: float,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty str or None")
        if retry_interval_s < 0:
            raise ValueError(f"retry_interval_s must be >= 0, got {retry_interval_s!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.extensions = {"timeout": self.timeout.as_dict()}
        self.headers = {"content-type": "application/json", "accept": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self.fallback = fallback
        self.retry_interval_s = retry_interval_s
        self._layout: PromptLayout | None = None
        self._fallback_layout = fallback_layout
        self._local: ContextPilot | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._warned = False
        self._counters = {"calls": 0, "service_failures": 0, "fallback_plans": 0}
        self.urls = {
            name: httpx.URL(f"{self.base_url}{path}")
            for name, path in (
                ("plan", "/v1/plan"),
                ("plan_batch", "/v1/plan_batch"),
                ("evict", "/v1/evict"),
                ("forget", "/v1/conversations/forget"),
                ("usage", "/v1/usage"),
                ("snapshot", "/v1/snapshot"),
                ("layout", "/v1/layout"),
                ("stats", "/v1/stats"),
                ("health", "/health"),
            )
        }

    def request(self, method: str, name: str, body: bytes | None = None) -> httpx.Request:
        """The HTTP request for endpoint ``name``, with the headers and the timeout."""
        return httpx.Request(
            method, self.urls[name], content=body, headers=self.headers, extensions=self.extensions
        )

    # ------------------------------------------------------------------ request bodies
    @staticmethod
    def plan_body(
        query: str,
        blocks: Sequence[str],
        rid: str | None,
        conversation_id: str | None,
        tenant: str,
        turn: int | None,
        visibility: TurnVisibility | None,
    ) -> bytes:
        _check_texts(query, blocks, "blocks")
        body: dict[str, Any] = {"query": query, "blocks": list(blocks)}
        if rid is not None:
            body["rid"] = rid
        if conversation_id is not None:
            body["conversation_id"] = conversation_id
        if tenant:
            body["tenant"] = tenant
        if turn is not None:
            body["turn"] = turn
        if visibility is not None:
            body["visibility"] = _visibility_json(visibility)
        return _encode(body)

    @staticmethod
    def batch_body(
        queries: Sequence[str],
        blocks: Sequence[Sequence[str]],
        rids: Sequence[str] | None,
        conversation_ids: Sequence[str | None] | None,
        tenants: Sequence[str] | None,
        turns: Sequence[int | None] | None,
        visibilities: Sequence[TurnVisibility | None] | None,
    ) -> bytes:
        # The same checks and messages as ContextPilot.plan_batch, before anything is zipped.
        if len(queries) != len(blocks):
            raise ValueError(f"queries has {len(queries)} entries but blocks has {len(blocks)}")
        columns: dict[str, Sequence[Any] | None] = {
            "rids": rids,
            "conversation_ids": conversation_ids,
            "tenants": tenants,
            "turns": turns,
            "visibilities": visibilities,
        }
        for name, values in columns.items():
            if values is not None and len(values) != len(queries):
                raise ValueError(f"{name} has {len(values)} entries for {len(queries)} queries")
        items = []
        for i, (query, texts) in enumerate(zip(queries, blocks)):
            _check_texts(query, texts, f"blocks[{i}]")
            item: dict[str, Any] = {"query": query, "blocks": list(texts)}
            if rids is not None:
                item["rid"] = rids[i]
            if conversation_ids is not None and conversation_ids[i] is not None:
                item["conversation_id"] = conversation_ids[i]
            if tenants is not None and tenants[i]:
                item["tenant"] = tenants[i]
            if turns is not None and turns[i] is not None:
                item["turn"] = turns[i]
            if visibilities is not None and visibilities[i] is not None:
                item["visibility"] = _visibility_json(visibilities[i])
            items.append(item)
        return _encode({"requests": items})

    # ------------------------------------------------------------------ responses
    def decode_plan(self, response: httpx.Response, layout: PromptLayout) -> Plan:
        return PlanResponse.model_validate_json(response.content).to_plan(layout)

    def decode_batch(self, response: httpx.Response, layout: PromptLayout) -> BatchPlan:
        return BatchPlanResponse.model_validate_json(response.content).to_batch_plan(layout)

    def set_layout(self, response: httpx.Response) -> PromptLayout:
        self._layout = LayoutModel.model_validate_json(response.content).to_core()
        return self._layout

    def check(self, response: httpx.Response) -> httpx.Response:
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
        raise _RAISED_AS.get(error_type, ServiceError)(message)

    # ------------------------------------------------------------------ availability
    def service_skipped(self) -> bool:
        """True while an earlier failure says not to try the service yet."""
        return time.monotonic() < self._down_until

    def count_call(self) -> None:
        with self._lock:
            self._counters["calls"] += 1

    def failed(self, what: str, exc: BaseException) -> None:
        """Count a service failure, warn once, and hold off the service for a while."""
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
        if not self.fallback:
            if isinstance(exc, ServiceUnavailableError):
                raise exc
            raise ServiceUnavailableError(f"index service {self.base_url}: {exc}") from exc

    def recovered(self) -> None:
        self._down_until = 0.0

    def local(self) -> ContextPilot:
        """The local fallback pilot (made on first use, with the server's layout if known)."""
        with self._lock:
            if self._local is None:
                layout = self._layout or self._fallback_layout or PromptLayout()
                self._local = ContextPilot(layout=layout)
                self._fallback_layout = layout
            return self._local

    def fallback_planner(self) -> ContextPilot:
        """:meth:`local`, counting one fallback plan (or batch)."""
        with self._lock:
            self._counters["fallback_plans"] += 1
        return self.local()

    def counters(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._counters)


_UNAVAILABLE = (httpx.TransportError, ServiceUnavailableError)
"""Failures that mean "the service is not there": fall back, never raise to the user."""


class ContextPilotClient:
    """The index service, called like an in-process ``ContextPilot`` (blocking).

    Args:
        base_url: the service, e.g. ``"http://127.0.0.1:8765"``.
        api_key: the service's shared secret (sent as ``Authorization: Bearer``).
        timeout: seconds per HTTP call (or an ``httpx.Timeout``).
        fallback: plan locally when the service is unreachable or fails (default True).
        fallback_layout: layout of local plans made before the server's layout is known.
        retry_interval_s: after a failure, seconds before the service is tried again.
        transport: the httpx transport to send with (default a new ``httpx.HTTPTransport``,
            a keep-alive connection pool; give one for TLS settings, proxies or a Unix socket).
            Requests go to the transport directly, without ``httpx.Client``'s auth, redirect
            and cookie handling, which the service needs none of and which costs about a
            tenth of a millisecond per call (``benchmarks/bench_service.py``).

    Raises:
        ValueError: a malformed ``base_url`` or an empty ``api_key``.

    Thread-safe: one client may be shared by threads (the transport pools connections).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        *,
        fallback: bool = True,
        fallback_layout: PromptLayout | None = None,
        retry_interval_s: float = 1.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._core = _ClientCore(
            base_url, api_key, timeout, fallback, fallback_layout, retry_interval_s
        )
        self._transport = transport or httpx.HTTPTransport()
        self._owns_transport = transport is None

    # ------------------------------------------------------------------ the ContextPilot API
    @property
    def layout(self) -> PromptLayout:
        """The server's prompt layout (fetched once; the fallback layout while unreachable)."""
        layout = self._core._layout
        if layout is not None:
            return layout
        try:
            return self._fetch_layout()
        except _UNAVAILABLE as exc:
            self._core.failed("GET /v1/layout", exc)
            return self._core.local().layout

    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        conversation_id: str | None = None,
        tenant: str = "",
        turn: int | None = None,
        visibility: TurnVisibility | None = None,
    ) -> Plan:
        """As :meth:`ContextPilot.plan`, on the shared index.

        Raises:
            TypeError / ValueError: bad input (the message names the field and the value).
            PermissionError: the service refused the API key.
            ServiceUnavailableError: the service is unreachable and ``fallback=False``.
        """
        core = self._core
        body = core.plan_body(query, blocks, rid, conversation_id, tenant, turn, visibility)
        core.count_call()
        if not core.service_skipped():
            try:
                layout = core._layout or self._fetch_layout()
                response = self._post("plan", body)
                core.recovered()
                return core.decode_plan(response, layout)
            except _UNAVAILABLE as exc:
                core.failed("POST /v1/plan", exc)
        return core.fallback_planner().plan(
            query,
            blocks,
            rid=rid,
            conversation_id=conversation_id,
            tenant=tenant,
            turn=turn,
            visibility=visibility,
        )

    def plan_batch(
        self,
        queries: Sequence[str],
        blocks: Sequence[Sequence[str]],
        *,
        rids: Sequence[str] | None = None,
        conversation_ids: Sequence[str | None] | None = None,
        tenants: Sequence[str] | None = None,
        turns: Sequence[int | None] | None = None,
        visibilities: Sequence[TurnVisibility | None] | None = None,
    ) -> BatchPlan:
        """As :meth:`ContextPilot.plan_batch`, on the shared index (errors as :meth:`plan`)."""
        core = self._core
        body = core.batch_body(
            queries, blocks, rids, conversation_ids, tenants, turns, visibilities
        )
        core.count_call()
        if not core.service_skipped():
            try:
                layout = core._layout or self._fetch_layout()
                response = self._post("plan_batch", body)
                core.recovered()
                return core.decode_batch(response, layout)
            except _UNAVAILABLE as exc:
                core.failed("POST /v1/plan_batch", exc)
        return core.fallback_planner().plan_batch(
            queries,
            blocks,
            rids=rids,
            conversation_ids=conversation_ids,
            tenants=tenants,
            turns=turns,
            visibilities=visibilities,
        )

    def evict(self, rid: str) -> bool:
        """Drop ``rid`` from the shared index; False if unknown or the service is down."""
        result = self._call_or("evict", {"rid": rid}, None)
        return bool(result["evicted"]) if result is not None else self._local_evict(rid)

    def stats(self) -> dict[str, Any]:
        """The service's statistics (the index's keys at the top level, as
        ``ContextPilot.stats()``), plus ``client`` counters and ``service_reachable``."""
        result = self._call_or("stats", None, None)
        if result is None:
            local = self._core.local().stats() if self._core.fallback else {}
            return {**local, "client": self._core.counters(), "service_reachable": False}
        return {**result, "client": self._core.counters(), "service_reachable": True}

    # ------------------------------------------------------------------ service extras
    def forget_conversation(self, conversation_id: str, tenant: str = "") -> bool:
        """Drop a conversation's de-duplication records; False if unknown or service down."""
        body = {"conversation_id": conversation_id, "tenant": tenant}
        result = self._call_or("forget", body, None)
        if self._core._local is not None:
            self._core._local.deduplicator.store.forget(tenant, conversation_id)
        return bool(result["forgotten"]) if result is not None else False

    def record_usage(self, rid: str, prompt_tokens: int, cached_tokens: int) -> bool:
        """Report the engine's usage of a planned request (``usage.prompt_tokens`` and
        ``usage.prompt_tokens_details.cached_tokens``); True if the rid is indexed."""
        body = {"rid": rid, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens}
        result = self._call_or("usage", body, None)
        return bool(result["indexed"]) if result is not None else False

    def save_snapshot(self) -> bool:
        """Ask the service to save its snapshot now; False when it has none or is down."""
        result = self._call_or("snapshot", {}, None)
        return bool(result["saved"]) if result is not None else False

    def health(self) -> dict[str, Any]:
        """``GET /health`` (raises :class:`ServiceUnavailableError` when unreachable)."""
        try:
            return self._core.check(self._send("GET", "health")).json()
        except httpx.TransportError as exc:
            raise ServiceUnavailableError(f"index service {self._core.base_url}: {exc}") from exc

    def close(self) -> None:
        """Close the HTTP connections (if this client opened them)."""
        if self._owns_transport:
            self._transport.close()

    def __enter__(self) -> ContextPilotClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _send(self, method: str, name: str, body: bytes | None = None) -> httpx.Response:
        response = self._transport.handle_request(self._core.request(method, name, body))
        try:
            response.read()
        finally:
            response.close()
        return response

    def _post(self, name: str, body: bytes) -> httpx.Response:
        return self._core.check(self._send("POST", name, body))

    def _fetch_layout(self) -> PromptLayout:
        return self._core.set_layout(self._core.check(self._send("GET", "layout")))

    def _call_or(self, name: str, body: dict[str, Any] | None, default: Any) -> Any:
        core = self._core
        core.count_call()
        if core.service_skipped():
            return default
        try:
            if body is None:
                result = core.check(self._send("GET", name)).json()
            else:
                result = self._post(name, _encode(body)).json()
        except _UNAVAILABLE as exc:
            core.failed(f"{name} call", exc)
            return default
        core.recovered()
        return result

    def _local_evict(self, rid: str) -> bool:
        local = self._core._local
        return local.evict(rid) if local is not None else False


class AsyncContextPilotClient:
    """The async twin of :class:`ContextPilotClient`: the same methods as coroutines.

    Args: as :class:`ContextPilotClient` (``transport`` an ``httpx.AsyncBaseTransport``).
    Fallback plans of a batch run in a worker thread, so they do not block the event loop.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        *,
        fallback: bool = True,
        fallback_layout: PromptLayout | None = None,
        retry_interval_s: float = 1.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._core = _ClientCore(
            base_url, api_key, timeout, fallback, fallback_layout, retry_interval_s
        )
        self._transport = transport or httpx.AsyncHTTPTransport()
        self._owns_transport = transport is None

    async def layout(self) -> PromptLayout:
        """The server's prompt layout (fetched once; the fallback layout while unreachable)."""
        if self._core._layout is not None:
            return self._core._layout
        try:
            return await self._fetch_layout()
        except _UNAVAILABLE as exc:
            self._core.failed("GET /v1/layout", exc)
            return self._core.local().layout

    async def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        conversation_id: str | None = None,
        tenant: str = "",
        turn: int | None = None,
        visibility: TurnVisibility | None = None,
    ) -> Plan:
        """As :meth:`ContextPilotClient.plan`."""
        core = self._core
        body = core.plan_body(query, blocks, rid, conversation_id, tenant, turn, visibility)
        core.count_call()
        if not core.service_skipped():
            try:
                layout = core._layout or await self._fetch_layout()
                response = await self._post("plan", body)
                core.recovered()
                return core.decode_plan(response, layout)
            except _UNAVAILABLE as exc:
                core.failed("POST /v1/plan", exc)
        return core.fallback_planner().plan(
            query,
            blocks,
            rid=rid,
            conversation_id=conversation_id,
            tenant=tenant,
            turn=turn,
            visibility=visibility,
        )

    async def plan_batch(
        self,
        queries: Sequence[str],
        blocks: Sequence[Sequence[str]],
        *,
        rids: Sequence[str] | None = None,
        conversation_ids: Sequence[str | None] | None = None,
        tenants: Sequence[str] | None = None,
        turns: Sequence[int | None] | None = None,
        visibilities: Sequence[TurnVisibility | None] | None = None,
    ) -> BatchPlan:
        """As :meth:`ContextPilotClient.plan_batch`."""
        core = self._core
        body = core.batch_body(
            queries, blocks, rids, conversation_ids, tenants, turns, visibilities
        )
        core.count_call()
        if not core.service_skipped():
            try:
                layout = core._layout or await self._fetch_layout()
                response = await self._post("plan_batch", body)
                core.recovered()
                return core.decode_batch(response, layout)
            except _UNAVAILABLE as exc:
                core.failed("POST /v1/plan_batch", exc)
        local = core.fallback_planner()
        return await anyio.to_thread.run_sync(
            lambda: local.plan_batch(
                queries,
                blocks,
                rids=rids,
                conversation_ids=conversation_ids,
                tenants=tenants,
                turns=turns,
                visibilities=visibilities,
            )
        )

    async def evict(self, rid: str) -> bool:
        """As :meth:`ContextPilotClient.evict`."""
        result = await self._call_or("evict", {"rid": rid}, None)
        if result is not None:
            return bool(result["evicted"])
        local = self._core._local
        return local.evict(rid) if local is not None else False

    async def stats(self) -> dict[str, Any]:
        """As :meth:`ContextPilotClient.stats`."""
        result = await self._call_or("stats", None, None)
        if result is None:
            local = self._core.local().stats() if self._core.fallback else {}
            return {**local, "client": self._core.counters(), "service_reachable": False}
        return {**result, "client": self._core.counters(), "service_reachable": True}

    async def forget_conversation(self, conversation_id: str, tenant: str = "") -> bool:
        """As :meth:`ContextPilotClient.forget_conversation`."""
        body = {"conversation_id": conversation_id, "tenant": tenant}
        result = await self._call_or("forget", body, None)
        if self._core._local is not None:
            self._core._local.deduplicator.store.forget(tenant, conversation_id)
        return bool(result["forgotten"]) if result is not None else False

    async def record_usage(self, rid: str, prompt_tokens: int, cached_tokens: int) -> bool:
        """As :meth:`ContextPilotClient.record_usage`."""
        body = {"rid": rid, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens}
        result = await self._call_or("usage", body, None)
        return bool(result["indexed"]) if result is not None else False

    async def save_snapshot(self) -> bool:
        """As :meth:`ContextPilotClient.save_snapshot`."""
        result = await self._call_or("snapshot", {}, None)
        return bool(result["saved"]) if result is not None else False

    async def health(self) -> dict[str, Any]:
        """As :meth:`ContextPilotClient.health`."""
        try:
            response = await self._send("GET", "health")
        except httpx.TransportError as exc:
            raise ServiceUnavailableError(f"index service {self._core.base_url}: {exc}") from exc
        return self._core.check(response).json()

    async def aclose(self) -> None:
        """Close the HTTP connections (if this client opened them)."""
        if self._owns_transport:
            await self._transport.aclose()

    async def __aenter__(self) -> AsyncContextPilotClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _send(self, method: str, name: str, body: bytes | None = None) -> httpx.Response:
        request = self._core.request(method, name, body)
        response = await self._transport.handle_async_request(request)
        try:
            await response.aread()
        finally:
            await response.aclose()
        return response

    async def _post(self, name: str, body: bytes) -> httpx.Response:
        return self._core.check(await self._send("POST", name, body))

    async def _fetch_layout(self) -> PromptLayout:
        return self._core.set_layout(self._core.check(await self._send("GET", "layout")))

    async def _call_or(self, name: str, body: dict[str, Any] | None, default: Any) -> Any:
        core = self._core
        core.count_call()
        if core.service_skipped():
            return default
        try:
            if body is None:
                result = core.check(await self._send("GET", name)).json()
            else:
                result = (await self._post(name, _encode(body))).json()
        except _UNAVAILABLE as exc:
            core.failed(f"{name} call", exc)
            return default
        core.recovered()
        return result


def _check_texts(query: object, blocks: object, field_name: str) -> None:
    """The core's type checks (same messages), so that a value JSON cannot carry fails here
    with the field's name rather than in the encoder."""
    if not isinstance(query, str):
        raise TypeError(f"query must be a str, got {type(query).__name__}: {query!r:.80}")
    if isinstance(blocks, str) or not isinstance(blocks, Sequence):
        raise TypeError(
            f"{field_name} must be a sequence of str, got {type(blocks).__name__}: {blocks!r:.80}"
        )
    for i, text in enumerate(blocks):
        if not isinstance(text, str):
            raise TypeError(
                f"{field_name}[{i}] must be a str, got {type(text).__name__}: {text!r:.80}"
            )


def _visibility_json(visibility: object) -> dict[str, Any] | None:
    if not isinstance(visibility, TurnVisibility):
        raise TypeError(
            f"visibility must be a TurnVisibility or None, got {type(visibility).__name__}"
        )
    return visibility_from_core(visibility)


def _encode(body: dict[str, Any]) -> bytes:
    try:
        return pydantic_core.to_json(body)
    except pydantic_core.PydanticSerializationError as exc:
        raise TypeError(f"request cannot be sent as JSON: {exc}") from exc
