"""``ContextPilotOpenAI`` and ``ContextPilotOpenAILike``: OpenAI LLMs that send each plan's
engine-facing fields.

Needs ``llama-index-llms-openai`` (``ContextPilotOpenAI``) and ``llama-index-llms-openai-like``
(``ContextPilotOpenAILike``). The post-processor (and the ContextPilot templates) arm the plan
in the caller's context (:mod:`.request_ids`); each ``chat``/``complete`` call (sync, async,
streaming) whose prompt shows the plan's first block takes it once, before the client's
retries, and ``_get_model_kwargs`` merges the plan's body fields
(:func:`contextpilot_integrations.llm_call.engine_fields.with_engine_fields`) into
``extra_body``, over any ``extra_body`` set in ``additional_kwargs``. Calls that take no
request are sent unchanged.

- ``ContextPilotOpenAILike`` (self-hosted SGLang / vLLM): SGLang's ``rid``, vLLM's
  ``request_id`` and ``session_id`` by default (``request_id_engine="any"``).
- ``ContextPilotOpenAI`` (the hosted OpenAI API, which refuses unknown fields): the plan's
  ``prompt_cache_key``
  (:func:`contextpilot_integrations.llm_call.openai_cache_key.prompt_cache_key`: requests whose
  aligned prefix starts alike share it, so they reach the machine that caches it) and
  ``prompt_cache_retention`` when set (``request_id_engine="openai"``).

Behind a gateway in front of engine replicas (the plan of a
:class:`~contextpilot_integrations.core.replicas.routing.ReplicaRouter`), the plan's routing
key goes in the ``routing_header`` through ``extra_headers``, so the gateway sends the request
to the replica it was planned for. With ``usage_tracker`` (a
:class:`~contextpilot_integrations.llm_call.engine_fields.CacheUsageTracker`) the usage of each
planned response is read back to the pilot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
)
from llama_index.core.bridge.pydantic import Field
from llama_index.llms.openai import OpenAI
from llama_index.llms.openai_like import OpenAILike

from contextpilot_integrations.llama_index.request_ids import PendingRequest, take_pending
from contextpilot_integrations.llm_call.engine_fields import (
    ROUTING_HEADER,
    EngineKind,
    engine_headers,
    with_engine_fields,
)

__all__ = ["ContextPilotOpenAI", "ContextPilotOpenAILike"]

# Per-call keyword argument carrying the taken request from the public entry point down to
# _get_model_kwargs (through LlamaIndex's and the client's retry wrappers).
_REQUEST_KWARG = "contextpilot_request"


class ContextPilotOpenAI(OpenAI):
    """``OpenAI`` that sends the armed ContextPilot plan's fields with the next request.

    Same constructor as ``OpenAI`` (``model``, ``api_key``, ``api_base``,
    ``additional_kwargs``, ...), plus:

    Args:
        request_id_engine: whose body fields to send
            (:func:`~contextpilot_integrations.llm_call.engine_fields.engine_body_fields`):
            ``"openai"`` (default: ``prompt_cache_key``), ``"any"``, ``"sglang"``, ``"vllm"``,
            or ``"hosted"`` (none; the armed request is then left untaken).
        prompt_cache_retention: ``"in_memory"`` or ``"24h"``, sent with ``"openai"``.
        usage_tracker: where each planned response's usage is recorded, or ``None``.
        routing_header: the header a routed plan's ``routing_key`` goes in (self-hosted
            engines behind a gateway; never to a hosted API).
    """

    request_id_engine: EngineKind = Field(
        default="openai",
        description="Engine whose request-body fields carry the ContextPilot plan's fields.",
    )
    prompt_cache_retention: str | None = Field(
        default=None, description="OpenAI prompt_cache_retention sent with planned requests."
    )
    usage_tracker: Any = Field(
        default=None, exclude=True, description="CacheUsageTracker for planned responses."
    )
    routing_header: str = Field(
        default=ROUTING_HEADER,
        description="Header a routed ContextPilot plan's routing key is sent in (gateways).",
    )

    @classmethod
    def class_name(cls) -> str:
        return "ContextPilotOpenAI"

    def _with_request(self, kwargs: dict[str, Any], prompt_text: str) -> dict[str, Any]:
        if _REQUEST_KWARG in kwargs or self.request_id_engine == "hosted":
            return kwargs
        taken = take_pending(prompt_text)
        if taken is None:
            return kwargs
        return {**kwargs, _REQUEST_KWARG: taken}

    def _get_model_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        taken: PendingRequest | None = kwargs.pop(_REQUEST_KWARG, None)
        model_kwargs = super()._get_model_kwargs(**kwargs)
        if taken is None:
            return model_kwargs
        if self.request_id_engine != "openai":
            merged = with_engine_fields(model_kwargs, taken.rid, self.request_id_engine)
            headers = engine_headers(taken.plan, self.request_id_engine, self.routing_header)
            if headers:
                merged["extra_headers"] = {**(merged.get("extra_headers") or {}), **headers}
            return merged
        merged = with_engine_fields(model_kwargs, taken.plan or taken.rid, "openai")
        if self.prompt_cache_retention is not None:
            merged["extra_body"]["prompt_cache_retention"] = self.prompt_cache_retention
        return merged

    def _record(self, kwargs: dict[str, Any], response: Any) -> Any:
        taken = kwargs.get(_REQUEST_KWARG)
        if self.usage_tracker is not None and isinstance(taken, PendingRequest):
            self.usage_tracker.record(taken.rid, response)
        return response

    # --- entry points: take the armed request once, then delegate --------------------------
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        kwargs = self._with_request(kwargs, _text(messages))
        return self._record(kwargs, super().chat(messages, **kwargs))

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return super().stream_chat(messages, **self._with_request(kwargs, _text(messages)))

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        kwargs = self._with_request(kwargs, prompt)
        return self._record(kwargs, super().complete(prompt, formatted=formatted, **kwargs))

    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        return super().stream_complete(
            prompt, formatted=formatted, **self._with_request(kwargs, prompt)
        )

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        kwargs = self._with_request(kwargs, _text(messages))
        return self._record(kwargs, await super().achat(messages, **kwargs))

    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        return await super().astream_chat(messages, **self._with_request(kwargs, _text(messages)))

    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        kwargs = self._with_request(kwargs, prompt)
        return self._record(kwargs, await super().acomplete(prompt, formatted=formatted, **kwargs))

    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return await super().astream_complete(
            prompt, formatted=formatted, **self._with_request(kwargs, prompt)
        )


class ContextPilotOpenAILike(ContextPilotOpenAI, OpenAILike):
    """``OpenAILike`` (an OpenAI-compatible server: SGLang, vLLM) that sends the armed plan's
    request id with the next request: ``ContextPilotOpenAI`` with ``request_id_engine="any"``
    by default (``rid``, ``request_id``, ``session_id``), and ``OpenAILike``'s constructor
    (``model``, ``api_base``, ``api_key``, ``is_chat_model``, ``context_window``,
    ``additional_kwargs``, ...). An endpoint that rejects unknown body fields needs
    ``request_id_engine="hosted"``."""

    request_id_engine: EngineKind = Field(
        default="any",
        description="Engine whose request-body fields carry the ContextPilot request id.",
    )

    @classmethod
    def class_name(cls) -> str:
        return "ContextPilotOpenAILike"


def _text(messages: Sequence[ChatMessage]) -> str:
    """The messages' text contents joined (what the request's prompt shows)."""
    return "\n".join(m.content for m in messages if isinstance(m.content, str))
