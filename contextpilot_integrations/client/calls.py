"""The service client's calls, each written once as a generator of HTTP requests.

Each call (:data:`~.transports.Steps`) builds its body, yields the requests to send, reads the
answers (errors mapped by :func:`~.errors.checked`) and decides the fallback
(:mod:`.fallback`); the blocking and the async drivers of :mod:`.transports` run it,
so both twins of :class:`~.client.ContextPilotClient` share every line of it.

A plan call also keeps each conversation's turn numbering and settles what failed calls may
have left on the service (:mod:`.conversations`): before it sends, it forgets the
unsettled conversations and evicts the unsettled rids it touches; after the answer, it
renumbers the turns of a restarted service and forgets those conversations there.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import httpx
import pydantic
import pydantic_core

from contextpilot_integrations.client.conversations import ConversationMemory, SettleKey
from contextpilot_integrations.client.errors import (
    NOT_DELIVERED,
    UNAVAILABLE,
    ServiceUnavailableError,
    checked,
)
from contextpilot_integrations.client.fallback import Fallback, LocalPlans
from contextpilot_integrations.client.schemas import (
    BOOT_HEADER,
    BatchPlanResponse,
    LayoutModel,
    PlanResponse,
    plan_batch_json,
    plan_request_json,
)
from contextpilot_integrations.client.transports import Steps
from contextpilot_integrations.core.plan import BatchPlan, Plan
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import PlanRequest

__all__ = ["PATHS", "ClientCalls"]

# Every message of the client logs under the client's module name, wherever it is written.
logger = logging.getLogger("contextpilot_integrations.client.client")

PATHS = {
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
"""The service's endpoints, by call name."""


class ClientCalls:
    """The calls of one client.

    Args:
        base_url: the service, without a trailing slash.
        api_key: sent as ``Authorization: Bearer`` (``None``: no header).
        plan_timeout: limit of a plan and of the small calls.
        batch_timeout: limit of batches, statistics and snapshot saves.
        fallback: the service's availability and the local plans.
        conversations: the turn numbering and the unsettled conversations and rids.

    Attributes:
        server_layout: the server's layout, once fetched (``None`` before).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        plan_timeout: httpx.Timeout,
        batch_timeout: httpx.Timeout,
        fallback: Fallback,
        conversations: ConversationMemory,
    ) -> None:
        self.base_url = base_url
        self.fallback = fallback
        self.conversations = conversations
        self.server_layout: PromptLayout | None = None
        self._timeouts = {
            "plan": {"timeout": plan_timeout.as_dict()},
            "batch": {"timeout": batch_timeout.as_dict()},
        }
        self._headers = {"content-type": "application/json", "accept": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._urls = {name: httpx.URL(f"{base_url}{path}") for name, path in PATHS.items()}

    # ------------------------------------------------------------------ Public API: planning
    def plan(self, request: PlanRequest) -> Steps[Plan | LocalPlans]:
        """POST /v1/plan: the plan, or what to plan locally."""
        return self._planning("plan", [request])

    def plan_batch(self, batch: list[PlanRequest]) -> Steps[BatchPlan | LocalPlans]:
        """POST /v1/plan_batch: the plans, or what to plan locally."""
        return self._planning("plan_batch", batch)

    def layout(self) -> Steps[PromptLayout | None]:
        """GET /v1/layout; None while the service is unavailable."""
        if self.fallback.holding_off():
            return None
        try:
            layout = self._set_layout((yield self._request("GET", "layout")))
        except UNAVAILABLE as exc:
            self.fallback.failed("GET /v1/layout", exc, raise_without_fallback=False)
            return None
        self.fallback.recovered()
        return layout

    # ------------------------------------------------------------------ Public API: the others
    def evict(self, rid: str) -> Steps[bool]:
        """POST /v1/evict; while the service is down, the local pilot's eviction."""
        result = yield from self._call("POST", "evict", {"rid": rid})
        if result is not None:
            return bool(result["evicted"])
        local = self.fallback.local
        return local.evict(rid) if local is not None else False

    def record_usage(
        self, rid: str, prompt_tokens: int, cached_tokens: int, cache_write_tokens: int | None
    ) -> Steps[bool]:
        """POST /v1/usage; False while the service is down."""
        body = {
            "rid": rid,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "cache_write_tokens": cache_write_tokens,
        }
        result = yield from self._call("POST", "usage", body)
        return bool(result["indexed"]) if result is not None else False

    def forget(self, conversation_id: str, tenant: str) -> Steps[bool]:
        """POST /v1/conversations/forget; False while the service is down (then the
        conversation is forgotten before the service plans it again)."""
        body = {"conversation_id": conversation_id, "tenant": tenant}
        result = yield from self._call("POST", "forget", body)
        if result is None:
            self.conversations.remember_unsettled([("conversation", tenant, conversation_id)])
            return False
        return bool(result["forgotten"])

    def stats(self) -> Steps[dict[str, Any]]:
        """GET /v1/stats with the client's counters; while the service is down, the local
        pilot's statistics."""
        result = yield from self._call("GET", "stats", None, "batch")
        counts = {**self.fallback.counts(), **self.conversations.counts()}
        if result is None:
            local = self.fallback.pilot().stats() if self.fallback.enabled else {}
            return {**local, "client": counts, "service_reachable": False}
        return {**result, "client": counts, "service_reachable": True}

    def save_snapshot(self) -> Steps[bool]:
        """POST /v1/snapshot; False while the service is down."""
        result = yield from self._call("POST", "snapshot", {}, "batch")
        return bool(result["saved"]) if result is not None else False

    def health(self) -> Steps[dict[str, Any]]:
        """GET /health (never the fallback).

        Raises:
            ServiceUnavailableError: the service is unreachable.
        """
        try:
            response = yield self._request("GET", "health")
        except httpx.TransportError as exc:
            raise ServiceUnavailableError(f"index service {self.base_url}: {exc}") from exc
        health: dict[str, Any] = checked(response).json()
        return health

    # ------------------------------------------------------------------ plans
    def _planning(self, name: str, requests: list[PlanRequest]) -> Steps[Any]:
        sent = [self.conversations.to_send(request) for request in requests]
        body = plan_request_json(sent[0]) if name == "plan" else plan_batch_json(sent)
        content = _encode(body)
        if self.fallback.skip_call():
            return LocalPlans.every(len(requests))
        touched = self.conversations.touched(requests)
        posted = False
        try:
            layout = self.server_layout
            if layout is None:
                layout = self._set_layout((yield self._request("GET", "layout")))
            for key in self.conversations.unsettled_among(touched):
                yield from self._settle(key)
            posted = True
            timeout = "batch" if name == "plan_batch" else "plan"
            response = checked((yield self._request("POST", name, content, timeout)))
            model = PlanResponse if name == "plan" else BatchPlanResponse
            try:
                result = model.model_validate_json(response.content).to_core(layout)
            except pydantic.ValidationError as exc:
                raise ServiceUnavailableError(f"unreadable answer to POST {PATHS[name]}") from exc
        except UNAVAILABLE as exc:
            if posted and not isinstance(exc, NOT_DELIVERED):
                self.conversations.remember_unsettled(touched)
            self.fallback.failed(f"POST {PATHS[name]}", exc)
            return LocalPlans.every(len(requests))
        self.fallback.recovered()
        boot = response.headers.get(BOOT_HEADER)
        plans = [result] if isinstance(result, Plan) else list(result.plans)
        local: dict[int, int | None] = {}
        for i, (request, sent_request, plan) in enumerate(zip(requests, sent, plans)):
            received = self.conversations.received(request, sent_request, plan, boot)
            if received.plan is None:
                local[i] = received.turn
            else:
                plans[i] = received.plan
            for key in received.settle:
                yield from self._settle_now(key)
        if isinstance(result, Plan):
            return LocalPlans(local) if local else plans[0]
        batch = dataclasses.replace(result, plans=tuple(plans))
        return LocalPlans(local, batch) if local else batch

    def _settle(self, key: SettleKey) -> Steps[None]:
        """Undo what a call may have left on the service: forget the conversation
        (``("conversation", tenant, id)``) or evict the rid (``("rid", rid)``)."""
        if key[0] == "conversation":
            body = {"conversation_id": key[2], "tenant": key[1]}
            checked((yield self._request("POST", "forget", _encode(body))))
        else:
            checked((yield self._request("POST", "evict", _encode({"rid": key[1]}))))
        self.conversations.settled(key)

    def _settle_now(self, key: SettleKey) -> Steps[None]:
        """:meth:`_settle` at once, best effort: when it fails, before the key's next use."""
        try:
            yield from self._settle(key)
        except Exception as exc:  # noqa: BLE001 - any failure leaves it for later
            self.conversations.remember_unsettled([key])
            logger.debug("index service %s: settling %r later (%s)", self.base_url, key, exc)

    # ------------------------------------------------------------------ requests and answers
    def _call(
        self, method: str, name: str, body: dict[str, Any] | None, timeout: str = "plan"
    ) -> Steps[Any]:
        """One JSON call; its decoded answer, or None while the service is unavailable."""
        content = None if body is None else _encode(body)
        if self.fallback.skip_call():
            return None
        try:
            result = checked((yield self._request(method, name, content, timeout))).json()
        except UNAVAILABLE as exc:
            self.fallback.failed(f"{method} {PATHS[name]}", exc)
            return None
        self.fallback.recovered()
        return result

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
        layout = LayoutModel.model_validate_json(checked(response).content).to_core()
        self.server_layout = layout
        return layout


def _encode(body: dict[str, Any]) -> bytes:
    try:
        return pydantic_core.to_json(body)
    except pydantic_core.PydanticSerializationError as exc:
        raise TypeError(f"request cannot be sent as JSON: {exc}") from exc
