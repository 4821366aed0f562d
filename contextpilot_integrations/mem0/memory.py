"""``ContextPilotMemory``: Mem0's ``Memory`` (and ``AsyncMemory``) with aligned, de-duplicated
search results.

Wrap a Mem0 memory and keep using it as before (one line changes)::

    memory = ContextPilotMemory(Memory.from_config(config))
    found = memory.search("what does Alice eat?", filters={"user_id": "alice"},
                          conversation_id="chat-7")
    for result in found["results"]:
        result["memory"], result["score"], result["contextpilot"]

``search`` has Mem0's signature and returns the wrapped client's shape (:data:`SearchResponse`):
``{"results": [...], ...}`` (``mem0.Memory`` / ``AsyncMemory``; other keys such as a graph
memory's ``"relations"`` unchanged) or a bare list (the platform ``MemoryClient`` /
``AsyncMemoryClient``). Each memory dict comes as the client returned it plus
``"contextpilot"`` (its placement entry), in prompt order, memories already shown in an
earlier turn of the conversation (``conversation_id=``, else the ``run_id``, :mod:`.scope`)
replaced by a location hint (:mod:`.search_results`). The first ``top_k`` results in the
client's order are planned and returned; the rest are dropped. Mem0's other search arguments
are sent only when they differ from Mem0's defaults.

What the prompt shows for each memory is the plan's (``search_with_plan(...).plan``). Every
other method (``add``, ``get``, ``update``, ``delete``, ``history``, ``reset``, ...) and
attribute is the wrapped memory's own. Errors Mem0 raises (bad filters or ``top_k``, store
unavailable) reach the caller unchanged: the search runs before any planning.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from contextpilot_integrations.core.conversations.turns import TurnVisibility
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.planner_protocol import Planner, check_planner
from contextpilot_integrations.core.request import Scope
from contextpilot_integrations.mem0.layout import MEMORY_LAYOUT
from contextpilot_integrations.mem0.scope import scope_from_filters
from contextpilot_integrations.mem0.search_results import (
    MemorySearch,
    SearchResponse,
    aplan_search_results,
    plan_search_results,
)

__all__ = ["MEM0_DEFAULT_TOP_K", "AsyncContextPilotMemory", "ContextPilotMemory"]

MEM0_DEFAULT_TOP_K = 20
"""Mem0's default ``top_k`` (mem0ai 2.2 ``Memory.search``): the wrappers' default."""

# Mem0's defaults for its other search arguments (mem0ai 2.2 ``Memory.search``; the wrappers'
# signatures have the same; tests keep them equal). An argument equal to its default is not
# sent, so a client with other defaults (the platform's) applies its own, as it would unwrapped.
_MEM0_SEARCH_DEFAULTS: dict[str, object] = {
    "threshold": 0.1,
    "rerank": False,
    "explain": False,
    "reference_date": None,
    "show_expired": False,
}


def _search_arguments(
    filters: dict[str, Any] | None, top_k: int, search_kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The keyword arguments for the client's ``search``: ``filters`` and ``top_k``, and every
    other argument unless it is Mem0's default (same type and value)."""
    sent = {
        name: value
        for name, value in search_kwargs.items()
        if not (
            name in _MEM0_SEARCH_DEFAULTS
            and type(value) is type(_MEM0_SEARCH_DEFAULTS[name])
            and value == _MEM0_SEARCH_DEFAULTS[name]
        )
    }
    return {"filters": filters, "top_k": top_k, **sent}


class _MemoryWrapper:
    """Holds the wrapped memory and the planner; delegates every other attribute."""

    def __init__(
        self,
        memory: Any,
        *,
        pilot: Planner | None = None,
        visibility: TurnVisibility | None = None,
    ) -> None:
        search = getattr(memory, "search", None)
        if not callable(search):
            raise TypeError(
                f"memory must be a Mem0 Memory or AsyncMemory (an object with search()), got "
                f"{type(memory).__name__}"
            )
        if pilot is not None:
            check_planner(pilot)
        if visibility is not None and not isinstance(visibility, TurnVisibility):
            raise TypeError(
                f"visibility must be a TurnVisibility or None, got {type(visibility).__name__}"
            )
        self._memory = memory
        self._pilot: Planner = pilot if pilot is not None else ContextPilot(layout=MEMORY_LAYOUT)
        self._visibility = visibility

    @property
    def memory(self) -> Any:
        """The wrapped Mem0 memory."""
        return self._memory

    @property
    def pilot(self) -> Planner:
        """The planner (shared index, conversation store)."""
        return self._pilot

    def _scope(
        self,
        filters: Mapping[str, Any] | None,
        conversation_id: str | None,
        turn: int | None,
        visibility: TurnVisibility | None,
    ) -> Scope:
        return scope_from_filters(
            filters,
            conversation_id,
            turn=turn,
            visibility=visibility if visibility is not None else self._visibility,
        )

    def __getattr__(self, name: str) -> Any:
        """Every attribute not defined here is the wrapped memory's (``add``, ``get_all``,
        ``update``, ``delete``, ``history``, ``config``, ...)."""
        memory = self.__dict__.get("_memory")
        if memory is None or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(memory, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._memory!r})"


class ContextPilotMemory(_MemoryWrapper):
    """A Mem0 ``Memory`` whose ``search`` returns aligned, de-duplicated, marked results.

    Args:
        memory: a ``mem0.Memory``, the platform's ``mem0.MemoryClient``, or any object with a
            synchronous ``search(query, filters=..., top_k=..., ...)`` answering with a
            :data:`SearchResponse`.
        pilot: the planner; default a new in-process
            :class:`~contextpilot_integrations.core.pilot.ContextPilot` with
            :data:`~contextpilot_integrations.mem0.layout.MEMORY_LAYOUT`; any
            :class:`~contextpilot_integrations.core.planner_protocol.Planner` (the service clients
            too).
            Give the same one to every wrapper whose requests go to the same engine.
        visibility: which earlier turns the application's prompt still holds (default: all);
            a search can override it.

    Raises:
        TypeError: ``memory`` has no ``search``, or its ``search`` is a coroutine function
            (use :class:`AsyncContextPilotMemory`); a bad ``pilot`` or ``visibility``.
    """

    def __init__(
        self,
        memory: Any,
        *,
        pilot: Planner | None = None,
        visibility: TurnVisibility | None = None,
    ) -> None:
        super().__init__(memory, pilot=pilot, visibility=visibility)
        if inspect.iscoroutinefunction(memory.search):
            raise TypeError(
                f"{type(memory).__name__}.search is async (mem0.AsyncMemory): wrap it with "
                "AsyncContextPilotMemory"
            )

    def search(
        self,
        query: str,
        *,
        top_k: int = MEM0_DEFAULT_TOP_K,
        filters: dict[str, Any] | None = None,
        threshold: float = 0.1,
        rerank: bool = False,
        explain: bool = False,
        reference_date: Any | None = None,
        show_expired: bool = False,
        conversation_id: str | None = None,
        rid: str | None = None,
        turn: int | None = None,
        visibility: TurnVisibility | None = None,
        **kwargs: Any,
    ) -> SearchResponse:
        """Mem0's ``search``, aligned and de-duplicated.

        Args:
            query, filters, threshold, rerank, explain, reference_date, show_expired, kwargs:
                passed to Mem0's ``search`` unchanged, those equal to Mem0's default left out
                (mem0ai 2.2: ``filters`` must name at least one of user_id / agent_id / run_id;
                ``threshold`` is the minimum semantic score).
            top_k: the most results to plan and return; sent to Mem0's ``search``, and the
                first ``top_k`` of its answer are kept when it returns more (the rest are
                dropped).
            conversation_id: the conversation to de-duplicate in (default: the filters'
                ``run_id``; none: no de-duplication across searches); not sent to Mem0, so
                memories kept per user (``filters={"user_id": ...}``) can be de-duplicated
                within one of the user's conversations.
            rid: request id for the plan (default: a new one); it is in every result's entry.
            turn: the conversation turn (default: one after the conversation's latest); needs
                a conversation.
            visibility: earlier turns the prompt still holds (default: the wrapper's); applies
                only to a search with a conversation.

        Returns:
            The client's shape: ``{"results": [...]}`` (and every other key it returned,
            ``"relations"`` too, unchanged) or a bare list; its first ``top_k`` results once
            each, in output order, each with ``result["contextpilot"]``
            (:func:`~contextpilot_integrations.core.placement_metadata.placement_entry`).

        Raises:
            Whatever Mem0's ``search`` raises, unchanged (``ValueError`` for bad filters or
            parameters, the vector store's error when it is unavailable). TypeError: an answer
            of another shape (:func:`top_results`), a result that is not a dict with a str
            ``"memory"``. ValueError: a bad ``top_k`` that the client did not reject. TypeError
            / ValueError for a bad ``conversation_id``, ``rid``, ``turn`` (or one without a
            conversation) or ``visibility``; ``RidConflictError`` for a ``rid`` already planned.
        """
        return self.search_with_plan(
            query,
            top_k=top_k,
            filters=filters,
            threshold=threshold,
            rerank=rerank,
            explain=explain,
            reference_date=reference_date,
            show_expired=show_expired,
            conversation_id=conversation_id,
            rid=rid,
            turn=turn,
            visibility=visibility,
            **kwargs,
        ).response

    def search_with_plan(
        self,
        query: str,
        *,
        top_k: int = MEM0_DEFAULT_TOP_K,
        filters: dict[str, Any] | None = None,
        conversation_id: str | None = None,
        rid: str | None = None,
        turn: int | None = None,
        visibility: TurnVisibility | None = None,
        **search_kwargs: Any,
    ) -> MemorySearch:
        """:meth:`search`, returning the plan too (for prompt rendering: ``.context``).

        ``search_kwargs`` go to Mem0's ``search`` as :meth:`search`'s do (Mem0's defaults
        apply to the ones not given). Raises as :meth:`search`.
        """
        arguments = _search_arguments(filters, top_k, search_kwargs)
        response = self._memory.search(query, **arguments)
        scope = self._scope(filters, conversation_id, turn, visibility)
        return plan_search_results(self._pilot, query, response, scope, top_k=top_k, rid=rid)

    def __enter__(self) -> ContextPilotMemory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        close = getattr(self._memory, "close", None)
        if callable(close):
            close()


class AsyncContextPilotMemory(_MemoryWrapper):
    """The asynchronous twin of :class:`ContextPilotMemory`, wrapping a ``mem0.AsyncMemory``
    (or the platform's ``mem0.AsyncMemoryClient``).

    ``search`` and ``search_with_plan`` are coroutines; everything else is delegated (so
    ``add``, ``get_all``, ... are the wrapped memory's coroutines). Arguments and errors as
    :class:`ContextPilotMemory`.

    Raises:
        TypeError: ``memory.search`` is not a coroutine function (use
            :class:`ContextPilotMemory`); a bad ``pilot`` or ``visibility``.
    """

    def __init__(
        self,
        memory: Any,
        *,
        pilot: Planner | None = None,
        visibility: TurnVisibility | None = None,
    ) -> None:
        super().__init__(memory, pilot=pilot, visibility=visibility)
        if not inspect.iscoroutinefunction(memory.search):
            raise TypeError(
                f"{type(memory).__name__}.search is synchronous (mem0.Memory): wrap it with "
                "ContextPilotMemory"
            )

    async def search(
        self,
        query: str,
        *,
        top_k: int = MEM0_DEFAULT_TOP_K,
        filters: dict[str, Any] | None = None,
        threshold: float = 0.1,
        rerank: bool = False,
        explain: bool = False,
        reference_date: Any | None = None,
        show_expired: bool = False,
        conversation_id: str | None = None,
        rid: str | None = None,
        turn: int | None = None,
        visibility: TurnVisibility | None = None,
        **kwargs: Any,
    ) -> SearchResponse:
        """Mem0's ``AsyncMemory.search``, aligned and de-duplicated (see
        :meth:`ContextPilotMemory.search`)."""
        found = await self.search_with_plan(
            query,
            top_k=top_k,
            filters=filters,
            threshold=threshold,
            rerank=rerank,
            explain=explain,
            reference_date=reference_date,
            show_expired=show_expired,
            conversation_id=conversation_id,
            rid=rid,
            turn=turn,
            visibility=visibility,
            **kwargs,
        )
        return found.response

    async def search_with_plan(
        self,
        query: str,
        *,
        top_k: int = MEM0_DEFAULT_TOP_K,
        filters: dict[str, Any] | None = None,
        conversation_id: str | None = None,
        rid: str | None = None,
        turn: int | None = None,
        visibility: TurnVisibility | None = None,
        **search_kwargs: Any,
    ) -> MemorySearch:
        """:meth:`search`, returning the plan too (see
        :meth:`ContextPilotMemory.search_with_plan`)."""
        arguments = _search_arguments(filters, top_k, search_kwargs)
        response = await self._memory.search(query, **arguments)
        scope = self._scope(filters, conversation_id, turn, visibility)
        return await aplan_search_results(self._pilot, query, response, scope, top_k=top_k, rid=rid)

    async def __aenter__(self) -> AsyncContextPilotMemory:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        close = getattr(self._memory, "close", None)
        if callable(close):
            result = close()
            if inspect.isawaitable(result):
                await result
