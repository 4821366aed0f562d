"""``ContextPilotAnthropic``: LlamaIndex's ``Anthropic`` LLM with cache breakpoints from the plan.

Needs ``llama-index-llms-anthropic``. The plan is armed by the post-processor and the
ContextPilot templates (:mod:`.request_ids`); the ``chat`` call (sync, async, streaming; and
``complete``, which LlamaIndex's ``Anthropic`` sends through ``chat``) whose prompt shows the
plan's first block takes it once and sends the prompt as content blocks, one per rendered
document, with ``cache_control`` breakpoints placed by
:func:`contextpilot_integrations.llm_call.anthropic_breakpoints.anthropic_prompt`: after the
system prompt, after the prefix shared with indexed requests, where the conversation's earlier
turns end (the chat template renders them before this turn's documents) and, in a
conversation, after this turn's documents; at most four, none below the model's minimum
cacheable length (``cache_policy``; default by ``model``).

LlamaIndex's ``Anthropic`` flattens a system message into one string, which cannot carry a
breakpoint; when one belongs there (the chat template puts the documents in the system
message), the system blocks go in the request body's ``extra_body["system"]``, which the
anthropic SDK sends in place of that string (the same text, split into blocks). Other calls go
out unchanged. With ``usage_tracker`` each planned response's cache reads and writes
(``cache_read_input_tokens``, ``cache_creation_input_tokens``) are read back to the pilot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    CacheControl,
    CachePoint,
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import Field
from llama_index.llms.anthropic import Anthropic

from contextpilot_integrations.llama_index.request_ids import PendingRequest, take_pending
from contextpilot_integrations.llm_call.anthropic_breakpoints import (
    AnthropicCachePolicy,
    AnthropicPrompt,
    anthropic_prompt,
)
from contextpilot_integrations.llm_call.cache_prefix import CachePrefix

__all__ = ["ContextPilotAnthropic"]

_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
}


class ContextPilotAnthropic(Anthropic):
    """``Anthropic`` that places the armed plan's cache breakpoints on the next request.

    Same constructor as ``Anthropic`` (``model``, ``api_key``, ``base_url``, ``max_tokens``,
    ...), plus:

    Args:
        cache_policy: where breakpoints go and the limits
            (:class:`~contextpilot_integrations.llm_call.anthropic_breakpoints.AnthropicCachePolicy`;
            default: by ``model``).
        token_counter: counts prefix tokens against the minimum (default the approximate
            counter; give the pilot's).
        usage_tracker: where each planned response's usage is recorded, or ``None``.
    """

    cache_policy: Any = Field(default=None, exclude=True, description="AnthropicCachePolicy.")
    token_counter: Any = Field(default=None, exclude=True, description="Prefix token counter.")
    usage_tracker: Any = Field(
        default=None, exclude=True, description="CacheUsageTracker for planned responses."
    )

    def __init__(
        self,
        *,
        cache_policy: AnthropicCachePolicy | None = None,
        token_counter: Any = None,
        usage_tracker: Any = None,
        **kwargs: Any,
    ) -> None:
        # Anthropic's __init__ names its own arguments only: ours are set after it.
        super().__init__(**kwargs)
        self.cache_policy = cache_policy
        self.token_counter = token_counter
        self.usage_tracker = usage_tracker

    @classmethod
    def class_name(cls) -> str:
        return "ContextPilotAnthropic"

    def cache_prompt(
        self,
        messages: Sequence[ChatMessage],
        taken: PendingRequest | None,
        tools: Sequence[Any] = (),
    ) -> AnthropicPrompt | None:
        """The messages in Anthropic's block form with the plan's breakpoints; ``None`` when
        no plan was taken or a message is not plain text of the system, user or assistant.
        The ``cache_control`` markers on ``tools`` (what the call sends) count against the
        limit.

        Raises:
            ValueError: more markers on the tools and in the messages than the policy allows.
        """
        plan = taken.plan if taken is not None else None
        if plan is None:
            return None
        if any(m.role not in _ROLES or not _plain_text(m) for m in messages):
            return None
        policy = self.cache_policy or AnthropicCachePolicy(model=self.model)
        return anthropic_prompt(
            [{"role": _ROLES[m.role], "content": m.content or ""} for m in messages],
            CachePrefix.of(plan),
            policy,
            self.token_counter,
            tools=tools,
        )

    # --- entry points: take the armed plan once, then delegate -----------------------------
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        taken, messages, kwargs = self._prepare(messages, kwargs)
        return self._record(taken, super().chat(messages, **kwargs))

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        _, messages, kwargs = self._prepare(messages, kwargs)
        return super().stream_chat(messages, **kwargs)

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        taken, messages, kwargs = self._prepare(messages, kwargs)
        return self._record(taken, await super().achat(messages, **kwargs))

    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        _, messages, kwargs = self._prepare(messages, kwargs)
        return await super().astream_chat(messages, **kwargs)

    # --- internals -------------------------------------------------------------------------
    def _prepare(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> tuple[PendingRequest | None, Sequence[ChatMessage], dict[str, Any]]:
        taken = take_pending("\n".join(m.content or "" for m in messages if _plain_text(m)))
        prompt = self.cache_prompt(messages, taken, self._sent_tools(kwargs))
        if prompt is None:
            return taken, messages, kwargs
        out: list[ChatMessage] = []
        rest = iter(prompt.messages)
        for message in messages:
            if message.role == MessageRole.SYSTEM:
                out.append(message)
                continue
            blocks: list[Any] = []
            for block in next(rest)["content"]:
                blocks.append(TextBlock(text=block["text"]))
                if "cache_control" in block:
                    control = block["cache_control"]
                    blocks.append(
                        CachePoint(
                            cache_control=CacheControl(type=control["type"], ttl=_ttl(control))
                        )
                    )
            out.append(ChatMessage(role=message.role, blocks=blocks))
        if prompt.system is not None and any("cache_control" in b for b in prompt.system):
            extra = {**self.additional_kwargs.get("extra_body", {}), **kwargs.get("extra_body", {})}
            kwargs = {**kwargs, "extra_body": {**extra, "system": prompt.system}}
        return taken, out, kwargs

    def _sent_tools(self, kwargs: dict[str, Any]) -> list[Any]:
        """The tools the call sends, as ``Anthropic`` merges them: its ``tools`` field, then
        the call's (``chat_with_tools``), else those of ``additional_kwargs``."""
        given = kwargs["tools"] if "tools" in kwargs else self.additional_kwargs.get("tools")
        return [*(self.tools or ()), *(given or ())]

    def _record(self, taken: PendingRequest | None, response: Any) -> Any:
        if self.usage_tracker is not None and taken is not None:
            self.usage_tracker.record(taken.rid, response)
        return response


def _plain_text(message: ChatMessage) -> bool:
    return all(isinstance(b, TextBlock) for b in message.blocks)


def _ttl(control: dict[str, str]) -> str:
    return control.get("ttl", "5m")
