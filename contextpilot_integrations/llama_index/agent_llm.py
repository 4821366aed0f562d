"""``ContextPilotAgentLLM``: a function-calling LLM for LlamaIndex agents whose every call's
messages are planned by a :class:`~contextpilot_integrations.core.messages.MessagePlanner`.

Wrapping the agent's LLM is the only change an app makes::

    llm = OpenAILike(model=..., api_base=..., is_function_calling_model=True)
    pilot_llm = ContextPilotAgentLLM(llm, tenant="acme")
    agent = FunctionAgent(llm=pilot_llm.for_conversation(session_id), tools=[search_tool])
    await agent.run("...", memory=memory_of(session_id))

Why a wrapped LLM (and not the node post-processor): an agent's retrieval runs inside its
tools, and what the tools return reaches the model as tool messages of the agent's history,
sent again on every call of the loop. A node post-processor sees the nodes of one retrieval
and the query, never the history the model is sent, so it cannot point at an earlier tool
result, cannot keep the history byte-stable, and its turn-visibility rules do not apply to a
loop whose "turns" are tool calls. The LLM is the one object a ``FunctionAgent`` (and an
``AgentWorkflow``) sends the whole history through, on every step (docs/DESIGN.md,
"LlamaIndex").

On each chat call (``chat``, ``achat``, ``stream_chat``, ``astream_chat`` and their
``*_with_tools`` forms, the ones ``FunctionAgent`` calls: ``astream_chat_with_tools`` when
streaming, the default, else ``achat_with_tools``) it

1. converts the messages (for the ``*_with_tools`` forms ``chat_history`` with ``user_msg``
   appended) to OpenAI-shape dicts: ``system``/``developer``/``user`` as they are, ``assistant``
   with its tool calls (the ``ToolCallBlock`` blocks, else ``additional_kwargs["tool_calls"]``;
   arguments a str as given, a dict as ``json.dumps(arguments)``, the form
   ``llama-index-llms-openai`` sends, so a pointer names the call as the model saw it),
   ``tool`` messages with ``additional_kwargs["tool_call_id"]``. The content is a str for
   one text block (or none), else a list of parts (text blocks as text parts, any other block
   as a part of its ``block_type``, which the planner passes through). A tool message without a
   call id, and a message of any other role, is context the planner never rewrites;
2. plans them (:meth:`MessagePlanner.plan`: earlier messages replayed exactly as they were
   sent, repeated tool results and documents in new tool messages replaced by checked
   pointers) under the scope ``(tenant, conversation_id)``, and converts back: only the tool
   messages whose text changed become copies (one ``TextBlock`` with the sent text,
   ``additional_kwargs`` kept); every other message is passed on as the same object;
3. calls the wrapped LLM with the planned messages (the ``*_with_tools`` forms through the
   wrapped LLM's own ``*_with_tools``, so its tool preparation and response checks apply);
4. logs one INFO line and adds to the totals of :meth:`ContextPilotAgentLLM.stats`.

The conversation: ``conversation_id`` of the constructor, or a bound copy per conversation
from :meth:`ContextPilotAgentLLM.for_conversation` (sharing the planner and the totals; one
per chat session, e.g. one ``FunctionAgent`` per session, or per ``agent.run``). Without one,
every call is planned alone: pointers still stand in for output repeated inside the history
it is sent, and the same history plans the same way (deterministic), but nothing is
remembered, so an edited history is planned as new, and no two conversations ever share
memory (docs/DESIGN.md, "Isolation").

Tools: a result repeated whole becomes a pointer whatever its form; a document repeated inside
a new result only when the result labels its documents in a layout
:mod:`contextpilot_integrations.core.messages.documents` reads (``[1] ...`` blocks separated by
blank lines, a JSON list of objects with a ``"text"`` field, ``<document>`` tags). A
``RetrieverTool`` joins the nodes' texts without labels, so only its whole results are
pointed at; a ``FunctionTool`` that renders its nodes as ``[n] text`` gets both.

A history the planner refuses (a shape it cannot read, arguments JSON cannot render) is sent
unchanged, with a warning (docs/DESIGN.md, "Never break a request"). The agent's memory and
scratchpad are never changed: they keep the tool output as the tools returned it, and the
planner's memory maps it to what was sent. Calls without messages (``complete`` and its
forms) and everything else (``metadata``, ``get_tool_calls_from_response``,
``_prepare_chat_with_tools``, ``_validate_chat_with_tools_response``) go to the wrapped LLM
unchanged; a caller that prepares with ``_prepare_chat_with_tools`` and then calls ``chat``
gets its messages planned once, in ``chat``.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

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
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.core.messages import MessagePlan, MessagePlanner
from contextpilot_integrations.core.request import Scope

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

__all__ = ["ContextPilotAgentLLM"]

logger = logging.getLogger(__name__)

_STAT_KEYS = ("calls", "messages", "replayed", "tokens_removed", "pointers", "new_pointers")
_PLANNED_ROLES = ("system", "developer", "user", "assistant")
_OTHER_ROLE_KEY = "llama_index_role"
"""Marks a message of a role the planner does not read (sent as a user message the planner
never rewrites; the key keeps it from matching a user message with the same content)."""


class _Totals:
    """Running totals of planned calls, overall and per conversation (shared by bound copies).

    Conversations are keyed by (tenant, conversation id): copies bound to two tenants that use
    the same id are two conversations."""

    def __init__(self, max_conversations: int) -> None:
        self.lock = threading.Lock()
        self.totals = dict.fromkeys(_STAT_KEYS, 0)
        self.conversations: LRU[tuple[str, str], dict[str, int]] = LRU(max_conversations)

    def add(self, conversation: tuple[str, str] | None, plan: MessagePlan) -> dict[str, int]:
        pointers = plan.pointers
        figures = {
            "calls": 1,
            "messages": len(plan.messages),
            "replayed": plan.replayed,
            "tokens_removed": plan.tokens_removed,
            "pointers": len(pointers),
            "new_pointers": sum(1 for p in pointers if not p.replayed),
        }
        with self.lock:
            for key, value in figures.items():
                self.totals[key] += value
            if conversation is not None:
                totals = self.conversations.get(conversation)
                if totals is None:
                    totals = dict.fromkeys(_STAT_KEYS, 0)
                    self.conversations.put(conversation, totals)
                for name, value in figures.items():
                    totals[name] += value
        return figures

    def stats(self) -> dict[str, Any]:
        with self.lock:
            out: dict[str, Any] = dict(self.totals)
            conversations: dict[str, dict[str, dict[str, int]]] = {}
            for (tenant, conversation_id), totals in self.conversations.items():
                conversations.setdefault(tenant, {})[conversation_id] = dict(totals)
        out["conversations"] = conversations
        return out


class ContextPilotAgentLLM(FunctionCallingLLM):
    """A function-calling LLM that plans every chat call's messages (see the module docstring).

    Args:
        llm: the wrapped ``FunctionCallingLLM`` (``OpenAI``, ``OpenAILike`` with
            ``is_function_calling_model=True``, ``Anthropic``, ...); it makes every call.
        planner: the planner (default a new ``MessagePlanner()``); shared by the copies from
            :meth:`for_conversation`. Share one between wrappers only with distinct tenants or
            conversation ids.
        tenant: the owner of the conversations (str; tenants never share memory).
        conversation_id: the conversation every call belongs to; ``None``: none, each call is
            planned alone.
        max_conversations: conversations whose totals :meth:`stats` keeps (LRU, ``int >= 1``).

    Raises:
        TypeError: ``llm`` is not a ``FunctionCallingLLM`` (a wrapper is refused: it would plan
            twice), or ``planner`` is not a MessagePlanner.
        ValueError / TypeError: a bad ``tenant`` or ``conversation_id`` (from :class:`Scope`,
            naming the field), or a bad ``max_conversations``.
    """

    conversation_id: str | None = Field(
        default=None, description="Conversation every call belongs to (None: planned alone)."
    )
    tenant: str = Field(default="", description="Owner of the conversation.")

    _llm: FunctionCallingLLM = PrivateAttr()
    _planner: MessagePlanner = PrivateAttr()
    _scope: Scope | None = PrivateAttr()
    _totals: _Totals = PrivateAttr()

    def __init__(
        self,
        llm: FunctionCallingLLM,
        *,
        planner: MessagePlanner | None = None,
        tenant: str = "",
        conversation_id: str | None = None,
        max_conversations: int = 10_000,
        **kwargs: Any,
    ) -> None:
        if not isinstance(llm, FunctionCallingLLM) or isinstance(llm, ContextPilotAgentLLM):
            raise TypeError(
                "llm must be a FunctionCallingLLM that is not a ContextPilotAgentLLM, got "
                f"{type(llm).__name__}"
            )
        if planner is not None and not isinstance(planner, MessagePlanner):
            raise TypeError(f"planner must be a MessagePlanner, got {type(planner).__name__}")
        if (
            isinstance(max_conversations, bool)
            or not isinstance(max_conversations, int)
            or max_conversations < 1
        ):
            raise ValueError(f"max_conversations must be an int >= 1, got {max_conversations!r}")
        scope = Scope(conversation_id=conversation_id, tenant=tenant)
        super().__init__(conversation_id=conversation_id, tenant=tenant, **kwargs)
        self._llm = llm
        self._planner = planner if planner is not None else MessagePlanner()
        self._scope = scope if conversation_id is not None else None
        self._totals = _Totals(max_conversations)

    @classmethod
    def class_name(cls) -> str:
        return "ContextPilotAgentLLM"

    # ------------------------------------------------------------------ accessors
    @property
    def llm(self) -> FunctionCallingLLM:
        """The wrapped LLM."""
        return self._llm

    @property
    def planner(self) -> MessagePlanner:
        """The planner (shared by every copy from :meth:`for_conversation`)."""
        return self._planner

    @property
    def metadata(self) -> LLMMetadata:
        return self._llm.metadata

    def for_conversation(
        self, conversation_id: str | None = None, *, tenant: str | None = None
    ) -> ContextPilotAgentLLM:
        """A copy bound to one conversation, sharing this one's LLM, planner and totals (and
        its other settings).

        Args:
            conversation_id: the conversation; ``None`` for a new unique one.
            tenant: its tenant; ``None`` keeps this wrapper's.

        Raises:
            TypeError / ValueError: an invalid id or tenant (from :class:`Scope`).
        """
        if conversation_id is None:
            conversation_id = f"conversation-{uuid.uuid4().hex}"
        tenant = self.tenant if tenant is None else tenant
        scope = Scope(conversation_id=conversation_id, tenant=tenant)
        # A shallow copy: the LLM's own settings, and the same LLM, planner and totals.
        bound = self.model_copy(update={"conversation_id": conversation_id, "tenant": tenant})
        bound._scope = scope
        return bound

    def stats(self) -> dict[str, Any]:
        """Running totals over every planned call of this wrapper and its bound copies.

        Returns:
            ``{"calls", "messages", "replayed", "tokens_removed", "pointers", "new_pointers",
            "conversations": {tenant: {conversation_id: {same keys but conversations}}}}``: calls
            planned, messages sent, of those replayed, tokens the sent messages save against
            the given ones (the planner's token counter, summed over calls), pointers in the
            sent messages and of those made on that call; the most recent
            ``max_conversations`` conversations.
        """
        return self._totals.stats()

    # ------------------------------------------------------------------ planning
    def plan_messages(self, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
        """``messages`` as they are sent: planned under this wrapper's conversation, only the
        changed tool messages copied (module docstring, steps 1-2). Recorded in the
        planner's memory and the totals: call it once per LLM call."""
        given = list(messages)
        try:
            dicts = [_to_openai(message) for message in given]
            plan = self._planner.plan(dicts, scope=self._scope, api="openai")
        except (TypeError, ValueError) as error:
            logger.warning(
                "contextpilot: conversation %r sent unplanned: %s",
                self.conversation_id,
                error,
                exc_info=False,
            )
            return given
        sent = [
            _sent_message(message, before, after)
            for message, before, after in zip(given, dicts, plan.messages, strict=True)
        ]
        scope = self._scope
        figures = self._totals.add(scope.conversation if scope is not None else None, plan)
        logger.info(
            "contextpilot: tenant=%r conversation=%r messages=%d replayed=%d tokens_removed=%d "
            "pointers=%d new_pointers=%d",
            self.tenant,
            self.conversation_id,
            figures["messages"],
            plan.replayed,
            plan.tokens_removed,
            figures["pointers"],
            figures["new_pointers"],
        )
        return sent

    def _planned_history(
        self, chat_history: Sequence[ChatMessage] | None, user_msg: str | ChatMessage | None
    ) -> list[ChatMessage]:
        history = list(chat_history or ())
        if isinstance(user_msg, str):
            history.append(ChatMessage(role=MessageRole.USER, content=user_msg))
        elif user_msg is not None:
            history.append(user_msg)
        return self.plan_messages(history)

    # ------------------------------------------------------------------ chat
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._llm.chat(self.plan_messages(messages), **kwargs)

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await self._llm.achat(self.plan_messages(messages), **kwargs)

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._llm.stream_chat(self.plan_messages(messages), **kwargs)

    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        return await self._llm.astream_chat(self.plan_messages(messages), **kwargs)

    # ------------------------------------------------------------------ chat with tools
    def chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        return self._llm.chat_with_tools(
            tools,
            chat_history=self._planned_history(chat_history, user_msg),
            verbose=verbose,
            allow_parallel_tool_calls=allow_parallel_tool_calls,
            tool_required=tool_required,
            **kwargs,
        )

    async def achat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        return await self._llm.achat_with_tools(
            tools,
            chat_history=self._planned_history(chat_history, user_msg),
            verbose=verbose,
            allow_parallel_tool_calls=allow_parallel_tool_calls,
            tool_required=tool_required,
            **kwargs,
        )

    def stream_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> ChatResponseGen:
        return self._llm.stream_chat_with_tools(
            tools,
            chat_history=self._planned_history(chat_history, user_msg),
            verbose=verbose,
            allow_parallel_tool_calls=allow_parallel_tool_calls,
            tool_required=tool_required,
            **kwargs,
        )

    async def astream_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> ChatResponseAsyncGen:
        return await self._llm.astream_chat_with_tools(
            tools,
            chat_history=self._planned_history(chat_history, user_msg),
            verbose=verbose,
            allow_parallel_tool_calls=allow_parallel_tool_calls,
            tool_required=tool_required,
            **kwargs,
        )

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        # Not planned here: the caller sends the prepared messages through chat, which plans.
        return self._llm._prepare_chat_with_tools_compat(
            tools,
            user_msg=user_msg,
            chat_history=chat_history,
            verbose=verbose,
            allow_parallel_tool_calls=allow_parallel_tool_calls,
            tool_required=tool_required,
            **kwargs,
        )

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[BaseTool],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        return self._llm._validate_chat_with_tools_response(
            response, tools, allow_parallel_tool_calls=allow_parallel_tool_calls, **kwargs
        )

    def get_tool_calls_from_response(
        self,
        response: ChatResponse,
        error_on_no_tool_call: bool = True,
        **kwargs: Any,
    ) -> list[ToolSelection]:
        return self._llm.get_tool_calls_from_response(
            response, error_on_no_tool_call=error_on_no_tool_call, **kwargs
        )

    # ------------------------------------------------------------------ completion (unplanned)
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._llm.complete(prompt, formatted=formatted, **kwargs)

    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        return self._llm.stream_complete(prompt, formatted=formatted, **kwargs)

    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        return await self._llm.acomplete(prompt, formatted=formatted, **kwargs)

    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return await self._llm.astream_complete(prompt, formatted=formatted, **kwargs)


# ---------------------------------------------------------------------------------- conversion
def _to_openai(message: ChatMessage) -> dict[str, Any]:
    """One LlamaIndex message as an OpenAI chat message dict (module docstring, step 1).

    Raises:
        TypeError / ValueError: tool-call arguments that JSON cannot render.
    """
    role = message.role.value
    if role == "tool":
        call_id = message.additional_kwargs.get("tool_call_id")
        content = _content(message.blocks)
        if isinstance(call_id, str) and call_id:
            return {"role": "tool", "tool_call_id": call_id, "content": content}
        return {"role": "user", "content": content, _OTHER_ROLE_KEY: role}
    if role not in _PLANNED_ROLES:
        return {"role": "user", "content": _content(message.blocks), _OTHER_ROLE_KEY: role}
    if role != "assistant":
        return {"role": role, "content": _content(message.blocks)}
    calls = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
    out: dict[str, Any] = {
        "role": "assistant",
        "content": _content([b for b in message.blocks if not isinstance(b, ToolCallBlock)]),
    }
    if calls:
        out["tool_calls"] = [
            _call(b.tool_call_id, b.tool_name, b.tool_kwargs, "function") for b in calls
        ]
    elif message.additional_kwargs.get("tool_calls"):
        out["tool_calls"] = [_raw_call(c) for c in message.additional_kwargs["tool_calls"]]
    return out


def _call(call_id: Any, name: Any, arguments: Any, kind: Any) -> dict[str, Any]:
    """One OpenAI tool call; arguments a str as given, anything else as ``json.dumps``."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {})
    return {
        "id": call_id if isinstance(call_id, str) else "",
        "type": kind if isinstance(kind, str) else "function",
        "function": {"name": name if isinstance(name, str) else "", "arguments": arguments},
    }


def _raw_call(call: Any) -> dict[str, Any]:
    """A call of ``additional_kwargs["tool_calls"]``: a dict, or an object with the same
    attributes (the OpenAI client's ``ChatCompletionMessageToolCall``)."""
    if isinstance(call, Mapping):
        function = call.get("function") or {}
        name = function.get("name") if isinstance(function, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        return _call(call.get("id"), name, arguments, call.get("type"))
    function = getattr(call, "function", None)
    return _call(
        getattr(call, "id", None),
        getattr(function, "name", None),
        getattr(function, "arguments", None),
        getattr(call, "type", None),
    )


def _content(blocks: Sequence[Any]) -> str | list[dict[str, Any]]:
    """Blocks as OpenAI content: one text block (or none) a str, else a list of parts."""
    if not blocks:
        return ""
    if len(blocks) == 1 and isinstance(blocks[0], TextBlock):
        return blocks[0].text
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        else:
            parts.append({"type": str(block.block_type), "value": _block_value(block)})
    return parts


def _block_value(block: Any) -> str:
    """A non-text block's serialisation: it only tells the planner whether the block changed
    between calls."""
    try:
        return str(block.model_dump_json())
    except (TypeError, ValueError):
        return repr(block)


def _sent_message(message: ChatMessage, given: dict[str, Any], sent: dict[str, Any]) -> ChatMessage:
    """``message`` itself, or for a one-text-block tool message whose text the plan changed a
    copy with the sent text."""
    if sent == given:
        return message
    text = sent.get("content")
    single = not message.blocks or (
        len(message.blocks) == 1 and isinstance(message.blocks[0], TextBlock)
    )
    if message.role != MessageRole.TOOL or not isinstance(text, str) or not single:
        # The planner rewrites tool results only; anything else is sent as the app gave it.
        logger.warning(
            "contextpilot: unexpected change to a %s message ignored", message.role.value
        )
        return message
    return message.model_copy(
        update={
            "blocks": [TextBlock(text=text)],
            "additional_kwargs": dict(message.additional_kwargs),
        }
    )
