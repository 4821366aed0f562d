"""Sending the plan's fields with the LLM call, and a batch's calls in schedule order.

:func:`with_plan_fields` wraps a chat model; each call whose input is a
:class:`~.prompts.ContextPilotPromptValue` gets what its plan adds to the LLM call, by
``engine`` (:mod:`contextpilot_integrations.llm_call`):

- ``"any"`` (default), ``"sglang"``, ``"vllm"``: the request-id body fields
  (:func:`~contextpilot_integrations.llm_call.engine_fields.engine_body_fields`; ``"any"``:
  ``{"rid": rid, "request_id": rid, "session_id": rid}``) merged into ``extra_body`` over the
  model's own, so the engine's KV events name the request the plan was indexed under
  (docs/DESIGN.md, "The flow of one request");
- ``"anthropic"``: no body field; the prompt as content blocks, one per rendered document,
  with ``cache_control`` breakpoints placed from the plan (at most four, none below the
  model's minimum cacheable length: ``cache_policy``);
- ``"openai"``: the plan's ``prompt_cache_key`` (and ``prompt_cache_retention`` when set);
- ``"hosted"``: nothing.

With ``router`` (the retriever's
:class:`~contextpilot_integrations.core.replicas.routing.ReplicaRouter`) the plan's routing key
also goes in the ``routing_header`` through ``extra_headers``, for a gateway in front of the
replicas; with ``tracker`` each response's cache usage goes back to the pilot.
``batch``/``abatch`` send the calls in ``schedule_position`` order (unscheduled inputs after,
in input order), at most ``max_concurrency`` in flight, and return results in input order.
Why a wrapper: docs/DESIGN.md, "LangChain".

The wrapped model can be an agent's model (``create_agent(with_plan_fields(model), tools)``)
or have tools bound in a chain: ``bind_tools``, ``bind`` and ``with_structured_output`` return
the model's own bound runnable, wrapped the same way, so a prompt value sent through them
still carries its plan's fields. An agent's model calls carry messages, not a prompt value:
they go through as they are, with the fields
:class:`~.agent_middleware.ContextPilotMiddleware` binds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.messages import BaseMessage, SystemMessage
from langchain_core.prompt_values import ChatPromptValue
from langchain_core.runnables import (
    Runnable,
    RunnableConfig,
    RunnableParallel,
    RunnableSequence,
    RunnableSerializable,
    RunnableWithFallbacks,
)
from langchain_core.runnables.base import RunnableBindingBase
from langchain_core.runnables.config import get_config_list, get_executor_for_config
from pydantic import ConfigDict, PrivateAttr, field_validator

from contextpilot_integrations.core.blocks import TokenCounter
from contextpilot_integrations.langchain.prompts import ContextPilotPromptValue
from contextpilot_integrations.llm_call.anthropic_breakpoints import (
    AnthropicCachePolicy,
    anthropic_prompt,
)
from contextpilot_integrations.llm_call.engine_fields import (
    ROUTING_HEADER,
    EngineKind,
    engine_body_fields,
    routing_headers,
)

__all__ = ["PlanFieldsChatModel", "schedule_order", "with_plan_fields"]

logger = logging.getLogger(__name__)


class PlanFieldsChatModel(RunnableSerializable[Any, Any]):
    """A chat model (any runnable taking a prompt value) that sends the plan's fields.

    Args:
        bound: the chat model (``ChatOpenAI``, a ``.bind(...)`` of it, or any runnable that
            takes ``extra_body`` as a call keyword).
        engine: what to send (module docstring): ``"any"`` (default: ``rid``,
            ``request_id``, ``session_id``), ``"sglang"``, ``"vllm"``; hosted APIs:
            ``"anthropic"`` (breakpoints), ``"openai"`` (cache key), ``"hosted"`` (none).
        max_concurrency: calls in flight in ``batch``/``abatch`` when the config sets none
            (``None``: the executor's default).
        cache_policy: ``engine="anthropic"``: where breakpoints go and the model's minimum
            (:class:`~contextpilot_integrations.llm_call.anthropic_breakpoints.AnthropicCachePolicy`;
            default: the bound model's ``model`` attribute decides the minimum).
        token_counter: counts prefix tokens against that minimum (default the approximate
            counter; give the pilot's).
        prompt_cache_retention: ``engine="openai"``: ``"in_memory"`` or ``"24h"``, sent as is.
        tracker: a :class:`~contextpilot_integrations.llm_call.engine_fields.CacheUsageTracker`
            that each response of a planned call is recorded with (``invoke``/``ainvoke``).
        router: where the plan's routing key is looked up by its rid (``routing_key(rid)``:
            the :class:`~contextpilot_integrations.core.replicas.routing.ReplicaRouter`);
            None: no routing header.
        routing_header: the header the routing key goes in.

    An input that is not a :class:`~.prompts.ContextPilotPromptValue` with a ``rid`` is passed
    through unchanged (a warning is logged once when it is not a ContextPilot prompt value at
    all: the chain's prompt template is not ContextPilot's).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    bound: Runnable[Any, Any]
    engine: EngineKind = "any"
    max_concurrency: int | None = None
    cache_policy: AnthropicCachePolicy | None = None
    token_counter: TokenCounter | None = None
    prompt_cache_retention: str | None = None
    tracker: Any = None
    router: Any = None
    routing_header: str = ROUTING_HEADER
    # One flag for this wrapper and its bind_tools / bind copies (a shallow copy shares the
    # list), so an agent, which binds the model again on every call, is warned once.
    _warned: list[bool] = PrivateAttr(default_factory=lambda: [False])

    @field_validator("max_concurrency")
    @classmethod
    def _check_concurrency(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {value}")
        return value

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False

    @property
    def InputType(self) -> Any:  # noqa: N802 (LangChain's name)
        return self.bound.InputType

    @property
    def OutputType(self) -> Any:  # noqa: N802 (LangChain's name)
        return self.bound.OutputType

    # ------------------------------------------------------------------ one call
    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        result = self.bound.invoke(
            self.call_input(input, kwargs), config, **self.call_kwargs(input, kwargs)
        )
        self._record(input, result)
        return result

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        result = await self.bound.ainvoke(
            self.call_input(input, kwargs), config, **self.call_kwargs(input, kwargs)
        )
        if self.tracker is not None:
            await asyncio.to_thread(self._record, input, result)
        return result

    def stream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[Any]:
        yield from self.bound.stream(
            self.call_input(input, kwargs), config, **self.call_kwargs(input, kwargs)
        )

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        async for chunk in self.bound.astream(
            self.call_input(input, kwargs), config, **self.call_kwargs(input, kwargs)
        ):
            yield chunk

    def call_input(self, input: Any, kwargs: Mapping[str, Any] | None = None) -> Any:
        """The model's input: ``input`` itself, or for ``engine="anthropic"`` its messages as
        content blocks with the plan's ``cache_control`` breakpoints (a prompt value whose
        messages are not plain system / human / AI text goes unchanged). The ``tools`` the
        call sends (the call's ``kwargs``, else a binding's: ``bind_tools``) count against the
        limit by the ``cache_control`` markers they carry.

        Raises:
            ValueError: more ``cache_control`` markers on the tools and in the messages than
                the policy allows.
        """
        if self.engine != "anthropic" or not isinstance(input, ContextPilotPromptValue):
            return input
        roles = {"system": "system", "human": "user", "ai": "assistant"}
        messages = input.to_messages()
        if any(m.type not in roles or not isinstance(m.content, (str, list)) for m in messages):
            return input
        policy = self.cache_policy or AnthropicCachePolicy(model=_model_name(self.bound))
        tools = (kwargs or {}).get("tools", _bound_tools(self.bound))
        prompt = anthropic_prompt(
            [{"role": roles[m.type], "content": m.content} for m in messages],
            input.cache_prefix,
            policy,
            self.token_counter,
            tools=[_tool_definition(tool) for tool in tools or ()],
        )
        has_system = bool(messages) and messages[0].type == "system"
        out: list[BaseMessage] = []
        if has_system:
            out.append(SystemMessage(content=prompt.system or ""))  # type: ignore[arg-type]
        for original, message in zip(messages[1:] if has_system else messages, prompt.messages):
            out.append(original.model_copy(update={"content": message["content"]}))
        return ChatPromptValue(messages=out)

    def call_kwargs(self, input: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call keywords for ``input``: ``kwargs`` plus the merged ``extra_body`` and, with a
        ``router``, ``extra_headers`` with the plan's routing key."""
        if not isinstance(input, ContextPilotPromptValue):
            if not self._warned[0]:
                self._warned[0] = True
                logger.warning(
                    "with_plan_fields got a %s, not a ContextPilotPromptValue: no plan field "
                    "is sent (build the prompt with CONTEXTPILOT_PROMPT or "
                    "ContextPilotChatPromptTemplate; an agent's model calls get theirs from "
                    "ContextPilotMiddleware); warned once",
                    type(input).__name__,
                )
            return dict(kwargs)
        fields = engine_body_fields(input.rid, self.engine) if input.rid is not None else {}
        if self.engine == "openai" and input.prompt_cache_key is not None:
            fields["prompt_cache_key"] = input.prompt_cache_key
        if self.engine == "openai" and self.prompt_cache_retention is not None:
            fields["prompt_cache_retention"] = self.prompt_cache_retention
        out = dict(kwargs)
        if fields:
            out["extra_body"] = {
                **_bound_mapping(self.bound, "extra_body"),
                **dict(kwargs.get("extra_body") or {}),
                **fields,
            }
        headers = self._routing_headers(input.rid)
        if headers:
            out["extra_headers"] = {
                **_bound_mapping(self.bound, "extra_headers"),
                **dict(kwargs.get("extra_headers") or {}),
                **headers,
            }
        return out

    def _routing_headers(self, rid: str | None) -> dict[str, str]:
        if self.router is None or rid is None:
            return {}
        return routing_headers(self.router.routing_key(rid), self.engine, self.routing_header)

    def _record(self, input: Any, result: Any) -> None:
        rid = getattr(input, "rid", None)
        if self.tracker is not None and isinstance(rid, str) and rid:
            self.tracker.record(rid, result)

    # ------------------------------------------------------------------ an agent's model
    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> PlanFieldsChatModel:
        """The model's ``bind_tools(tools, **kwargs)``, wrapped like this model (what
        ``create_agent`` calls on each model call, with its ``model_settings`` as keywords).

        ``extra_body`` and ``extra_headers`` keywords are merged over the model's own (a bound
        keyword replaces the model's field, ``ChatOpenAI``'s ``extra_body`` for one): the model
        settings of an agent middleware keep the model's fields, as the plan's fields do.

        Raises:
            AttributeError: the wrapped runnable has no ``bind_tools``.
        """
        return self._rewrapped(self._inner("bind_tools")(tools, **self._merged(kwargs)))

    def bind(self, **kwargs: Any) -> PlanFieldsChatModel:
        """The model's ``bind(**kwargs)``, wrapped like this model (``extra_body`` and
        ``extra_headers`` merged over the model's own, as in :meth:`bind_tools`)."""
        return self._rewrapped(self.bound.bind(**self._merged(kwargs)))

    def with_structured_output(self, schema: Any, **kwargs: Any) -> Runnable[Any, Any]:
        """The model's ``with_structured_output(schema, **kwargs)`` with its model step
        wrapped like this model.

        A structured runnable is the model (bound) followed by a parser; call keywords reach
        only the first step of a sequence, so the wrapper goes around the whole sequence, or,
        with ``include_raw=True`` (a map ``{"raw": model}`` first, which takes no call
        keywords), around the map's model step, which gets the same input.

        Raises:
            AttributeError: the wrapped runnable has no ``with_structured_output``.
        """
        structured = self._inner("with_structured_output")(schema, **kwargs)
        if isinstance(structured, RunnableSequence) and isinstance(
            structured.first, RunnableParallel
        ):
            steps = structured.first.steps__
            if list(steps) == ["raw"]:
                raw = RunnableParallel(raw=self._rewrapped(steps["raw"]))
                return RunnableSequence(raw, *structured.steps[1:])
        return self._rewrapped(structured)

    def _inner(self, name: str) -> Any:
        method = getattr(self.bound, name, None)
        if not callable(method):
            raise AttributeError(
                f"with_plan_fields wraps {type(self.bound).__name__}, which has no {name}: "
                f"wrap a chat model that has one"
            )
        return method

    def _merged(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(kwargs)
        for name in ("extra_body", "extra_headers"):
            given = kwargs.get(name)
            if isinstance(given, Mapping):
                out[name] = {**_bound_mapping(self.bound, name), **given}
        return out

    def _rewrapped(self, bound: Runnable[Any, Any]) -> PlanFieldsChatModel:
        """This wrapper's settings around ``bound``."""
        return self.model_copy(update={"bound": bound})

    # ------------------------------------------------------------------ a batch
    def batch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Call the model for every input in schedule order; results in input order."""
        if not inputs:
            return []
        configs = get_config_list(config, len(inputs))

        def call(i: int) -> Any:
            try:
                return self.invoke(inputs[i], configs[i], **kwargs)
            except Exception as exc:
                if return_exceptions:
                    return exc
                raise

        limit = configs[0].get("max_concurrency") or self.max_concurrency
        with get_executor_for_config({"max_concurrency": limit}) as executor:
            # A thread pool starts queued calls first in, first out: submission order is the
            # order the engine receives them (exactly so with max_concurrency=1).
            futures = {i: executor.submit(call, i) for i in schedule_order(inputs)}
            return [futures[i].result() for i in range(len(inputs))]

    async def abatch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """The async twin of :meth:`batch`."""
        if not inputs:
            return []
        configs = get_config_list(config, len(inputs))
        limit = configs[0].get("max_concurrency") or self.max_concurrency
        gate: Any = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()

        async def call(i: int) -> Any:
            async with gate:  # waiters are woken first in, first out
                return await self.ainvoke(inputs[i], configs[i], **kwargs)

        order = schedule_order(inputs)
        tasks = {i: asyncio.ensure_future(call(i)) for i in order}
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        results = [tasks[i].exception() or tasks[i].result() for i in range(len(inputs))]
        if not return_exceptions:
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        return results


def schedule_order(inputs: Sequence[Any]) -> list[int]:
    """Input indices in the order to send them: by ``schedule_position``, then input order.

    Returns:
        A permutation of ``range(len(inputs))``.
    """

    def key(i: int) -> tuple[bool, int, int]:
        position = getattr(inputs[i], "schedule_position", None)
        return (position is None, position if position is not None else 0, i)

    return sorted(range(len(inputs)), key=key)


def with_plan_fields(
    llm: Runnable[Any, Any],
    *,
    engine: EngineKind = "any",
    max_concurrency: int | None = None,
    cache_policy: AnthropicCachePolicy | None = None,
    token_counter: TokenCounter | None = None,
    prompt_cache_retention: str | None = None,
    tracker: Any = None,
    router: Any = None,
    routing_header: str = ROUTING_HEADER,
) -> PlanFieldsChatModel:
    """Wrap a chat model so that each call sends the plan's engine-facing fields (see the
    module doc).

    Args:
        llm: the chat model, e.g. ``ChatOpenAI(base_url=..., model=...)``.
        engine: which fields to send (``"any"``, ``"sglang"``, ``"vllm"``; hosted:
            ``"anthropic"`` breakpoints, ``"openai"`` cache key, ``"hosted"`` none;
            ``engine_fields.engine_body_fields``).
        max_concurrency: default limit of calls in flight in ``batch``/``abatch``.
        cache_policy, token_counter, prompt_cache_retention, tracker, router, routing_header:
            see :class:`PlanFieldsChatModel`.

    Raises:
        TypeError: ``llm`` is not a runnable.
        ValidationError: an unknown ``engine`` or a ``max_concurrency`` below 1.
    """
    if not isinstance(llm, Runnable):
        raise TypeError(f"llm must be a LangChain Runnable, got {type(llm).__name__}")
    return PlanFieldsChatModel(
        bound=llm,
        engine=engine,
        max_concurrency=max_concurrency,
        cache_policy=cache_policy,
        token_counter=token_counter,
        prompt_cache_retention=prompt_cache_retention,
        tracker=tracker,
        router=router,
        routing_header=routing_header,
    )


def _model_name(runnable: Runnable[Any, Any]) -> str | None:
    """The model id of the chat model under bindings (``ChatAnthropic.model``)."""
    for _ in range(32):
        if isinstance(runnable, RunnableBindingBase):
            runnable = runnable.bound
        elif isinstance(runnable, RunnableSequence):
            runnable = runnable.first
        elif isinstance(runnable, RunnableWithFallbacks):
            runnable = runnable.runnable
        else:
            break
    for name in ("model", "model_name"):
        value = getattr(runnable, name, None)
        if isinstance(value, str):
            return value
    return None


def _bound_tools(runnable: Runnable[Any, Any]) -> Sequence[Any]:
    """The ``tools`` a binding sends (``bind_tools``): the outermost binding's that names them
    (its keywords override those of the bindings inside it), wrappers followed as in
    :func:`_bound_mapping`; none without one."""
    for _ in range(32):
        if isinstance(runnable, RunnableBindingBase):
            if "tools" in runnable.kwargs:
                return list(runnable.kwargs["tools"] or ())
            runnable = runnable.bound
        elif isinstance(runnable, RunnableSequence):
            runnable = runnable.first
        elif isinstance(runnable, RunnableWithFallbacks):
            runnable = runnable.runnable
        else:
            break
    return []


def _tool_definition(tool: Any) -> Any:
    """A tool as ``tool_breakpoints`` reads it: a definition as is; a LangChain tool by its
    ``extras``, where ``ChatAnthropic`` takes its ``cache_control`` (or its whole built-in
    definition) from."""
    extras = getattr(tool, "extras", None)
    if isinstance(tool, Mapping) or not isinstance(extras, Mapping):
        return tool
    built_in = extras.get("provider_tool_definition")
    if isinstance(built_in, Mapping):
        return built_in
    return {"cache_control": extras.get("cache_control")}


def _bound_mapping(runnable: Runnable[Any, Any], name: str) -> dict[str, Any]:
    """The ``extra_body`` (or ``extra_headers``: ``name``) a call would send without ours: the
    innermost binding's (``.bind``, ``.with_retry``, ``.with_config``), else the model's own
    field. Wrappers are followed to the model: a binding's ``bound``, a sequence's first step
    (``bind_tools`` and ``with_structured_output`` put the model first), a fallback chain's
    primary runnable."""
    for _ in range(32):  # wrappers nest a few levels; never loop on a cycle
        if isinstance(runnable, RunnableBindingBase):
            if name in runnable.kwargs:
                return dict(runnable.kwargs[name] or {})
            runnable = runnable.bound
        elif isinstance(runnable, RunnableSequence):
            runnable = runnable.first
        elif isinstance(runnable, RunnableWithFallbacks):
            runnable = runnable.runnable
        else:
            break
    own = getattr(runnable, name, None)
    return dict(own) if isinstance(own, Mapping) else {}
