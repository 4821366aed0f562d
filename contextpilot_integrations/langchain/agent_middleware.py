"""An agent middleware for ``langchain.agents.create_agent``: every model call's messages planned
by a :class:`~contextpilot_integrations.core.messages.MessagePlanner`, with the engine's request
fields added.

Adding it is the only change an app makes::

    agent = create_agent(model, tools, middleware=[ContextPilotMiddleware(tenant="acme")],
                         checkpointer=InMemorySaver())
    agent.invoke({"messages": [...]}, {"configurable": {"thread_id": "t-1"}})

On each model call (``wrap_model_call`` / ``awrap_model_call``) it

1. takes the conversation from the agent's thread (``runtime.execution_info.thread_id``, else
   ``configurable.thread_id`` of the run's config) and the tenant from the constructor. A call
   without a thread has no memory across calls: each is planned alone, never under a shared
   default conversation (docs/DESIGN.md, "Isolation");
2. converts the request's messages (the system message first) to OpenAI-shape dicts: system,
   human, AI with its ``tool_calls`` (arguments as ``json.dumps(args, ensure_ascii=False)``,
   the form ``ChatOpenAI`` sends, so a pointer names the call as the model saw it), tool
   messages with their ``tool_call_id``; str or list content;
3. plans them (:meth:`MessagePlanner.plan`: earlier messages replayed exactly as they were
   sent, repeated tool results and documents in new tool messages replaced by checked
   pointers) and converts back: only the tool messages whose text changed become new objects
   (``model_copy``: id, name, artifact, status and metadata kept); every other message is
   passed on as the same object, so nothing before the first new message changes;
4. adds the engine's request fields through ``model_settings`` (what ``create_agent`` binds as
   call keywords), by ``engine``:

   - ``"openai-compatible"`` (SGLang, vLLM, any server behind ``ChatOpenAI(base_url=...)``):
     ``extra_body`` gets a new rid per call as
     :func:`~contextpilot_integrations.llm_call.engine_fields.engine_body_fields` builds it
     (``rid``, ``request_id``, ``session_id``) and the tenant's ``cache_salt`` when given,
     merged over the model's own ``extra_body`` and the settings' (a call keyword replaces
     the model's field, so both are merged here);
   - ``"openai"`` (the hosted API): ``prompt_cache_key`` per conversation
     (:func:`~contextpilot_integrations.llm_call.openai_cache_key.openai_cache_fields` of the
     conversation's hash and the salt), so every call of a conversation is routed to the
     machine holding its prefix; no key without a thread;
   - ``"anthropic"``: a ``cache_control`` breakpoint on the newest stable prefix, the last
     replayed message (it went out before exactly as it goes out on this call, so the prefix
     it closes is the one the library knows is sent again), and one on the last message (the
     call's new messages are written to the cache now and read by the next call; left to
     ``AnthropicPromptCachingMiddleware`` when its ``cache_control`` keyword marks the tail),
     each when its prefix holds the model's minimum cacheable length and fewer than four
     breakpoints stand in the request,
     counting the app's own markers in the system message and messages, those on tools
     (``BaseTool.extras`` or a tool dict) and a ``cache_control`` call keyword
     (``AnthropicPromptCachingMiddleware``'s, one slot). The marker goes on a copy of that
     message: a str content becomes one text block (what ``ChatAnthropic`` sends for it), a
     tool message's content one ``tool_result`` block around its unchanged content (the
     block ``ChatAnthropic`` builds for it);
   - ``"none"``: nothing (planning only);
5. logs one INFO line (conversation, messages replayed, tokens removed, pointers) and adds to
   the running totals of :meth:`ContextPilotMiddleware.stats`.

A request the planner refuses (a message shape it cannot read) is sent unchanged, with a
warning (docs/DESIGN.md, "Never break a request"). The agent's state is never changed: the
checkpointer keeps the messages as the tools returned them, and the planner's memory maps them
to what was sent.

Order against LangChain's own middleware (``middleware=[...]`` runs its ``wrap_model_call``
hooks outermost first): the library must see the messages exactly as they will be sent, so
everything that changes them runs before it.

- ``SummarizationMiddleware`` runs in ``before_model`` and replaces the state's history; it
  runs before every ``wrap_model_call`` whatever the list order. The planner sees the summary
  where the history diverges and plans everything from there as new: no pointer names a
  message the summary replaced.
- ``ContextEditingMiddleware`` edits the request in ``wrap_model_call``: list it **before**
  this middleware (outer). Then a cleared tool result is a divergence, and a later result that
  pointed at it is sent in full. Listed after (inner), it would clear the result a pointer
  names after the pointer was checked: the pointer would dangle. So every model call that
  carries a pointer is watched (a callback handler on the call, :class:`_SentCheck`): when
  the messages the model is about to get are not the ones planned, the call is stopped
  before it is sent, a warning names the order, and this middleware plans nothing more: the
  call and every later one go out with the messages the agent gave (docs/DESIGN.md,
  "LangChain"). Any middleware listed after it that changes the messages is caught the same
  way.
- ``AnthropicPromptCachingMiddleware`` (``engine="anthropic"``): list it **before** this
  middleware (outer). Its markers (system message, last tool, the ``cache_control`` keyword
  for the message tail) are then in the request this middleware counts against the limit of
  four, and stand in the fingerprints of the messages the planner remembers the same way on
  every call.

Why a middleware and not a model wrapper: an agent's model call is the one place that sees the
request after every other middleware has shaped it, together with the agent's thread; a
wrapped chat model sees only messages, with no conversation to plan them under
(docs/DESIGN.md, "LangChain").
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, Literal

from langchain.agents.middleware.types import (
    AgentMiddleware,
    ModelCallResult,
    ModelRequest,
    ModelResponse,
)
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import BaseTool
from langchain_core.tracers.context import register_configure_hook

from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.core.messages import MessagePlan, MessagePlanner
from contextpilot_integrations.core.request import Scope, new_rid
from contextpilot_integrations.llm_call.anthropic_breakpoints import (
    ANTHROPIC_MAX_BREAKPOINTS,
    AnthropicCachePolicy,
)
from contextpilot_integrations.llm_call.cache_prefix import CachePrefix
from contextpilot_integrations.llm_call.engine_fields import with_engine_fields
from contextpilot_integrations.llm_call.openai_cache_key import openai_cache_fields

__all__ = ["AgentEngine", "ContextPilotMiddleware"]

logger = logging.getLogger(__name__)

AgentEngine = Literal["openai-compatible", "openai", "anthropic", "none"]
_ENGINES: tuple[AgentEngine, ...] = ("openai-compatible", "openai", "anthropic", "none")

_STAT_KEYS = ("calls", "messages", "replayed", "tokens_removed", "pointers", "new_pointers")


@dataclass(frozen=True, slots=True)
class _CallIds:
    """What :func:`engine_body_fields` reads of a plan: one model call's rid and salt."""

    rid: str
    cache_salt: str | None


class _ChangedAfterPlanning(BaseException):
    """A middleware inside this one changed the planned messages (module docstring).

    A ``BaseException``, as a cancellation is: LangChain's callback manager logs every
    ``Exception`` a handler raises as a callback error before passing it on, and a middleware
    between this one and the model that retries on ``Exception`` would send the call again;
    this stop passes both untouched up to :class:`_Watching`, which ends it."""


class _SentCheck(BaseCallbackHandler):
    """Stops the model call that carries the planned messages when they are not what the
    model is about to get. ``sent``: the planned messages (the system message first);
    ``changed``: those the plan rewrote (pointers), by which the agent's call is told from
    any other model call made inside it."""

    raise_error = True
    run_inline = True

    def __init__(self, sent: Sequence[BaseMessage], changed: Sequence[BaseMessage]) -> None:
        self.sent = list(sent)
        self.changed = list(changed)

    def on_chat_model_start(
        self, serialized: dict[str, Any], messages: list[list[BaseMessage]], **kwargs: Any
    ) -> None:
        for batch in messages:
            if not any(_holds(batch, message) for message in self.changed):
                continue  # another model's call, or no pointer left in it
            if len(batch) != len(self.sent) or not all(
                _same(given, planned) for given, planned in zip(batch, self.sent, strict=True)
            ):
                raise _ChangedAfterPlanning


_SENT_CHECK: ContextVar[_SentCheck | None] = ContextVar("contextpilot_sent_check", default=None)
register_configure_hook(_SENT_CHECK, inheritable=True)


class _Watching:
    """``with``: the model calls inside are checked by ``check`` (``None``: not checked);
    ``changed`` says whether one was stopped (its exception is absorbed)."""

    def __init__(self, check: _SentCheck | None) -> None:
        self._check = check
        self._token: Token[_SentCheck | None] | None = None
        self.changed = False

    def __enter__(self) -> _Watching:
        if self._check is not None:
            self._token = _SENT_CHECK.set(self._check)
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> bool:
        if self._token is not None:
            _SENT_CHECK.reset(self._token)
        self.changed = kind is not None and issubclass(kind, _ChangedAfterPlanning)
        return self.changed


class ContextPilotMiddleware(AgentMiddleware):  # type: ignore[type-arg]
    """Plans every model call of an agent (see the module docstring).

    Args:
        tenant: the owner of the agent's conversations (str; conversations of different
            tenants never share memory or cache keys).
        planner: the planner (default a new ``MessagePlanner()``); share one between
            middlewares only with distinct tenants or threads.
        engine: ``"openai-compatible"`` (default), ``"openai"``, ``"anthropic"`` or ``"none"``
            (the fields each adds: module docstring).
        cache_salt: the tenant's ``cache_salt`` for an ``"openai-compatible"`` engine's prefix
            cache, and the salt of the ``"openai"`` cache key; ``None``: none.
        prompt_cache_retention: ``engine="openai"``: ``"in_memory"`` or ``"24h"``, sent as
            ``prompt_cache_retention``; ``None``: not sent.
        cache_policy: ``engine="anthropic"``: the breakpoint's TTL, the most breakpoints and
            the minimum cacheable prefix (default: by the request model's ``model`` field).
        max_conversations: conversations whose totals :meth:`stats` keeps (LRU, ``int >= 1``).

    Raises:
        ValueError: an unknown ``engine`` or ``prompt_cache_retention``, a ``tenant`` or
            ``cache_salt`` that is not a str, a ``planner`` that is not a MessagePlanner, or a
            bad ``max_conversations``.
    """

    def __init__(
        self,
        *,
        tenant: str = "",
        planner: MessagePlanner | None = None,
        engine: AgentEngine = "openai-compatible",
        cache_salt: str | None = None,
        prompt_cache_retention: Literal["in_memory", "24h"] | None = None,
        cache_policy: AnthropicCachePolicy | None = None,
        max_conversations: int = 10_000,
    ) -> None:
        super().__init__()
        if engine not in _ENGINES:
            raise ValueError(
                f"engine must be one of {', '.join(map(repr, _ENGINES))}, got {engine!r}"
            )
        if not isinstance(tenant, str):
            raise ValueError(f"tenant must be a str, got {type(tenant).__name__}: {tenant!r:.80}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty str or None, got {cache_salt!r:.80}")
        if prompt_cache_retention not in (None, "in_memory", "24h"):
            raise ValueError(
                "prompt_cache_retention must be 'in_memory', '24h' or None, got "
                f"{prompt_cache_retention!r}"
            )
        if planner is not None and not isinstance(planner, MessagePlanner):
            raise ValueError(f"planner must be a MessagePlanner, got {type(planner).__name__}")
        if cache_policy is not None and not isinstance(cache_policy, AnthropicCachePolicy):
            raise ValueError(
                f"cache_policy must be an AnthropicCachePolicy, got {type(cache_policy).__name__}"
            )
        if (
            isinstance(max_conversations, bool)
            or not isinstance(max_conversations, int)
            or max_conversations < 1
        ):
            raise ValueError(f"max_conversations must be an int >= 1, got {max_conversations!r}")
        self.tenant = tenant
        self.planner = planner or MessagePlanner()
        self.engine: AgentEngine = engine
        self.cache_salt = cache_salt
        self.prompt_cache_retention = prompt_cache_retention
        self.cache_policy = cache_policy
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(_STAT_KEYS, 0)
        # Keyed by (tenant, thread id): the same thread id of two tenants is two conversations.
        self._conversations: LRU[tuple[str, str], dict[str, int]] = LRU(max_conversations)
        self._stopped = False

    # ------------------------------------------------------------------ hooks
    def wrap_model_call(
        self,
        request: ModelRequest,
        handler: Callable[[ModelRequest], ModelResponse],
    ) -> ModelCallResult:
        """Plan ``request``'s messages, add the engine fields, call ``handler`` (the given
        messages instead, from then on, when a middleware inside changes the planned ones:
        module docstring)."""
        planned, check, plan = self._planned(request)
        with _Watching(check) as watch:
            answer = handler(planned)
        if watch.changed:
            return handler(self._stop_planning(request))
        self._record(plan)  # counted once sent as planned
        return answer

    async def awrap_model_call(
        self,
        request: ModelRequest,
        handler: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelCallResult:
        """:meth:`wrap_model_call` for the async agent (planning is bounded work, done inline)."""
        planned, check, plan = self._planned(request)
        with _Watching(check) as watch:
            answer = await handler(planned)
        if watch.changed:
            return await handler(self._stop_planning(request))
        self._record(plan)  # counted once sent as planned
        return answer

    # ------------------------------------------------------------------ one call
    def prepare(self, request: ModelRequest) -> ModelRequest:
        """The request as it is sent: planned messages and the engine's fields (the given
        messages once planning stopped: module docstring)."""
        planned, _check, plan = self._planned(request)
        self._record(plan)
        return planned

    @property
    def planning(self) -> bool:
        """Whether calls are planned: False once a middleware inside this one was found
        changing the planned messages (module docstring)."""
        return not self._stopped

    def _stop_planning(self, request: ModelRequest) -> ModelRequest:
        """Plan nothing more (a middleware inside changed the planned messages, so a pointer
        could name text the model does not get); ``request`` as given, with the engine's
        fields."""
        with self._lock:
            first, self._stopped = not self._stopped, True
        if first:
            logger.warning(
                "contextpilot: a middleware listed after ContextPilotMiddleware changed the "
                "planned messages before the model call (ContextEditingMiddleware? list it "
                "before ContextPilotMiddleware); planning is off for this middleware: its calls "
                "go out with the messages the agent gave"
            )
        return self._unplanned(request)

    def _unplanned(self, request: ModelRequest) -> ModelRequest:
        thread = _thread_id(request)
        scope = Scope(conversation_id=thread, tenant=self.tenant) if thread else None
        return request.override(model_settings=self._fields(request, scope))

    def _planned(
        self, request: ModelRequest
    ) -> tuple[ModelRequest, _SentCheck | None, tuple[Scope | None, MessagePlan] | None]:
        """:meth:`prepare` unrecorded: the request, the check of the model call when the plan
        rewrote a message (``None``: nothing to check) and the plan to record once sent
        (``None``: not planned)."""
        if self._stopped:
            return self._unplanned(request), None, None
        thread = _thread_id(request)
        scope = Scope(conversation_id=thread, tenant=self.tenant) if thread else None
        given: list[BaseMessage] = list(request.messages)
        system = request.system_message
        combined: list[BaseMessage] = ([system] if system is not None else []) + given
        try:
            dicts = [_to_openai(message) for message in combined]
            plan = self.planner.plan(dicts, scope=scope, api="openai")
        except (TypeError, ValueError) as error:  # a shape or arguments JSON cannot encode
            logger.warning(
                "contextpilot: conversation %r sent unplanned: %s", thread, error, exc_info=False
            )
            return request.override(model_settings=self._fields(request, scope)), None, None
        sent = [
            _sent_message(message, before, after)
            for message, before, after in zip(combined, dicts, plan.messages, strict=True)
        ]
        if self.engine == "anthropic":
            sent = self._mark_stable_prefix(request, sent, plan)
        rewritten = [
            after for before, after in zip(combined, sent, strict=True) if after is not before
        ]
        overrides: dict[str, Any] = {}
        sent_system = sent[0] if system is not None else None
        sent_messages = sent[1:] if system is not None else sent
        if any(a is not b for a, b in zip(sent_messages, given, strict=True)):
            overrides["messages"] = sent_messages
        if sent_system is not system:
            overrides["system_message"] = sent_system
        overrides["model_settings"] = self._fields(request, scope)
        check = _SentCheck(sent, rewritten) if rewritten else None
        return request.override(**overrides), check, (scope, plan)

    def _fields(self, request: ModelRequest, scope: Scope | None) -> dict[str, Any]:
        """``request.model_settings`` with the engine's fields added."""
        settings = dict(request.model_settings)
        if self.engine == "openai-compatible":
            own = getattr(request.model, "extra_body", None)
            extra = settings.get("extra_body") or {}
            if isinstance(own, Mapping) and isinstance(extra, Mapping):
                settings["extra_body"] = {**own, **extra}
            return with_engine_fields(settings, _CallIds(new_rid(), self.cache_salt), "any")
        if self.engine == "openai" and scope is not None and scope.conversation is not None:
            tenant, conversation = scope.conversation
            digest = hashlib.blake2b(
                f"{tenant}\x00{conversation}".encode("utf-8", "surrogatepass"), digest_size=8
            ).digest()
            prefix = CachePrefix(
                (), block_ids=(int.from_bytes(digest, "big"),), salt=self.cache_salt
            )
            settings.update(openai_cache_fields(prefix, retention=self.prompt_cache_retention))
        return settings

    def _mark_stable_prefix(
        self, request: ModelRequest, sent: list[BaseMessage], plan: MessagePlan
    ) -> list[BaseMessage]:
        """``sent`` with ``cache_control`` markers on the last replayed message and on the last
        message, where the limits allow (module docstring)."""
        policy = self.cache_policy or AnthropicCachePolicy(model=_model_name(request.model) or None)
        limit = min(policy.max_breakpoints, ANTHROPIC_MAX_BREAKPOINTS)
        used = _markers(sent, request.tools, request.model_settings)
        count = self.planner.token_counter.count
        # The replayed prefix is what the library knows goes out again; the tail is what this
        # call adds, written now so the next call reads it (unless the app's own caching
        # middleware already marks the tail through its ``cache_control`` keyword).
        wanted = [plan.replayed - 1]
        if not request.model_settings.get("cache_control"):
            wanted.append(len(sent) - 1)
        marked_at: set[int] = set()
        for index in wanted:
            if index < 0 or index in marked_at:
                continue
            if used >= limit:
                logger.debug("contextpilot: no breakpoint, %d already in the request", used)
                break
            tokens = sum(count(_text_of(message.content)) for message in sent[: index + 1])
            if tokens < policy.min_cacheable_tokens:
                continue
            marked = _with_marker(sent[index], policy.cache_control)
            if marked is None:
                continue
            sent = [*sent[:index], marked, *sent[index + 1 :]]
            marked_at.add(index)
            used += 1
        return sent

    def _record(self, planned: tuple[Scope | None, MessagePlan] | None) -> None:
        """Count a call sent as planned (``None``: sent unplanned, not counted)."""
        if planned is None:
            return
        scope, plan = planned
        pointers = plan.pointers
        figures = {
            "calls": 1,
            "messages": len(plan.messages),
            "replayed": plan.replayed,
            "tokens_removed": plan.tokens_removed,
            "pointers": len(pointers),
            "new_pointers": sum(1 for p in pointers if not p.replayed),
        }
        with self._lock:
            for name, value in figures.items():
                self._totals[name] += value
            conversation = scope.conversation if scope is not None else None
            if conversation is not None:
                totals = self._conversations.get(conversation)
                if totals is None:
                    totals = dict.fromkeys(_STAT_KEYS, 0)
                    self._conversations.put(conversation, totals)
                for name, value in figures.items():
                    totals[name] += value
        logger.info(
            "contextpilot: tenant=%r conversation=%r messages=%d replayed=%d tokens_removed=%d "
            "pointers=%d new_pointers=%d",
            self.tenant,
            scope.conversation_id if scope is not None else None,
            figures["messages"],
            plan.replayed,
            plan.tokens_removed,
            figures["pointers"],
            figures["new_pointers"],
        )

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict[str, Any]:
        """Running totals over every model call, and per conversation (tenant and thread id).

        Returns:
            ``{"calls", "messages", "replayed", "tokens_removed", "pointers", "new_pointers",
            "conversations": {tenant: {thread_id: {same keys but conversations}}}}``: model calls
            planned, messages sent, of those replayed, tokens the sent messages save against
            the given ones (by the planner's token counter, summed over calls: what the engine
            was not sent), pointers in the sent messages and of those made on that call. The
            conversations are the most recent ``max_conversations``.
        """
        with self._lock:
            out: dict[str, Any] = dict(self._totals)
            conversations: dict[str, dict[str, dict[str, int]]] = {}
            for (tenant, thread), totals in self._conversations.items():
                conversations.setdefault(tenant, {})[thread] = dict(totals)
            out["conversations"] = conversations
        return out


# ---------------------------------------------------------------------------------- conversion
def _thread_id(request: ModelRequest) -> str | None:
    """The agent thread's id: the runtime's execution info, else the run's config."""
    info = getattr(request.runtime, "execution_info", None)
    thread = getattr(info, "thread_id", None)
    if thread is None:
        try:
            from langgraph.config import get_config

            thread = (get_config().get("configurable") or {}).get("thread_id")
        except RuntimeError:  # called outside a runnable context
            thread = None
    if thread is None or thread == "":
        return None
    return str(thread)


def _to_openai(message: BaseMessage) -> dict[str, Any]:
    """One LangChain message as an OpenAI chat message dict (module docstring, step 2)."""
    content = _content(message.content)
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": content}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": content}
    if isinstance(message, ToolMessage):
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": content}
    if isinstance(message, AIMessage):
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.get("id") or "",
                    "type": "function",
                    "function": {
                        "name": call["name"],
                        "arguments": json.dumps(call["args"], ensure_ascii=False),
                    },
                }
                for call in message.tool_calls
            ]
        return out
    # Any other message (ChatMessage, FunctionMessage, ...) is context the planner never
    # rewrites; its type keeps it from matching a user message with the same content.
    return {"role": "user", "content": content, "lc_type": message.type}


def _content(content: Any) -> Any:
    """LangChain content as OpenAI content: a str, or a list of typed parts (a bare str part
    becomes a text part; a part of unknown form is carried under ``value``)."""
    if isinstance(content, str):
        return content
    parts: list[Any] = []
    for part in content or ():
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
        elif isinstance(part, Mapping) and isinstance(part.get("type"), str):
            parts.append(dict(part))
        else:
            parts.append({"type": "unknown", "value": part})
    return parts


def _sent_message(message: BaseMessage, given: dict[str, Any], sent: dict[str, Any]) -> BaseMessage:
    """``message`` itself, or for a tool message whose text the plan changed a copy with the
    new text in the content's own form."""
    if sent == given:
        return message
    text = _plain_text(sent.get("content"))
    if not isinstance(message, ToolMessage) or text is None:
        # The planner rewrites tool results only; anything else is sent as the app gave it.
        logger.warning("contextpilot: unexpected change to a %s message ignored", message.type)
        return message
    content = message.content
    if isinstance(content, str):
        new: Any = text
    else:
        part = content[0]
        new = [text] if isinstance(part, str) else [{**part, "text": text}]
    return message.model_copy(update={"content": new})


def _same(given: BaseMessage, planned: BaseMessage) -> bool:
    """Whether the model gets ``planned`` as it was planned."""
    return given.type == planned.type and given.content == planned.content


def _holds(batch: Sequence[BaseMessage], message: BaseMessage) -> bool:
    return any(_same(given, message) for given in batch)


def _plain_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], Mapping):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _text_of(content: Any) -> str:
    """The text of a message's content, for counting the prefix's tokens."""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content or ():
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping):
            inner = part.get("text", part.get("content"))
            if isinstance(inner, str):
                texts.append(inner)
            elif isinstance(inner, list):
                texts.append(_text_of(inner))
    return "".join(texts)


def _model_name(model: Any) -> str:
    name = getattr(model, "model", None)
    if not isinstance(name, str):
        name = getattr(model, "model_name", None)
    return name if isinstance(name, str) else ""


# ---------------------------------------------------------------------------------- anthropic
def _markers(
    messages: Sequence[BaseMessage],
    tools: Sequence[BaseTool | dict[str, Any]],
    settings: Mapping[str, Any],
) -> int:
    """``cache_control`` breakpoints already in a request: on content blocks, on tools, and
    the call keyword (one)."""
    used = 1 if settings.get("cache_control") else 0
    for message in messages:
        content = message.content
        if isinstance(content, list):
            used += sum(1 for b in content if isinstance(b, Mapping) and "cache_control" in b)
    for tool in tools:
        extras = tool.extras if isinstance(tool, BaseTool) else tool
        if isinstance(extras, Mapping) and extras.get("cache_control"):
            used += 1
    return used


def _with_marker(message: BaseMessage, cache_control: dict[str, str]) -> BaseMessage | None:
    """A copy of ``message`` with ``cache_control`` on its last content block; ``None`` when
    it has no block that can carry one (an AI message with only tool calls)."""
    content = message.content
    if isinstance(message, ToolMessage) and not _all_tool_results(content):
        block = {
            "type": "tool_result",
            "content": content,
            "tool_use_id": message.tool_call_id,
            "is_error": message.status == "error",
            "cache_control": cache_control,
        }
        return message.model_copy(update={"content": [block]})
    if isinstance(content, str):
        if not content:
            return None
        return message.model_copy(
            update={"content": [{"type": "text", "text": content, "cache_control": cache_control}]}
        )
    blocks = list(content)
    if not blocks:
        return None
    last = blocks[-1]
    if isinstance(last, str):
        if not last:
            return None
        blocks[-1] = {"type": "text", "text": last, "cache_control": cache_control}
    elif isinstance(last, Mapping) and last.get("type") in (
        "text",
        "image",
        "document",
        "tool_result",
    ):
        blocks[-1] = {**last, "cache_control": cache_control}
    else:
        return None
    return message.model_copy(update={"content": blocks})


def _all_tool_results(content: Any) -> bool:
    """Whether a tool message's content is already Anthropic ``tool_result`` blocks (which
    ``ChatAnthropic`` sends as they are)."""
    return (
        isinstance(content, list)
        and bool(content)
        and all(isinstance(b, Mapping) and b.get("type") == "tool_result" for b in content)
    )
