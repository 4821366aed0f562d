"""``ContextPilotRetriever``: a drop-in wrapper that plans any LangChain retriever's results.

Swap ``retriever`` for ``ContextPilotRetriever(base_retriever=retriever)`` and nothing else in
the chain has to change: it is a :class:`~langchain_core.retrievers.BaseRetriever`, its input is
the query string and its output a list of documents. Each call

1. runs the base retriever, its run nested under this one in traces
   (``run_manager.get_child()``, as langchain-classic's ``ContextualCompressionRetriever``
   does), with the call's keyword arguments passed through (``invoke(q, k=3)``);
2. plans the documents' texts with ContextPilot (:meth:`ContextPilot.plan`: alignment against
   the shared context index, multi-turn de-duplication when the call names a conversation);
3. returns copies of the documents in prompt order, each with a ``metadata["contextpilot"]``
   entry (request id, original rank, block id, hint markers; :mod:`.documents`).

``batch``/``abatch`` run the base retriever's batch, then plan the whole batch jointly
(:meth:`ContextPilot.plan_batch`: requests ordered against each other, a schedule that runs
requests sharing a prefix back to back); results come back in input order and each document
carries its request's ``schedule_position``, which :func:`~.request_ids.with_request_id` uses
to issue the LLM calls in that order.

Per-call settings come from ``config={"metadata": {...}}``: LangChain hands them to the retriever
as ``run_manager.metadata`` on every call path, direct or inside a chain (``configurable`` is not
read: langchain-core 1.8 copies only its ``model`` and ``checkpoint_ns`` into the metadata, and a
retriever sees ``configurable`` only inside a chain). The retriever's own ``metadata`` field
works too, for a fixed tenant.

===============================  ===================================================================
key                              value
===============================  ===================================================================
``contextpilot_conversation_id`` the conversation this request is a turn of (``str``); without it
                                 nothing is de-duplicated across requests (DESIGN.md invariant 2)
``contextpilot_tenant``          the tenant owning the conversation (``str``, default ``""``)
``contextpilot_turn``            this turn's number (``int``; default: after the latest)
``contextpilot_visible_turns``   how many earlier turns' documents the app's prompt still holds:
                                 ``int`` (the last n turns) or ``"all"``; default ``0``. A block an
                                 earlier *visible* turn showed becomes a hint; with the default
                                 only repeats within this prompt are folded, because the usual
                                 chain (README) does not resend earlier turns' documents and a
                                 hint must never point at text the model does not see
===============================  ===================================================================

LangGraph's ``thread_id`` and ``user_id`` are *not* read by default: a hint ("Also relevant:
[Doc 3] of turn 2, shown above.") is only right when the app's prompt still holds that earlier
turn's documents, and most chat histories keep only questions and answers. An app whose history
does keep the rendered prompts opts in with ``conversation_id_keys=("thread_id",)`` and
``tenant_keys=("user_id",)``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManager,
    AsyncCallbackManagerForRetrieverRun,
    CallbackManager,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever, RetrieverLike
from langchain_core.runnables import RunnableConfig, ensure_config
from langchain_core.runnables.config import get_config_list, patch_config, run_in_executor
from pydantic import Field, field_validator

from contextpilot_integrations.core.conversation import TurnVisibility
from contextpilot_integrations.core.pilot import BatchPlan, ContextPilot
from contextpilot_integrations.core.planner import Planner

from .documents import block_texts, planned_documents

__all__ = [
    "CONVERSATION_ID_KEY",
    "TENANT_KEY",
    "TURN_KEY",
    "VISIBLE_TURNS_KEY",
    "ContextPilotRetriever",
    "Planner",
]

logger = logging.getLogger(__name__)

CONVERSATION_ID_KEY = "contextpilot_conversation_id"
TENANT_KEY = "contextpilot_tenant"
TURN_KEY = "contextpilot_turn"
VISIBLE_TURNS_KEY = "contextpilot_visible_turns"


class ContextPilotRetriever(BaseRetriever):
    """Wraps a retriever; returns its documents aligned, de-duplicated and annotated.

    Args:
        base_retriever: any retriever or runnable ``str -> list[Document]``.
        pilot: the planner (any object with ``plan`` and ``plan_batch``); default a new
            in-process :class:`ContextPilot`. Share one across retrievers and processes (the
            service client) so that they share one context index.
        k: keep only the base retriever's first ``k`` documents (retriever order) before
            planning; ``None`` keeps all. A ``k`` keyword given to ``invoke`` is passed to the
            base retriever and caps the result the same way.
        conversation_id_keys: metadata keys read, in order, for the conversation id.
        tenant_keys: metadata keys read, in order, for the tenant.

    Returns (``invoke``): copies of the documents, the shown blocks in prompt order then the
    ones replaced by location hints; ``len`` is the number of distinct texts (a document whose
    text repeats an earlier one of the same result is folded into it, see :mod:`.documents`).

    Raises:
        The base retriever's own exception, unchanged. ``TypeError``/``ValueError`` for a
        result that is not a list of documents, a document with empty text, or a bad metadata
        value (the message names the key or the document and the value).
    """

    base_retriever: RetrieverLike
    pilot: Any = Field(default_factory=ContextPilot)
    k: int | None = None
    conversation_id_keys: tuple[str, ...] = (CONVERSATION_ID_KEY,)
    tenant_keys: tuple[str, ...] = (TENANT_KEY,)

    @field_validator("pilot")
    @classmethod
    def _check_pilot(cls, value: Any) -> Any:
        if not isinstance(value, Planner):
            raise TypeError(
                f"pilot must have plan() and plan_batch() (a ContextPilot or its service "
                f"client), got {type(value).__name__}"
            )
        return value

    @field_validator("k")
    @classmethod
    def _check_k(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"k must be >= 1 or None, got {value}")
        return value

    # ------------------------------------------------------------------ one request
    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        # A bad k or metadata value fails before the base retriever runs.
        self._limit(kwargs)
        scope = _Scope.read(run_manager.metadata, self)
        documents = self.base_retriever.invoke(
            query, patch_config(ensure_config(), callbacks=run_manager.get_child()), **kwargs
        )
        documents = self._kept(documents, kwargs)
        plan = self.pilot.plan(query, block_texts(documents), **scope.plan_kwargs())
        logger.debug("planned %s: %d documents", plan.rid, len(documents))
        return planned_documents(documents, plan)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        self._limit(kwargs)
        scope = _Scope.read(run_manager.metadata, self)
        documents = await self.base_retriever.ainvoke(
            query, patch_config(ensure_config(), callbacks=run_manager.get_child()), **kwargs
        )
        documents = self._kept(documents, kwargs)
        texts = block_texts(documents)
        # Planning is short CPU work in process, or an HTTP call with the service client:
        # either way, not on the event loop.
        plan = await run_in_executor(None, self.pilot.plan, query, texts, **scope.plan_kwargs())
        return planned_documents(documents, plan)

    # ------------------------------------------------------------------ a batch
    def batch(
        self,
        inputs: list[str],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[list[Document]]:
        """Retrieve for every query, then plan the batch jointly (:meth:`ContextPilot.plan_batch`).

        Returns one list per input, in input order; every document carries its request's
        ``schedule_position``. With ``return_exceptions``, a failed input gets its exception
        and the others are still planned together.

        Raises:
            ValueError: two inputs name the same conversation (its turns are sequential: call
                ``invoke`` per turn). Else as :meth:`invoke`.
        """
        if not inputs:
            return []
        self._limit(kwargs)
        configs = get_config_list(config, len(inputs))
        run_managers = [
            self._start_run(CallbackManager, query, cfg, kwargs)
            for query, cfg in zip(inputs, configs)
        ]
        child_configs = [
            patch_config(cfg, callbacks=rm.get_child()) for cfg, rm in zip(configs, run_managers)
        ]
        results = self.base_retriever.batch(inputs, child_configs, return_exceptions=True, **kwargs)
        batch = self._prepare_batch(inputs, results, run_managers, kwargs)
        if batch.planned:
            try:
                batch.place(self.pilot.plan_batch(*batch.args, **batch.kwargs))
            except Exception as exc:  # reported on every planned input's run, then raised
                batch.fail(exc)
        for run_manager, output in zip(run_managers, batch.outputs):
            if isinstance(output, BaseException):
                run_manager.on_retriever_error(output)
            else:
                run_manager.on_retriever_end(output)
        return _raise_or_return(batch.outputs, return_exceptions)

    async def abatch(
        self,
        inputs: list[str],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[list[Document]]:
        """The async twin of :meth:`batch`."""
        if not inputs:
            return []
        self._limit(kwargs)
        configs = get_config_list(config, len(inputs))
        run_managers = [
            await self._start_run(AsyncCallbackManager, query, cfg, kwargs)
            for query, cfg in zip(inputs, configs)
        ]
        child_configs = [
            patch_config(cfg, callbacks=rm.get_child()) for cfg, rm in zip(configs, run_managers)
        ]
        results = await self.base_retriever.abatch(
            inputs, child_configs, return_exceptions=True, **kwargs
        )
        batch = self._prepare_batch(inputs, results, run_managers, kwargs)
        if batch.planned:
            try:
                batch.place(await run_in_executor(None, self._plan_batch, batch.args, batch.kwargs))
            except Exception as exc:
                batch.fail(exc)
        for run_manager, output in zip(run_managers, batch.outputs):
            if isinstance(output, BaseException):
                await run_manager.on_retriever_error(output)
            else:
                await run_manager.on_retriever_end(output)
        return _raise_or_return(batch.outputs, return_exceptions)

    # ------------------------------------------------------------------ internals
    def _start_run(
        self, manager_class: Any, query: str, config: RunnableConfig, kwargs: Mapping[str, Any]
    ) -> Any:
        """Open this retriever's run for one query, as ``BaseRetriever.invoke`` does."""
        config = ensure_config(config)
        manager = manager_class.configure(
            config.get("callbacks"),
            None,
            verbose=kwargs.get("verbose", False),
            inheritable_tags=config.get("tags"),
            local_tags=self.tags,
            inheritable_metadata={**(config.get("metadata") or {}), **self._get_ls_params()},
            local_metadata=self.metadata,
        )
        return manager.on_retriever_start(
            None, query, name=config.get("run_name") or self.get_name(), run_id=config.get("run_id")
        )

    def _kept(self, documents: Any, kwargs: Mapping[str, Any]) -> list[Document]:
        """Check the base retriever's result and cut it to ``k`` documents."""
        if not isinstance(documents, list):
            raise TypeError(
                f"base_retriever must return a list of Document, got {type(documents).__name__}"
            )
        for i, doc in enumerate(documents):
            if not isinstance(doc, Document):
                raise TypeError(
                    f"base_retriever result [{i}] must be a Document, got {type(doc).__name__}: "
                    f"{doc!r:.80}"
                )
        limit = self._limit(kwargs)
        return documents if limit is None else documents[:limit]

    def _limit(self, kwargs: Mapping[str, Any]) -> int | None:
        """The call's ``k`` keyword (checked), else the ``k`` field."""
        limit = kwargs.get("k")
        if limit is None:
            return self.k
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"k must be an int, got {type(limit).__name__}: {limit!r:.80}")
        if limit < 1:
            raise ValueError(f"k must be >= 1, got {limit}")
        return limit

    def _prepare_batch(
        self,
        inputs: Sequence[str],
        results: Sequence[Any],
        run_managers: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> _Batch:
        batch = _Batch()
        scopes: list[_Scope] = []
        for i, (result, run_manager) in enumerate(zip(results, run_managers)):
            if isinstance(result, BaseException):
                batch.outputs.append(result)
                continue
            try:
                documents = self._kept(result, kwargs)
                scope = _Scope.read(run_manager.metadata, self)
            except (TypeError, ValueError) as exc:
                batch.outputs.append(exc)
                continue
            batch.outputs.append(documents)
            batch.planned.append(i)
            scopes.append(scope)
        batch.args = (
            [inputs[i] for i in batch.planned],
            [block_texts(batch.outputs[i]) for i in batch.planned],
        )
        if any(scope.conversation_id is not None for scope in scopes):
            batch.kwargs = {
                "conversation_ids": [scope.conversation_id for scope in scopes],
                "tenants": [scope.tenant for scope in scopes],
            }
            if any(scope.turn is not None for scope in scopes):
                batch.kwargs["turns"] = [scope.turn for scope in scopes]
            if any(scope.conversation_id is not None for scope in scopes):
                batch.kwargs["visibilities"] = [scope.visibility() for scope in scopes]
        return batch

    def _plan_batch(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> BatchPlan:
        return self.pilot.plan_batch(*args, **kwargs)


class _Batch:
    """A batch being planned: per input its documents (or exception), the inputs to plan and
    the ``plan_batch`` arguments."""

    def __init__(self) -> None:
        self.outputs: list[Any] = []
        self.planned: list[int] = []
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}

    def place(self, plans: BatchPlan) -> None:
        """Replace each planned input's documents by its planned copies (input order kept)."""
        position = {plan_index: p for p, plan_index in enumerate(plans.schedule)}
        for plan_index, i in enumerate(self.planned):
            self.outputs[i] = planned_documents(
                self.outputs[i], plans.plans[plan_index], schedule_position=position[plan_index]
            )

    def fail(self, exc: Exception) -> None:
        for i in self.planned:
            self.outputs[i] = exc


class _Scope:
    """The conversation settings of one call, read from its run metadata."""

    def __init__(
        self,
        conversation_id: str | None,
        tenant: str,
        turn: int | None,
        visible_turns: int | None,
    ) -> None:
        # ``visible_turns``: earlier turns the prompt holds (None: all of them).
        self.conversation_id = conversation_id
        self.tenant = tenant
        self.turn = turn
        self.visible_turns = visible_turns

    @classmethod
    def read(cls, metadata: Mapping[str, Any], retriever: ContextPilotRetriever) -> _Scope:
        conversation_id = _first_id(metadata, retriever.conversation_id_keys)
        tenant = _first_id(metadata, retriever.tenant_keys) or ""
        turn = _optional_int(metadata, TURN_KEY, low=0)
        visible_given = metadata.get(VISIBLE_TURNS_KEY)
        visible: int | None = 0
        if visible_given == "all":
            visible = None
        elif visible_given is not None:
            visible = _optional_int(metadata, VISIBLE_TURNS_KEY, low=0)
        if conversation_id is None:
            for key, value in ((TURN_KEY, turn), (VISIBLE_TURNS_KEY, visible_given)):
                if value is not None:
                    raise ValueError(
                        f"metadata {key}={value!r} needs a conversation id "
                        f"({' or '.join(retriever.conversation_id_keys)})"
                    )
        return cls(conversation_id, tenant, turn, visible)

    def visibility(self) -> TurnVisibility | None:
        if self.conversation_id is None:
            return None
        if self.visible_turns is None:
            return TurnVisibility.all()
        return TurnVisibility.last(self.visible_turns)

    def plan_kwargs(self) -> dict[str, Any]:
        if self.conversation_id is None:
            return {}
        kwargs: dict[str, Any] = {"conversation_id": self.conversation_id, "tenant": self.tenant}
        if self.turn is not None:
            kwargs["turn"] = self.turn
        kwargs["visibility"] = self.visibility()
        return kwargs


def _first_id(metadata: Mapping[str, Any], keys: Sequence[str]) -> str | None:
    for key in keys:
        value = metadata.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise TypeError(
                f"metadata {key} must be a str, got {type(value).__name__}: {value!r:.80}"
            )
        value = str(value)
        if not value:
            raise ValueError(f"metadata {key} must be a non-empty str, got ''")
        return value
    return None


def _optional_int(metadata: Mapping[str, Any], key: str, *, low: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        expected = 'an int or "all"' if key == VISIBLE_TURNS_KEY else "an int"
        raise TypeError(
            f"metadata {key} must be {expected}, got {type(value).__name__}: {value!r:.80}"
        )
    if value < low:
        raise ValueError(f"metadata {key} must be >= {low}, got {value}")
    return value


def _raise_or_return(outputs: list[Any], return_exceptions: bool) -> list[Any]:
    if not return_exceptions:
        for output in outputs:
            if isinstance(output, BaseException):
                raise output
    return outputs
