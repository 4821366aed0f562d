"""``ContextPilotRetriever``: a drop-in wrapper that plans any LangChain retriever's results.

A :class:`~langchain_core.retrievers.BaseRetriever` (query string in, documents out). Each call
runs the base retriever (its run nested in traces, the call's keyword arguments passed
through), plans the documents' texts with the pilot (a
:class:`~contextpilot_integrations.core.planner_protocol.Planner`; ``aplan`` on the async path)
and returns one copy of each document in the plan's output order with its
``metadata["contextpilot"]`` entry (:mod:`.documents`). ``batch``/``abatch`` plan the whole
batch jointly (``plan_batch``) and mark each document with its request's
``schedule_position``, which :func:`~.plan_fields.with_plan_fields` sends the calls in.

Per-call settings, read from ``config={"metadata": {...}}`` (or the retriever's own
``metadata`` field), make the request's
:class:`~contextpilot_integrations.core.request.Scope`:

================================= ==============================================================
key                               value
================================= ==============================================================
``contextpilot_conversation_id``  the conversation this request is a turn of (``str``); without
                                  it nothing is de-duplicated (docs/DESIGN.md, "Isolation")
``contextpilot_tenant``           the tenant owning the conversation (``str``, default ``""``)
``contextpilot_turn``             this turn's number (``int``; default: after the latest)
``contextpilot_visible_turns``    how many earlier turns' documents the app's prompt still holds
                                  (``int``: the last n, or ``"all"``; default ``0``: the usual
                                  chain does not resend them, and a hint must point at text the
                                  model sees)
================================= ==============================================================

LangGraph's ``thread_id`` and ``user_id`` are read only when named
(``conversation_id_keys=("thread_id",)``, ``tenant_keys=("user_id",)``): why in
docs/DESIGN.md, "LangChain".
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
from langchain_core.runnables.config import get_config_list, patch_config
from pydantic import Field, field_validator

from contextpilot_integrations.core.conversations.turns import TurnVisibility
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import BatchPlan
from contextpilot_integrations.core.planner_protocol import check_planner
from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.langchain.documents import planned_documents

__all__ = [
    "CONVERSATION_ID_KEY",
    "TENANT_KEY",
    "TURN_KEY",
    "VISIBLE_TURNS_KEY",
    "ContextPilotRetriever",
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
        pilot: the :class:`~contextpilot_integrations.core.planner_protocol.Planner`; default a
            new in-process :class:`ContextPilot`. Share one across retrievers, or use the index
            service's :class:`~contextpilot_integrations.client.client.ContextPilotClient`
            across processes, so that they share one context index.
        k: keep only the base retriever's first ``k`` documents (retriever order) before
            planning; ``None`` keeps all. A ``k`` keyword given to ``invoke`` is passed to the
            base retriever and caps the result the same way.
        conversation_id_keys: metadata keys read, in order, for the conversation id.
        tenant_keys: metadata keys read, in order, for the tenant.

    Returns (``invoke``): one copy of every document the base retriever returned (after
    ``k``), in the plan's output order: shown blocks (prompt order), replaced by location
    hints, duplicates, skipped (empty text); see :mod:`.documents`.

    Raises:
        The base retriever's own exception, unchanged. ``TypeError``/``ValueError`` for a
        result that is not a list of documents or a bad metadata value (the message names the
        key or the document and the value), and the pilot's errors.
    """

    base_retriever: RetrieverLike
    pilot: Any = Field(default_factory=ContextPilot)
    k: int | None = None
    conversation_id_keys: tuple[str, ...] = (CONVERSATION_ID_KEY,)
    tenant_keys: tuple[str, ...] = (TENANT_KEY,)

    @field_validator("pilot")
    @classmethod
    def _check_pilot(cls, value: Any) -> Any:
        check_planner(value)
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
        scope = self._scope(run_manager.metadata)
        documents = self.base_retriever.invoke(
            query, patch_config(ensure_config(), callbacks=run_manager.get_child()), **kwargs
        )
        documents = self._kept(documents, kwargs)
        plan = self.pilot.plan(query, [d.page_content for d in documents], scope=scope)
        logger.debug("planned %s: %d documents", plan.rid, len(documents))
        return planned_documents(documents, plan)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        self._limit(kwargs)
        scope = self._scope(run_manager.metadata)
        documents = await self.base_retriever.ainvoke(
            query, patch_config(ensure_config(), callbacks=run_manager.get_child()), **kwargs
        )
        documents = self._kept(documents, kwargs)
        plan = await self.pilot.aplan(query, [d.page_content for d in documents], scope=scope)
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
        """Retrieve for every query, then plan the batch jointly (``pilot.plan_batch``).

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
        if batch.requests:
            try:
                batch.place(self.pilot.plan_batch(batch.requests))
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
        """The async twin of :meth:`batch` (awaits ``pilot.aplan_batch``)."""
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
        if batch.requests:
            try:
                batch.place(await self.pilot.aplan_batch(batch.requests))
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

    def _scope(self, metadata: Mapping[str, Any]) -> Scope:
        """The request's scope, read from the run metadata (see the module docstring).

        Raises:
            TypeError / ValueError: a bad value; the message names the metadata key.
        """
        conversation_id = _first_id(metadata, self.conversation_id_keys)
        tenant = _first_id(metadata, self.tenant_keys) or ""
        turn = _optional_int(metadata, TURN_KEY)
        visible_given = metadata.get(VISIBLE_TURNS_KEY)
        all_visible = isinstance(visible_given, str) and visible_given == "all"
        visible = None if all_visible else _optional_int(metadata, VISIBLE_TURNS_KEY)
        if conversation_id is None:
            for key, value in ((TURN_KEY, turn), (VISIBLE_TURNS_KEY, visible_given)):
                if value is not None:
                    raise ValueError(
                        f"metadata {key}={value!r} needs a conversation id "
                        f"({' or '.join(self.conversation_id_keys)})"
                    )
            return Scope(tenant=tenant)
        # Default 0 visible turns: the usual chain does not resend earlier turns' documents.
        visibility = TurnVisibility.all() if all_visible else TurnVisibility.last(visible or 0)
        return Scope(conversation_id, tenant, turn, visibility)

    def _prepare_batch(
        self,
        inputs: Sequence[str],
        results: Sequence[Any],
        run_managers: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> _Batch:
        batch = _Batch()
        for i, (result, run_manager) in enumerate(zip(results, run_managers)):
            if isinstance(result, BaseException):
                batch.outputs.append(result)
                continue
            try:
                documents = self._kept(result, kwargs)
                request = PlanRequest(
                    inputs[i],
                    [d.page_content for d in documents],
                    scope=self._scope(run_manager.metadata),
                )
            except (TypeError, ValueError) as exc:
                batch.outputs.append(exc)
                continue
            batch.outputs.append(documents)
            batch.planned.append(i)
            batch.requests.append(request)
        return batch


class _Batch:
    """A batch being planned: per input its documents (or exception), and the requests to
    plan with the input index of each."""

    def __init__(self) -> None:
        self.outputs: list[Any] = []
        self.planned: list[int] = []
        self.requests: list[PlanRequest] = []

    def place(self, plans: BatchPlan) -> None:
        """Replace each planned input's documents by its planned copies (input order kept)."""
        for plan_index, i in enumerate(self.planned):
            self.outputs[i] = planned_documents(
                self.outputs[i],
                plans.plans[plan_index],
                schedule_position=plans.schedule_positions[plan_index],
            )

    def fail(self, exc: Exception) -> None:
        for i in self.planned:
            self.outputs[i] = exc


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


def _optional_int(metadata: Mapping[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        expected = 'an int or "all"' if key == VISIBLE_TURNS_KEY else "an int"
        raise TypeError(
            f"metadata {key} must be {expected}, got {type(value).__name__}: {value!r:.80}"
        )
    if value < 0:
        raise ValueError(f"metadata {key} must be >= 0, got {value}")
    return value


def _raise_or_return(outputs: list[Any], return_exceptions: bool) -> list[Any]:
    if not return_exceptions:
        for output in outputs:
            if isinstance(output, BaseException):
                raise output
    return outputs
