"""The Mem0 wrapper over every answer shape Mem0's clients return.

- ``mem0.Memory`` / ``mem0.AsyncMemory`` (mem0ai 2.2): ``{"results": [...]}``.
- Graph memory (mem0ai with a ``graph_store``, ``enable_graph``):
  ``{"results": [...], "relations": [...]}``. mem0ai 2.2 has no graph store, so the stand-in is
  a real ``Memory`` whose answer gets the graph search's ``relations`` list (``source`` /
  ``relationship`` / ``destination`` dicts).
- A bare list of results: the platform ``MemoryClient`` / ``AsyncMemoryClient`` (the API
  reference's search response, which mem0's own proxy reads as a list) and Mem0's v1.0 output
  format (the stand-in: a real ``Memory`` answering with its ``"results"`` list).
- A client that ignores ``top_k`` (a real ``Memory`` that always asks its store for 1,000).

The platform clients are mem0's own classes and their own ``search``; only the HTTP transport is
replaced (an ``httpx.MockTransport`` answering as the platform API does), because the API is a
network service these tests cannot reach.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mem0 import AsyncMemory, AsyncMemoryClient, Memory, MemoryClient

from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.placement_metadata import METADATA_KEY, PLACEMENT_KEYS
from contextpilot_integrations.mem0 import (
    MEMORY_LAYOUT,
    AsyncContextPilotMemory,
    ContextPilotMemory,
    aplan_search_results,
    plan_search_results,
    scope_from_filters,
)
from contextpilot_integrations.mem0.context import asearch_memory_context, search_memory_context
from contextpilot_integrations.mem0.layout import plain_memory_context

ALL = {"top_k": 100, "threshold": 0.0}  # every memory of the scope, best first
ALICE = {"user_id": "alice"}

# Long enough (> 30 tokens) that a location hint saves tokens, so a repeated search in the same
# conversation replaces them.
FACTS = [
    "Alice has been vegetarian since 2015 and avoids fish as well; when she cooks for friends "
    "she makes lentil curry, roasted vegetables and flatbread from her grandmother's recipe.",
    "Alice moved from Lyon to Montreal in March 2021 for a research position in computational "
    "biology at McGill, and she rents a small apartment near the Plateau with her cat Miso.",
    "Alice drinks green tea every morning, never coffee after noon, and keeps a shelf of "
    "Japanese sencha and gyokuro that her brother sends her from Shizuoka twice a year.",
]

# The relations a graph memory returns beside its results (Mem0's graph search: one dict per
# edge).
RELATIONS = [
    {"source": "alice", "relationship": "lives_in", "destination": "montreal"},
    {"source": "alice", "relationship": "drinks", "destination": "green_tea"},
]

MANY = [
    f"Alice noted item {i}: the {i}th entry of her reading list, volume {i}." for i in range(50)
]


# --- stand-ins: real Mem0 memories answering in another shape ---------------------------------


def _bare_list(answer: dict[str, Any]) -> Any:
    return answer["results"]


def _with_relations(answer: dict[str, Any]) -> Any:
    return {**answer, "relations": RELATIONS}


def _unchanged(answer: dict[str, Any]) -> Any:
    return answer


SHAPES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "results": _unchanged,
    "results+relations": _with_relations,
    "bare-list": _bare_list,
}


def _memory_class(
    base: type[Memory] | type[AsyncMemory],
    reshape: Callable[[dict[str, Any]], Any],
    *,
    ignores_top_k: bool = False,
) -> type:
    """A subclass of the real ``base`` whose ``search`` runs Mem0's own search and reshapes its
    answer (and, with ``ignores_top_k``, asks for 1,000 results whatever ``top_k`` says); it
    keeps each answer in ``answers``."""
    if issubclass(base, AsyncMemory):

        class AsyncStandIn(AsyncMemory):
            answers: list[Any]

            async def search(self, query: str, **kwargs: Any) -> Any:
                if ignores_top_k:
                    kwargs["top_k"] = 1000
                answer = reshape(await super().search(query, **kwargs))
                self.__dict__.setdefault("answers", []).append(answer)
                return answer

        return AsyncStandIn

    class StandIn(Memory):
        answers: list[Any]

        def search(self, query: str, **kwargs: Any) -> Any:
            if ignores_top_k:
                kwargs["top_k"] = 1000
            answer = reshape(super().search(query, **kwargs))
            self.__dict__.setdefault("answers", []).append(answer)
            return answer

    return StandIn


def _call(result: Any) -> Any:
    """The value of a sync call, or of an async one run to completion."""
    return asyncio.run(result) if inspect.iscoroutine(result) else result


@pytest.fixture
def open_memory(
    tmp_path: Path, mem0_config: Callable[..., dict[str, Any]]
) -> Iterator[Callable[..., Any]]:
    """``open_memory(mode, shape, ignores_top_k=False, facts=FACTS)``: a real Mem0 memory
    (``mode`` "sync" or "async") answering in ``shape``, holding ``facts`` for Alice."""
    opened: list[Any] = []

    def open_memory(
        mode: str, shape: str, *, ignores_top_k: bool = False, facts: list[str] = FACTS
    ) -> Any:
        base = AsyncMemory if mode == "async" else Memory
        cls = _memory_class(base, SHAPES[shape], ignores_top_k=ignores_top_k)
        memory = cls.from_config(mem0_config(tmp_path / f"{mode}-{len(opened)}"))
        opened.append(memory)
        for text in facts:
            _call(memory.add(text, infer=False, **ALICE))
        return memory

    yield open_memory
    for memory in opened:
        memory.close()


def _wrap(memory: Any, pilot: ContextPilot | None = None) -> Any:
    if inspect.iscoroutinefunction(memory.search):
        return AsyncContextPilotMemory(memory, pilot=pilot)
    return ContextPilotMemory(memory, pilot=pilot)


def _results(answer: Any) -> list[dict[str, Any]]:
    return answer if isinstance(answer, list) else answer["results"]


def _without_mark(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != METADATA_KEY}


def _statuses(answer: Any) -> list[str]:
    return [r[METADATA_KEY]["status"] for r in _results(answer)]


# --- every shape, sync and async ------------------------------------------------------------


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_answer_shape_keeps_its_shape_with_every_result_marked(
    open_memory: Callable[..., Any], mode: str, shape: str
) -> None:
    raw = open_memory(mode, shape)
    memory = _wrap(raw)
    relations_before = copy.deepcopy(RELATIONS)
    found = _call(
        memory.search("What does Alice drink?", filters=ALICE, conversation_id="chat", **ALL)
    )
    expected = raw.answers[-1]  # what Mem0 answered to this very search

    assert type(found) is type(expected)
    assert found is not expected and all(METADATA_KEY not in r for r in _results(expected))
    if isinstance(expected, dict):
        assert set(found) == set(expected)
    if shape == "results+relations":
        assert found["relations"] is RELATIONS and relations_before == RELATIONS
    by_id = {r["id"]: r for r in _results(expected)}
    assert len(by_id) == len(FACTS)
    assert sorted(r["id"] for r in _results(found)) == sorted(by_id)
    # Output order: the placed memories in prompt order, each with its entry; Mem0's rank kept.
    assert [r[METADATA_KEY]["position"] for r in _results(found)] == list(range(len(FACTS)))
    for result in _results(found):
        assert _without_mark(result) == by_id[result["id"]]
        assert list(result[METADATA_KEY]) == list(PLACEMENT_KEYS)
        assert _results(expected)[result[METADATA_KEY]["index"]]["id"] == result["id"]
    assert _statuses(found) == ["shown"] * len(FACTS)

    # The plan is real: the same memories, later in the conversation, become hints.
    again = _call(
        memory.search("Where does Alice live?", filters=ALICE, conversation_id="chat", **ALL)
    )
    assert type(again) is type(expected)
    assert _statuses(again) == ["replaced"] * len(FACTS)


@pytest.mark.parametrize("shape", ["results", "bare-list"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_top_k_is_enforced_when_the_client_ignores_it(
    open_memory: Callable[..., Any], mode: str, shape: str
) -> None:
    raw = open_memory(mode, shape, ignores_top_k=True, facts=MANY)
    memory = _wrap(raw)
    query = "What is on Alice's reading list?"
    found = _call(memory.search_with_plan(query, filters=ALICE, top_k=10, threshold=0.0))
    everything = _results(raw.answers[-1])  # what Mem0 answered to this very search
    assert len(everything) == len(MANY), "the stand-in honoured top_k: nothing to enforce"
    scores = [r["score"] for r in everything]
    assert scores == sorted(scores, reverse=True)  # Mem0's relevance order
    assert isinstance(found.response, list) == (shape == "bare-list")
    # The first ten in Mem0's relevance order are planned and returned; the other 40 dropped.
    assert len(found.results) == len(found.plan.placements) == 10
    assert sorted(r[METADATA_KEY]["index"] for r in found.results) == list(range(10))
    for result in found.results:
        assert result["id"] == everything[result[METADATA_KEY]["index"]]["id"]
    assert len(found.plan.blocks) == 10

    none = _call(memory.search_with_plan(query, filters=ALICE, top_k=0))
    assert _results(none.response) == [] and none.plan.placements == ()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_bad_top_k_for_a_client_that_ignores_it_is_named(
    open_memory: Callable[..., Any], mode: str
) -> None:
    pilot = ContextPilot(layout=MEMORY_LAYOUT)
    memory = _wrap(open_memory(mode, "bare-list", ignores_top_k=True), pilot)
    for top_k in (-1, True, 2.5, "3"):
        with pytest.raises(ValueError, match=r"top_k must be an int >= 0, got"):
            _call(memory.search("tea", filters=ALICE, top_k=top_k))
    assert pilot.stats()["requests"] == 0


# --- the platform clients ------------------------------------------------------------------


def _platform_memories(count: int) -> list[dict[str, Any]]:
    """Search results as the platform API reference documents them (one dict per memory)."""
    return [
        {
            "id": f"3c90c3cc-0d44-4b50-8888-8dd2573605{i:02d}",
            "memory": f"{FACTS[i % len(FACTS)]} (platform memory {i})",
            "user_id": "alice",
            "metadata": {},
            "categories": ["personal_information"],
            "created_at": "2025-11-07T05:31:56Z",
            "updated_at": "2025-11-07T05:31:56Z",
            "score": round(0.9 - i / 100, 2),
        }
        for i in range(count)
    ]


class PlatformAPI:
    """An ``httpx.MockTransport`` handler answering as the Mem0 platform does: the key check
    (``GET /v1/ping/``) and search (``POST /v3/memories/search/``) with ``answer``, whatever
    ``top_k`` the request asks for. ``searches`` records every search body."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.searches: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/ping/":
            return httpx.Response(200, json={"org_id": "org", "project_id": "project"})
        assert (request.method, request.url.path) == ("POST", "/v3/memories/search/")
        self.searches.append(json.loads(request.content))
        return httpx.Response(200, json=self.answer)


def _platform_client(mode: str, api: PlatformAPI, monkeypatch: pytest.MonkeyPatch) -> Any:
    transport = httpx.MockTransport(api)
    if mode == "sync":
        return MemoryClient(api_key="test-key", client=httpx.Client(transport=transport))

    # AsyncMemoryClient checks its key with a blocking requests.get, outside its httpx client.
    def validate(self: AsyncMemoryClient) -> None:
        self.org_id, self.project_id = "org", "project"

    monkeypatch.setattr(AsyncMemoryClient, "_validate_api_key", validate)
    return AsyncMemoryClient(api_key="test-key", client=httpx.AsyncClient(transport=transport))


@pytest.mark.parametrize("answer_shape", ["bare-list", "results"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_platform_client(monkeypatch: pytest.MonkeyPatch, mode: str, answer_shape: str) -> None:
    """The platform ``MemoryClient`` / ``AsyncMemoryClient`` (their own ``search``; the API is a
    network service these tests cannot reach, so a mock transport answers for it, with 15
    memories whatever ``top_k`` asks)."""
    memories = _platform_memories(15)
    api = PlatformAPI(memories if answer_shape == "bare-list" else {"results": memories})
    client = _platform_client(mode, api, monkeypatch)
    assert list(inspect.signature(client.search).parameters) == ["query", "options", "kwargs"]
    memory = _wrap(client)

    call = {"filters": ALICE, "top_k": 5, "threshold": 0.3}
    found = _call(memory.search("What does Alice drink?", conversation_id="chat", **call))
    unwrapped = _call(client.search("What does Alice drink?", **call))
    # The API gets the same request as from the unwrapped client (Mem0's defaults the caller
    # did not change are not sent), and the answer keeps the platform's shape.
    assert api.searches[0] == api.searches[1] == {"query": "What does Alice drink?", **call}
    assert type(found) is type(unwrapped)
    assert [r["id"] for r in _results(found)] == [m["id"] for m in memories[:5]]
    for rank, result in enumerate(_results(found)):
        assert _without_mark(result) == memories[rank]
        assert result[METADATA_KEY]["index"] == rank
        assert result[METADATA_KEY]["position"] == rank
    again = _call(memory.search("Where does Alice live?", conversation_id="chat", **call))
    assert _statuses(again) == ["replaced"] * 5


class _RecordingClient:
    """A client that records the keyword arguments of every search (and answers ``[]``)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def search(self, query: str, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return []


def test_only_filters_top_k_and_arguments_changed_from_mem0s_defaults_are_sent() -> None:
    """An argument left at Mem0's default is not sent: ``mem0.Memory`` applies the same default
    (the wrappers' signature is Mem0's), a platform client its own, as it would unwrapped."""
    client = _RecordingClient()
    memory = ContextPilotMemory(client)
    memory.search("q", filters=ALICE)
    memory.search("q", filters=ALICE, threshold=0.1, rerank=False, explain=False)
    changed = {
        "threshold": 0.5,
        "rerank": True,
        "explain": True,
        "reference_date": "2025-11-07",
        "show_expired": True,
        "categories": ["travel"],
    }
    memory.search("q", filters=ALICE, top_k=3, **changed)
    memory.search("q", filters=ALICE, threshold=0, rerank=0)  # other types: not the defaults
    assert client.calls == [
        {"filters": ALICE, "top_k": 20},
        {"filters": ALICE, "top_k": 20},
        {"filters": ALICE, "top_k": 3, **changed},
        {"filters": ALICE, "top_k": 20, "threshold": 0, "rerank": 0},
    ]


# --- the agent hooks' shared step ----------------------------------------------------------


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_memory_context_from_a_bare_list_keeps_top_k(
    open_memory: Callable[..., Any], mode: str, wrapped: bool
) -> None:
    raw = open_memory(mode, "bare-list", ignores_top_k=True)
    memory = _wrap(raw) if wrapped else raw
    search = asearch_memory_context if mode == "async" else search_memory_context
    found = _call(search(memory, "What does Alice eat?", ALICE, top_k=2, threshold=0.0))
    everything = raw.answers[-1]
    assert len(everything) == len(FACTS) > 2
    assert [r["id"] for r in found.results] == [r["id"] for r in everything[:2]]
    if wrapped:
        assert found.rid is not None and all(METADATA_KEY in r for r in found.results)
    else:
        assert found.text == plain_memory_context([r["memory"] for r in everything[:2]])


# --- answers of no known shape ---------------------------------------------------------------


class _OddClient:
    """A client whose search answers with ``answer`` (a shape no Mem0 client returns)."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def search(self, query: str, **kwargs: Any) -> Any:
        return self.answer


ODD_ANSWERS = [
    (None, "NoneType"),
    ("Alice drinks tea", "str"),
    (42, "int"),
    (({"memory": "x"},), "tuple"),
    ({"memories": [{"memory": "x"}]}, "dict"),
    ({"results": "x"}, "dict"),
    ({"results": None, "relations": []}, "dict"),
]


@pytest.mark.parametrize(("answer", "type_name"), ODD_ANSWERS)
def test_an_answer_of_no_known_shape_is_a_type_error_naming_it(answer: Any, type_name: str) -> None:
    pilot = ContextPilot(layout=MEMORY_LAYOUT)
    scope = scope_from_filters(ALICE)
    expected = rf"a Mem0 search answer must be .* got {type_name}: "
    for plan in (plan_search_results, lambda *a: asyncio.run(aplan_search_results(*a))):
        with pytest.raises(TypeError, match=expected):
            plan(pilot, "q", answer, scope)
    with pytest.raises(TypeError, match=expected):
        ContextPilotMemory(_OddClient(answer), pilot=pilot).search("q", filters=ALICE)
    with pytest.raises(TypeError, match=expected):
        search_memory_context(_OddClient(answer), "q", ALICE)
    assert pilot.stats()["requests"] == 0
