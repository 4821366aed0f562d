"""Scripted tool-calling chat models: deterministic agents for the agent replays.

Each model follows a script, the session's turns (:mod:`~contextpilot_bench.agent_sessions`):
on a model call the user messages in the prompt say which turn it is (the ``n``-th user message
is turn ``n``), the tool results after the last one which step, and the model either
makes the next of the turn's tool calls or gives the turn's fixed answer. So
every agent replaying a session makes the same calls with the same arguments whatever the
library did to the prompt, and a run is reproducible. Every call records what the model
received (the messages after every middleware, and the call keywords: tools,
``cache_control``), which is what the accounting reads.

- :class:`ScriptedChatModel`: a LangChain ``BaseChatModel`` (``bind_tools`` binds the tools in
  the OpenAI function format, what ``ChatOpenAI`` sends);
- :class:`ScriptedAnthropicModel`: the same script on ``ChatAnthropic`` (no request leaves the
  process), so ``AnthropicPromptCachingMiddleware`` accepts it and ``bind_tools`` converts the
  tools to Anthropic's format with their ``cache_control`` markers;
- :class:`ScriptedFunctionLLM`: a LlamaIndex ``FunctionCallingLLM`` for ``FunctionAgent``.

Tool call ids are ``call_<user turn>_<step>``: unique in a session, the same in every method.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_anthropic import ChatAnthropic
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.utils.function_calling import convert_to_openai_tool
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from pydantic import Field

from contextpilot_bench.agent_sessions import AgentTurn, ToolCall

__all__ = [
    "ReceivedCall",
    "ScriptedAnthropicModel",
    "ScriptedChatModel",
    "ScriptedFunctionLLM",
    "scripted_step",
]


@dataclass
class ReceivedCall:
    """One model call as the model received it: the messages and the call keywords."""

    messages: list[Any]
    kwargs: dict[str, Any] = field(default_factory=dict)


def scripted_step(
    script: Sequence[AgentTurn], user_messages: int, results_since_user: int
) -> tuple[str, ToolCall | None]:
    """The next step: ``(call id, call)`` for a tool call, or ``(answer, None)``.

    Args:
        script: the session's turns.
        user_messages: user messages in the prompt (the last is the current turn).
        results_since_user: tool results after the last user message.

    Raises:
        IndexError: more user messages than turns.
    """
    turn = script[user_messages - 1]
    if results_since_user < len(turn.calls):
        call_id = f"call_{user_messages}_{results_since_user + 1}"
        return call_id, turn.calls[results_since_user]
    return turn.answer, None


def _langchain_reply(script: Sequence[AgentTurn], messages: Sequence[BaseMessage]) -> AIMessage:
    users = [i for i, m in enumerate(messages) if isinstance(m, HumanMessage)]
    results = sum(1 for m in messages[users[-1] :] if isinstance(m, ToolMessage))
    first, step = scripted_step(script, len(users), results)
    if step is None:
        return AIMessage(content=first)
    call = {"name": step.name, "args": dict(step.arguments), "id": first, "type": "tool_call"}
    return AIMessage(content="", tool_calls=[call])


class ScriptedChatModel(BaseChatModel):
    """A LangChain chat model that follows ``script`` and records each call in ``calls``."""

    script: tuple[AgentTurn, ...]
    calls: list[ReceivedCall] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "contextpilot-bench-scripted"

    def bind_tools(
        self, tools: Sequence[Any], *, tool_choice: Any = None, **kwargs: Any
    ) -> Runnable[LanguageModelInput, AIMessage]:
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        self.calls.append(ReceivedCall(list(messages), dict(kwargs)))
        return ChatResult(
            generations=[ChatGeneration(message=_langchain_reply(self.script, messages))]
        )


class ScriptedAnthropicModel(ChatAnthropic):
    """``ChatAnthropic`` answering from ``script`` instead of the API (records ``calls``)."""

    script: tuple[AgentTurn, ...] = ()
    calls: list[ReceivedCall] = Field(default_factory=list)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        self.calls.append(ReceivedCall(list(messages), dict(kwargs)))
        return ChatResult(
            generations=[ChatGeneration(message=_langchain_reply(self.script, messages))]
        )


class ScriptedFunctionLLM(FunctionCallingLLM):
    """A LlamaIndex function-calling LLM that follows ``script`` and records each call's
    messages (``calls``; ``kwargs`` holds nothing)."""

    _script: tuple[AgentTurn, ...] = PrivateAttr(default=())
    _calls: list[ReceivedCall] = PrivateAttr(default_factory=list)

    def __init__(self, script: Sequence[AgentTurn], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._script = tuple(script)

    @property
    def calls(self) -> list[ReceivedCall]:
        return self._calls

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(is_function_calling_model=True, model_name="scripted")

    def _respond(self, messages: Sequence[ChatMessage]) -> ChatResponse:
        self._calls.append(ReceivedCall(list(messages)))
        users = [i for i, m in enumerate(messages) if m.role == MessageRole.USER]
        results = sum(1 for m in messages[users[-1] :] if m.role == MessageRole.TOOL)
        first, step = scripted_step(self._script, len(users), results)
        if step is None:
            return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=first))
        call = ToolCallBlock(
            tool_call_id=first, tool_name=step.name, tool_kwargs=dict(step.arguments)
        )
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, blocks=[call]))

    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._respond(messages)

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._respond(messages)

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        yield self._respond(messages)

    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        response = self._respond(messages)

        async def gen() -> ChatResponseAsyncGen:
            yield response

        return gen()

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return CompletionResponse(text="")

    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        yield CompletionResponse(text="", delta="")

    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        return CompletionResponse(text="")

    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        async def gen() -> CompletionResponseAsyncGen:
            yield CompletionResponse(text="", delta="")

        return gen()

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg))
        elif user_msg is not None:
            messages.append(user_msg)
        return {"messages": messages, "tools": tools}

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        return [
            ToolSelection(
                tool_id=b.tool_call_id or "",
                tool_name=b.tool_name,
                tool_kwargs=b.tool_kwargs if isinstance(b.tool_kwargs, dict) else {},
            )
            for b in response.message.blocks
            if isinstance(b, ToolCallBlock)
        ]
