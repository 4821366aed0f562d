"""``ContextPilotClient``: the index service called like an in-process ``ContextPilot``.

It implements :class:`~contextpilot_integrations.core.planner_protocol.Planner`, so every face
takes it: ``plan`` / ``aplan`` take a
:class:`~contextpilot_integrations.core.request.PlanRequest`'s arguments, ``plan_batch`` /
``aplan_batch`` a list of them, and they return the core's own
:class:`~contextpilot_integrations.core.plan.Plan` / ``BatchPlan``, rendered with the server's
``PromptLayout`` (``GET /v1/layout``, fetched once). Each call is written once
(:mod:`.calls`) and driven blocking or on the running event loop (:mod:`.transports`).

Errors, as in process: bad input raises the core's ``TypeError`` / ``ValueError`` before
anything is sent; the server's refusals raise the same types with the core's message,
:class:`~contextpilot_integrations.core.request.RidConflictError` (409), ``PermissionError``
(401 wrong key, 403 a body naming another tenant) or :class:`~.errors.ServiceError`.

The service being down never fails a request (docs/DESIGN.md, "Never break a request"): a
plan the service cannot make (unreachable, timed out, 5xx) is made locally (:mod:`.fallback`;
``fallback=False``: :class:`~.errors.ServiceUnavailableError`). A plan waits at most
``timeout`` (default 0.5 s to connect, 1 s to read), batches, statistics and saves
``batch_timeout`` (default 30 s to read). Turn numbers stay the app's across service restarts
and failed calls (docs/DESIGN.md, "Sure hints"; :mod:`.conversations`); an app that outlives
the client's memory of a conversation (a restart of its own, more than
``max_conversations``, several processes) passes its own ``Scope.turn``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from contextpilot_integrations.client.calls import ClientCalls
from contextpilot_integrations.client.conversations import (
    DEFAULT_MAX_CONVERSATIONS,
    DEFAULT_MAX_UNSETTLED,
    ConversationMemory,
)
from contextpilot_integrations.client.fallback import Fallback
from contextpilot_integrations.client.transports import Transports
from contextpilot_integrations.core.plan import BatchPlan, Plan
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import NO_SCOPE, PlanRequest, Scope, check_batch

__all__ = ["ContextPilotClient"]

DEFAULT_TIMEOUT = httpx.Timeout(1.0, connect=0.5)
"""Plans and the small calls: 0.5 s to connect, 1 s for each read and write."""

BATCH_READ_TIMEOUT_S = 30.0
"""Batches, statistics and snapshot saves: the default read timeout, seconds."""


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
            service after a failed call (LRU; :mod:`.conversations`).
        max_conversations: most conversations whose turn numbering is remembered across
            service restarts (LRU; :mod:`.conversations`).
        transport: the httpx transport the blocking calls send with (default a keep-alive
            ``httpx.HTTPTransport``; give one for TLS settings, proxies or a Unix socket; the
            caller closes it; :class:`~.transports.Transports`).
        async_transport_factory: makes the async transport of each event loop the coroutines
            run on (default ``httpx.AsyncHTTPTransport``); a loop's transport is closed by
            :meth:`aclose` on that loop or when the loop shuts down.

    Attributes:
        base_url: the service, without a trailing slash.
        plan_timeout, batch_timeout: the limits in use (``httpx.Timeout``).

    Raises:
        ValueError: a malformed ``base_url``, an empty ``api_key``, a negative
            ``retry_interval_s``, or a ``max_unsettled`` or ``max_conversations`` below 1.

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
        max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
        transport: httpx.BaseTransport | None = None,
        async_transport_factory: Callable[[], httpx.AsyncBaseTransport] | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty str or None")
        if retry_interval_s < 0:
            raise ValueError(f"retry_interval_s must be >= 0, got {retry_interval_s!r}")
        self.base_url = base_url.rstrip("/")
        self.plan_timeout = (
            timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        )
        if batch_timeout is None:
            batch_timeout = httpx.Timeout(
                connect=self.plan_timeout.connect,
                read=max(self.plan_timeout.read or 0.0, BATCH_READ_TIMEOUT_S),
                write=self.plan_timeout.write,
                pool=self.plan_timeout.pool,
            )
        elif not isinstance(batch_timeout, httpx.Timeout):
            batch_timeout = httpx.Timeout(batch_timeout)
        self.batch_timeout = batch_timeout
        conversations = ConversationMemory(max_conversations, max_unsettled)
        self._fallback = Fallback(
            self.base_url,
            enabled=fallback,
            retry_interval_s=retry_interval_s,
            layout=lambda: self._calls.server_layout,
            fallback_layout=fallback_layout,
        )
        self._calls = ClientCalls(
            self.base_url,
            api_key,
            self.plan_timeout,
            self.batch_timeout,
            self._fallback,
            conversations,
        )
        self._transports = Transports(transport, async_transport_factory)

    @property
    def fallback(self) -> bool:
        """Whether plans are made locally while the service is unavailable."""
        return self._fallback.enabled

    @property
    def retry_interval_s(self) -> float:
        """After a failure, seconds before the service is tried again."""
        return self._fallback.retry_interval_s

    # ------------------------------------------------------------------ Public API: Planner
    @property
    def layout(self) -> PromptLayout:
        """The server's prompt layout (fetched once, blocking); while the service is
        unreachable, the local fallback's layout (the failure counted, tried again later).

        Raises:
            PermissionError: the service refused the API key.
        """
        layout = self._calls.server_layout
        if layout is None:
            layout = self._transports.run(self._calls.layout())
        return layout if layout is not None else self._fallback.pilot().layout

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
        return self._fallback.plan(self._transports.run(self._calls.plan(request)), request)

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
        try:
            outcome = await self._transports.arun(self._calls.plan(request))
        except asyncio.CancelledError:
            # The service may have planned this turn; the caller will never show it.
            self._calls.conversations.remember_unsettled(ConversationMemory.touched([request]))
            raise
        if isinstance(outcome, Plan):
            return outcome
        return await asyncio.to_thread(self._fallback.plan, outcome, request)

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """As :meth:`ContextPilot.plan_batch`, on the shared index (errors as :meth:`plan`;
        the batch is checked by ``check_batch`` first)."""
        batch = check_batch(requests)
        outcome = self._transports.run(self._calls.plan_batch(batch))
        return self._fallback.plan_batch(outcome, batch)

    async def aplan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """:meth:`plan_batch` without blocking the event loop."""
        batch = check_batch(requests)
        try:
            outcome = await self._transports.arun(self._calls.plan_batch(batch))
        except asyncio.CancelledError:
            self._calls.conversations.remember_unsettled(ConversationMemory.touched(batch))
            raise
        if isinstance(outcome, BatchPlan):
            return outcome
        return await asyncio.to_thread(self._fallback.plan_batch, outcome, batch)

    def evict(self, rid: str) -> bool:
        """Drop ``rid`` from the shared index; False if unknown. While the service is down,
        the local fallback's index is asked."""
        return self._transports.run(self._calls.evict(rid))

    async def aevict(self, rid: str) -> bool:
        """:meth:`evict` without blocking the event loop."""
        return await self._transports.arun(self._calls.evict(rid))

    # ------------------------------------------------------------------ Public API: service
    def record_usage(
        self,
        rid: str,
        prompt_tokens: int,
        cached_tokens: int,
        cache_write_tokens: int | None = None,
    ) -> bool:
        """Report the engine's usage of a planned request (``usage.prompt_tokens``,
        ``usage.prompt_tokens_details.cached_tokens`` and, from Anthropic, the tokens written
        to its cache; ``engine_fields.read_usage``); True if the rid is indexed, False also
        when the service is down.

        Raises:
            ValueError: ``cached_tokens > prompt_tokens`` or a negative figure (the core's).
        """
        return self._transports.run(
            self._calls.record_usage(rid, prompt_tokens, cached_tokens, cache_write_tokens)
        )

    async def arecord_usage(
        self,
        rid: str,
        prompt_tokens: int,
        cached_tokens: int,
        cache_write_tokens: int | None = None,
    ) -> bool:
        """:meth:`record_usage` without blocking the event loop."""
        return await self._transports.arun(
            self._calls.record_usage(rid, prompt_tokens, cached_tokens, cache_write_tokens)
        )

    def forget_conversation(self, conversation_id: str, tenant: str = "") -> bool:
        """Drop a conversation's de-duplication records; False if unknown or the service is
        down (then it is forgotten before the service plans it again; local plans record
        none)."""
        return self._transports.run(self._calls.forget(conversation_id, tenant))

    async def aforget_conversation(self, conversation_id: str, tenant: str = "") -> bool:
        """:meth:`forget_conversation` without blocking the event loop."""
        return await self._transports.arun(self._calls.forget(conversation_id, tenant))

    def stats(self) -> dict[str, Any]:
        """The service's statistics (``IndexService.stats()``: the index's keys at the top
        level, as ``ContextPilot.stats()``), plus ``service_reachable`` and the ``client``
        counters: ``calls``, ``service_failures``, ``fallback_plans`` (calls planned
        locally), ``settled``, ``unsettled``, ``unsettled_dropped``, ``renumbered`` (plans
        renumbered after a service restart), ``renumber_refused`` (planned locally instead)
        and ``conversations`` (whose numbering is remembered); while the service is down, the
        local fallback's statistics."""
        return self._transports.run(self._calls.stats())

    async def astats(self) -> dict[str, Any]:
        """:meth:`stats` without blocking the event loop."""
        return await self._transports.arun(self._calls.stats())

    def save_snapshot(self) -> bool:
        """Ask the service to save a checkpoint of its snapshot now; False when it has none
        or is down."""
        return self._transports.run(self._calls.save_snapshot())

    async def asave_snapshot(self) -> bool:
        """:meth:`save_snapshot` without blocking the event loop."""
        return await self._transports.arun(self._calls.save_snapshot())

    def health(self) -> dict[str, Any]:
        """``GET /health`` (``HealthResponse``).

        Raises:
            ServiceUnavailableError: the service is unreachable (no fallback, not counted).
        """
        return self._transports.run(self._calls.health())

    async def ahealth(self) -> dict[str, Any]:
        """:meth:`health` without blocking the event loop."""
        return await self._transports.arun(self._calls.health())

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
