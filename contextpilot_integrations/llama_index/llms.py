"""``ContextPilotOpenAILike``: an ``OpenAILike`` LLM that sends each plan's request id.

Needs ``llama-index-llms-openai-like``. The mechanism is described in :mod:`.request_ids`: the
post-processor (and the ContextPilot templates) arm the plan's rid in the caller's context;
each ``chat``/``complete`` call (sync, async, streaming; the LlamaIndex entry points) whose
prompt shows the plan's first block takes it once, before the client's retries, and
``_get_model_kwargs`` merges the engine's request-id body fields
(:func:`contextpilot_integrations.engine_fields.with_engine_fields`) into the request body's
``extra_body``, on top of any ``extra_body`` the user set in ``additional_kwargs``. Calls that
take no request are sent unchanged. The fields default to SGLang's ``rid``, vLLM's
``request_id`` and ``session_id`` (``request_id_engine="any"``). An endpoint that rejects
unknown body fields (the hosted OpenAI API) needs ``request_id_engine="hosted"``, or the plain
``OpenAI`` class.
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
from llama_index.llms.openai_like import OpenAILike

from contextpilot_integrations.engine_fields import EngineKind, with_engine_fields

from .request_ids import take_request

__all__ = ["ContextPilotOpenAILike"]

# Per-call keyword argument carrying the taken request's rid from the public entry
# point down to _get_model_kwargs (through LlamaIndex's and the client's retry wrappers).
_REQUEST_KWARG = "contextpilot_request"


class ContextPilotOpenAILike(OpenAILike):
    """``OpenAILike`` that sends the armed ContextPilot request id with the next request.

    Same constructor as ``OpenAILike`` (``model``, ``api_base``, ``api_key``,
    ``is_chat_model``, ``context_window``, ``additional_kwargs``, ...), plus:

    Args:
        request_id_engine: whose body fields carry the rid
            (:func:`~contextpilot_integrations.engine_fields.engine_body_fields`): ``"any"``
            (default: ``rid``, ``request_id``, ``session_id``), ``"sglang"``, ``"vllm"``, or
            ``"hosted"`` (none; the armed request is then left untaken).
    """

    request_id_engine: EngineKind = Field(
        default="any",
        description="Engine whose request-body fields carry the ContextPilot request id.",
    )

    @classmethod
    def class_name(cls) -> str:
        return "ContextPilotOpenAILike"

    def _with_request(self, kwargs: dict[str, Any], prompt_text: str) -> dict[str, Any]:
        if _REQUEST_KWARG in kwargs or self.request_id_engine == "hosted":
            return kwargs
        rid = take_request(prompt_text)
        if rid is None:
            return kwargs
        return {**kwargs, _REQUEST_KWARG: rid}

    def _get_model_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        rid = kwargs.pop(_REQUEST_KWARG, None)
        model_kwargs = super()._get_model_kwargs(**kwargs)
        if rid is None:
            return model_kwargs
        return with_engine_fields(model_kwargs, rid, self.request_id_engine)

    # --- entry points: take the armed request once, then delegate --------------------------
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return super().chat(messages, **self._with_request(kwargs, _text(messages)))

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return super().stream_chat(messages, **self._with_request(kwargs, _text(messages)))

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return super().complete(prompt, formatted=formatted, **self._with_request(kwargs, prompt))

    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        return super().stream_complete(
            prompt, formatted=formatted, **self._with_request(kwargs, prompt)
        )

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await super().achat(messages, **self._with_request(kwargs, _text(messages)))

    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        return await super().astream_chat(messages, **self._with_request(kwargs, _text(messages)))

    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        return await super().acomplete(
            prompt, formatted=formatted, **self._with_request(kwargs, prompt)
        )

    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return await super().astream_complete(
            prompt, formatted=formatted, **self._with_request(kwargs, prompt)
        )


def _text(messages: Sequence[ChatMessage]) -> str:
    """The messages' text contents joined (what the request's prompt shows)."""
    return "\n".join(m.content for m in messages if isinstance(m.content, str))
