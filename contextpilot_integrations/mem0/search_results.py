"""One Mem0 search answer planned: its memories aligned and de-duplicated, marked, in output order.

The wrappers (:mod:`.memory`) and the memory contexts (:mod:`.context`) plan each answer here;
:func:`plan_search_results` also takes an answer obtained any other way. A memory's text is
its block text (a memory Mem0 updates gets a new block id).

Each memory dict comes as the client returned it plus ``"contextpilot"``, the placement entry
every face attaches (:mod:`contextpilot_integrations.core.placement_metadata`; ``index`` is
Mem0's rank). The results come in the plan's output order
(:meth:`~contextpilot_integrations.core.plan.Plan.output_order`):

1. memories placed in the prompt, in prompt order (``status="shown"``, ``position`` 0, 1, ...;
   those recent requests placed first come first, so the engine's prefix cache reuses them);
2. memories replaced by a hint (their text stands in an earlier turn of this conversation that
   the prompt still holds), in hint order (``"replaced"``);
3. repeats of a memory text already in this answer (``"duplicate"``, ``duplicate_of``), by rank;
4. memories with empty or whitespace-only text (``"skipped"``), by rank.

Mem0's relevance order stays in ``index`` and, when the prompt order differs, in the order
annotation. Only the first ``top_k`` results in the client's order are planned and returned,
each once (:func:`top_results`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from contextpilot_integrations.core.placement_metadata import METADATA_KEY, placement_entry
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.planner_protocol import Planner
from contextpilot_integrations.core.request import Scope
from contextpilot_integrations.mem0.layout import memory_context

__all__ = [
    "MemorySearch",
    "SearchResponse",
    "aplan_search_results",
    "plan_search_results",
    "top_results",
]

SearchResponse: TypeAlias = dict[str, Any] | list[dict[str, Any]]
"""A Mem0 search answer: ``{"results": [...], ...}`` (``mem0.Memory``, ``AsyncMemory``; a graph
memory adds ``"relations"``) or a bare list of results (the platform clients; Mem0's v1.0
output format)."""


@dataclass(frozen=True)
class MemorySearch:
    """One aligned search.

    Attributes:
        response: the client's answer with the results marked and in output order (what
            ``search`` returns), in the client's shape (:data:`SearchResponse`).
        plan: the ContextPilot plan of the memories (``plan.rid``, ``plan.scope``: the tenant,
            conversation and turn it was de-duplicated in, ``plan.blocks``).
    """

    response: SearchResponse
    plan: Plan

    @property
    def results(self) -> list[dict[str, Any]]:
        """The marked results (the response itself when it is a bare list)."""
        return self.response if isinstance(self.response, list) else self.response["results"]

    @property
    def context(self) -> str:
        """The memory context: system prompt, placed memories, hints, order annotation (the
        plan's prompt without the question), to put before the conversation's messages."""
        return memory_context(self.plan)


def top_results(response: object, top_k: int | None = None) -> list[Any]:
    """The results of a Mem0 search answer in the client's (relevance) order, the first
    ``top_k`` of them.

    Args:
        response: ``{"results": [...], ...}`` or a bare list of results (:data:`SearchResponse`).
        top_k: how many to keep (``None``: all); the results beyond it are dropped.

    Returns:
        A new list of the answer's result objects (not copies; not checked one by one).

    Raises:
        TypeError: ``response`` is neither a mapping with a ``"results"`` list nor a list; the
            message names what was received.
        ValueError: ``top_k`` is not an int >= 0 (as Mem0 rejects it).
    """
    if isinstance(response, list):
        results = response
    elif isinstance(response, Mapping) and isinstance(response.get("results"), list):
        results = response["results"]
    else:
        raise TypeError(
            "a Mem0 search answer must be a dict with a 'results' list or a list of results, "
            f"got {type(response).__name__}: {response!r:.200}"
        )
    if top_k is None:
        return list(results)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    return results[:top_k]


def _memory_texts(results: list[Any]) -> list[str]:
    """Every result's ``"memory"`` text, in Mem0's order (blank ones too: the plan skips them)."""
    texts = []
    for rank, result in enumerate(results):
        if not isinstance(result, Mapping):
            raise TypeError(
                f"Mem0 search results[{rank}] must be a dict, got {type(result).__name__}: "
                f"{result!r:.200}"
            )
        text = result.get("memory")
        if not isinstance(text, str):
            raise TypeError(
                f"Mem0 search results[{rank}]['memory'] must be a str, got "
                f"{type(text).__name__}: {text!r:.200}"
            )
        texts.append(text)
    return texts


def _marked(response: object, results: list[Any], plan: Plan) -> MemorySearch:
    """``response``'s shape with ``results`` in the plan's output order, each with its entry."""
    marked = [
        {**results[p.index], METADATA_KEY: placement_entry(plan, p)} for p in plan.output_order()
    ]
    if isinstance(response, Mapping):
        return MemorySearch({**response, "results": marked}, plan)
    return MemorySearch(marked, plan)


def plan_search_results(
    pilot: Planner,
    query: str,
    response: Mapping[str, Any] | list[Any],
    scope: Scope,
    *,
    top_k: int | None = None,
    rid: str | None = None,
) -> MemorySearch:
    """Align and de-duplicate one Mem0 search answer.

    Args:
        pilot: the planner (its index is shared by every request to the same engine).
        query: the search query (the plan's question).
        response: the client's answer, ``{"results": [{"memory": str, ...}, ...], ...}`` or a
            bare list of such results.
        scope: the search's scope (:func:`~.scope.scope_from_filters` of its filters).
        top_k: plan only the first ``top_k`` results (``None``: all); the rest are dropped.
        rid: the request id for the plan (default: a new one).

    Returns:
        The :class:`MemorySearch`; its ``response`` has ``response``'s shape (every other key of
        a dict unchanged) and each planned result exactly once (module docstring for the order
        and the entries).

    Raises:
        TypeError: ``response`` is neither a mapping with a ``"results"`` list nor a list, or a
            planned result is not a mapping whose ``"memory"`` is a str.
        ValueError: ``top_k`` is not an int >= 0.
        TypeError / ValueError / RidConflictError: from the pilot, for a bad or taken ``rid``.
    """
    results = top_results(response, top_k)
    plan = pilot.plan(query, _memory_texts(results), rid=rid, scope=scope)
    return _marked(response, results, plan)


async def aplan_search_results(
    pilot: Planner,
    query: str,
    response: Mapping[str, Any] | list[Any],
    scope: Scope,
    *,
    top_k: int | None = None,
    rid: str | None = None,
) -> MemorySearch:
    """:func:`plan_search_results` for a coroutine: awaits ``pilot.aplan`` (the event loop
    goes on while the pilot plans)."""
    results = top_results(response, top_k)
    plan = await pilot.aplan(query, _memory_texts(results), rid=rid, scope=scope)
    return _marked(response, results, plan)
