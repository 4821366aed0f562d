"""ContextPilotMemory on a real Mem0 memory (local Qdrant, offline embeddings)."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest
from langchain_core.embeddings import DeterministicFakeEmbedding
from mem0 import AsyncMemory, Memory

from contextpilot_integrations.core.blocks import block_id
from contextpilot_integrations.core.conversations.turns import TurnVisibility
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.placement_metadata import METADATA_KEY, PLACEMENT_KEYS
from contextpilot_integrations.core.request import RidConflictError
from contextpilot_integrations.mem0 import (
    MEMORY_LAYOUT,
    AsyncContextPilotMemory,
    ContextPilotMemory,
    aplan_search_results,
    plan_search_results,
    scope_from_filters,
)

ALL = {"top_k": 100, "threshold": 0.0}  # every memory of the scope, best first

# Long enough (> 30 tokens) that a location hint saves tokens, so the de-duplication replaces
# a memory already shown in the conversation.
FACTS = [
    "Alice has been vegetarian since 2015 and avoids fish as well; when she cooks for friends "
    "she makes lentil curry, roasted vegetables and flatbread from her grandmother's recipe.",
    "Alice moved from Lyon to Montreal in March 2021 for a research position in computational "
    "biology at McGill, and she rents a small apartment near the Plateau with her cat Miso.",
    "Alice drinks green tea every morning, never coffee after noon, and keeps a shelf of "
    "Japanese sencha and gyokuro that her brother sends her from Shizuoka twice a year.",
    "Alice runs the Montreal half marathon every September and trains on Tuesday and Thursday "
    "evenings along the Lachine canal with a running club from her laboratory.",
]


def _add_all(memory: Any, texts: list[str], **scope: str) -> list[str]:
    return [memory.add(t, infer=False, **scope)["results"][0]["id"] for t in texts]


def _placed(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if r[METADATA_KEY]["status"] == "shown"]


def _hinted(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if r[METADATA_KEY]["status"] == "replaced"]


def _without_mark(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != METADATA_KEY}


# --- Mem0's shape ---------------------------------------------------------------------------


def test_search_returns_mem0_shape_with_the_same_results(tmp_path: Path, mem0_config: Any) -> None:
    # DeterministicFakeEmbedding: random but repeatable vectors, so Mem0 returns some subset.
    raw = Memory.from_config(mem0_config(tmp_path, DeterministicFakeEmbedding(size=64)))
    memory = ContextPilotMemory(raw)
    _add_all(memory, FACTS + ["Bob likes chess."], user_id="alice")
    expected = raw.search("What does Alice drink?", filters={"user_id": "alice"}, **ALL)
    found = memory.search("What does Alice drink?", filters={"user_id": "alice"}, **ALL)
    raw.close()

    assert set(found) == set(expected) == {"results"}
    assert expected["results"], "the fake embedding returned nothing: the test would be empty"
    by_id = {r["id"]: r for r in expected["results"]}
    assert sorted(r["id"] for r in found["results"]) == sorted(by_id)
    for result in found["results"]:
        assert _without_mark(result) == by_id[result["id"]]
        assert isinstance(result["memory"], str) and isinstance(result["score"], float)
        assert list(result[METADATA_KEY]) == list(PLACEMENT_KEYS)
        assert result[METADATA_KEY]["block_id"] == block_id(result["memory"])
        assert expected["results"][result[METADATA_KEY]["index"]]["id"] == result["id"]


def test_search_keeps_mem0_signature() -> None:
    for wrapper, wrapped in ((ContextPilotMemory, Memory), (AsyncContextPilotMemory, AsyncMemory)):
        ours = inspect.signature(wrapper.search).parameters
        for name, param in inspect.signature(wrapped.search).parameters.items():
            assert name in ours, f"{wrapper.__name__}.search lacks Mem0's {name}"
            assert ours[name].kind == param.kind, name
            assert ours[name].default == param.default, name


def test_results_in_prompt_order_and_context_matches(mem0_memory: Memory) -> None:
    memory = ContextPilotMemory(mem0_memory)
    _add_all(memory, FACTS, user_id="alice")
    user = {"filters": {"user_id": "alice"}, **ALL}
    first = memory.search_with_plan("green tea sencha gyokuro", **user)
    found = memory.search_with_plan("half marathon canal running club", **user)
    for search in (first, found):
        placed = _placed(search.results)
        assert [r[METADATA_KEY]["position"] for r in placed] == list(range(len(FACTS)))
        assert sorted(r[METADATA_KEY]["index"] for r in placed) == list(range(len(FACTS)))
        assert all(r[METADATA_KEY]["rid"] == search.plan.rid for r in search.results)
        context = search.context
        assert context.startswith(MEMORY_LAYOUT.system_prompt)
        assert "".join(search.plan.segments).startswith(context.split("Most relevant")[0])
        for r in placed:
            assert f"{r[METADATA_KEY]['label']}\n{r['memory']}\n" in context
        assert "Question:" not in context
    # The first search keeps Mem0's order: no annotation. The second is aligned to the first,
    # so its annotation names the placed memories in Mem0's relevance order.
    assert [r[METADATA_KEY]["index"] for r in first.results] == list(range(len(FACTS)))
    assert first.context.endswith("-----\n")
    by_rank = sorted(_placed(found.results), key=lambda r: r[METADATA_KEY]["index"])
    assert [r[METADATA_KEY]["position"] for r in by_rank] != list(range(len(FACTS)))
    assert found.context.endswith(
        MEMORY_LAYOUT.annotation([r[METADATA_KEY]["label"] for r in by_rank])
    )


def test_second_search_reuses_the_first_order(mem0_memory: Memory) -> None:
    memory = ContextPilotMemory(mem0_memory)
    _add_all(memory, FACTS, user_id="alice")
    first = memory.search("green tea sencha gyokuro", filters={"user_id": "alice"}, **ALL)
    question = "half marathon canal running club"
    raw_second = mem0_memory.search(question, filters={"user_id": "alice"}, **ALL)
    second = memory.search(question, filters={"user_id": "alice"}, **ALL)
    raw_orders = [r["memory"] for r in raw_second["results"]]
    first_order = [r["memory"] for r in _placed(first["results"])]
    assert raw_orders != first_order, "Mem0 ranked both queries alike: nothing to align"
    assert [r["memory"] for r in _placed(second["results"])] == first_order


# --- de-duplication within a conversation and isolation ---------------------------------------


def test_memories_shown_earlier_in_the_conversation_become_hints(mem0_memory: Memory) -> None:
    memory = ContextPilotMemory(mem0_memory)
    _add_all(memory, FACTS, user_id="alice")
    scope = {"filters": {"user_id": "alice"}, "conversation_id": "chat-1"}
    first = memory.search_with_plan("What does Alice eat?", **scope, **ALL)
    assert not _hinted(first.results)
    second = memory.search_with_plan("What does Alice drink?", **scope, **ALL)
    hinted = _hinted(second.results)
    assert {r["memory"] for r in hinted} == set(FACTS)
    for r in hinted:
        mark = r[METADATA_KEY]
        assert mark["label"] is None and second.plan.hints[mark["position"]] == mark["hint"]
        assert second.plan.placements[mark["index"]].rendered_text is None
        assert "turn 1" in mark["hint"] and mark["hint"] in second.context
        assert r["memory"] not in second.context
    # The replaced memories follow the shown ones (none here), in the order of their hints.
    assert [r[METADATA_KEY]["position"] for r in second.results] == list(range(len(FACTS)))
    # Every result is still there, once.
    assert sorted(r["id"] for r in second.results) == sorted(r["id"] for r in first.results)


def test_a_turn_that_drops_earlier_turns_gets_the_memories_again(mem0_memory: Memory) -> None:
    memory = ContextPilotMemory(mem0_memory)
    _add_all(memory, FACTS, user_id="alice")
    scope = {"filters": {"user_id": "alice"}, "conversation_id": "chat-1"}
    memory.search("What does Alice eat?", **scope, **ALL)
    again = memory.search(
        "What does Alice drink?", **scope, visibility=TurnVisibility.last(0), **ALL
    )
    assert not _hinted(again["results"])
    assert len(_placed(again["results"])) == len(FACTS)


ALICE_RUN_1 = ({"user_id": "alice", "run_id": "run-1"}, None)


@pytest.mark.parametrize(
    ("scope", "other"),
    [
        (ALICE_RUN_1, ({"user_id": "bob", "run_id": "run-1"}, None)),
        (ALICE_RUN_1, ({"user_id": "alice", "run_id": "run-2"}, None)),
        (ALICE_RUN_1, ({"user_id": "alice", "agent_id": "travel", "run_id": "run-1"}, None)),
        (({"user_id": "alice"}, "chat-1"), ({"user_id": "bob"}, "chat-1")),
        (({"user_id": "alice"}, "chat-1"), ({"user_id": "alice", "agent_id": "travel"}, "chat-1")),
    ],
    ids=[
        "user_id",
        "run_id",
        "agent_id",
        "user_id-same-conversation",
        "agent_id-same-conversation",
    ],
)
def test_scopes_never_deduplicate_against_each_other(
    mem0_memory: Memory,
    scope: tuple[dict[str, str], str | None],
    other: tuple[dict[str, str], str | None],
) -> None:
    memory = ContextPilotMemory(mem0_memory)
    # The same texts in both scopes (Mem0 matches every entity id of the filter).
    for filters, _ in (scope, other):
        _add_all(memory, FACTS, **filters)

    def search(where: tuple[dict[str, str], str | None], query: str) -> list[dict[str, Any]]:
        return memory.search(query, filters=where[0], conversation_id=where[1], **ALL)["results"]

    search(scope, "What does Alice eat?")
    in_other = search(other, "What does Alice eat?")
    assert len(in_other) == len(FACTS)
    assert not _hinted(in_other)
    # The same conversation does de-duplicate (the test can fail).
    assert len(_hinted(search(scope, "What does Alice drink?"))) == len(FACTS)


def test_an_updated_memory_is_not_deduplicated_against_its_old_text(mem0_memory: Memory) -> None:
    memory = ContextPilotMemory(mem0_memory)
    ids = _add_all(memory, FACTS, user_id="alice")
    scope = {"filters": {"user_id": "alice"}, "conversation_id": "chat-1"}
    first = memory.search("Where does Alice live?", **scope, **ALL)
    old = next(r for r in first["results"] if r["id"] == ids[1])
    new_text = FACTS[1].replace("Montreal", "Quebec City").replace("McGill", "Laval")
    memory.update(ids[1], text=new_text)
    second = memory.search("Where does Alice live?", **scope, **ALL)
    updated = next(r for r in second["results"] if r["id"] == ids[1])
    assert updated["memory"] == new_text
    assert updated[METADATA_KEY]["block_id"] == block_id(new_text) != old[METADATA_KEY]["block_id"]
    assert updated[METADATA_KEY]["status"] == "shown" and updated[METADATA_KEY]["hint"] is None
    assert updated[METADATA_KEY]["position"] == 0 and second["results"][0] is updated
    # The memories that did not change are hinted.
    assert {r["id"] for r in _hinted(second["results"])} == set(ids) - {ids[1]}


def test_identical_texts_are_placed_once(mem0_memory: Memory) -> None:
    memory = ContextPilotMemory(mem0_memory)
    ids = _add_all(memory, [FACTS[0], FACTS[0], FACTS[2]], user_id="alice")
    found = memory.search("vegetarian", filters={"user_id": "alice"}, **ALL)["results"]
    assert sorted(r["id"] for r in found) == sorted(ids)
    duplicates = [r for r in found if r[METADATA_KEY]["duplicate_of"] is not None]
    assert len(duplicates) == 1 and len(_placed(found)) == 2
    assert duplicates[0][METADATA_KEY]["status"] == "duplicate" and found[-1] is duplicates[0]
    assert duplicates[0][METADATA_KEY]["block_id"] == block_id(FACTS[0])
    twin = duplicates[0][METADATA_KEY]["duplicate_of"]
    assert [r["memory"] for r in found if r[METADATA_KEY]["index"] == twin] == [FACTS[0]]


# --- edge cases and errors ------------------------------------------------------------------


def test_no_memories_gives_empty_results(mem0_memory: Memory) -> None:
    memory = ContextPilotMemory(mem0_memory)
    _add_all(memory, FACTS, user_id="alice")
    found = memory.search_with_plan("anything", filters={"user_id": "nobody"}, **ALL)
    assert found.response == {"results": []}
    assert found.plan.blocks == () and found.plan.hints == ()


def test_memories_with_empty_text_come_back_unplaced(mem0_memory: Memory) -> None:
    memory = ContextPilotMemory(mem0_memory)
    _add_all(memory, [FACTS[0], "   ", "\n", FACTS[1]], user_id="alice")
    expected = mem0_memory.search("Alice", filters={"user_id": "alice"}, **ALL)["results"]
    found = memory.search_with_plan("Alice", filters={"user_id": "alice"}, **ALL)
    blank = [r for r in found.results if not r["memory"].strip()]
    assert len(blank) == len([r for r in expected if not r["memory"].strip()]) == 2
    assert found.results[-2:] == blank  # after every placed memory
    for r in blank:
        mark = r[METADATA_KEY]
        assert mark["status"] == "skipped"
        assert mark["block_id"] is None and mark["position"] is None and mark["label"] is None
    assert [r["memory"] for r in _placed(found.results)] == [
        r["memory"] for r in expected if r["memory"].strip()
    ]
    assert len(found.plan.blocks) == 2


def test_bad_filters_raise_mem0s_error(mem0_memory: Memory) -> None:
    memory = ContextPilotMemory(mem0_memory)
    for call in (
        lambda m: m.search("tea"),
        lambda m: m.search("tea", user_id="alice"),
        lambda m: m.search("tea", filters={"user_id": "has space"}),
        lambda m: m.search("tea", filters={"user_id": "alice"}, threshold=2.0),
        lambda m: m.search("tea", filters={"user_id": "alice"}, top_k=-1),
    ):
        with pytest.raises(ValueError) as expected:
            call(mem0_memory)
        with pytest.raises(ValueError) as raised:
            call(memory)
        assert str(raised.value) == str(expected.value)
    assert memory.pilot.stats()["requests"] == 0


def test_store_unavailable_raises_the_stores_error(mem0_memory: Memory) -> None:
    memory = ContextPilotMemory(mem0_memory)
    _add_all(memory, FACTS, user_id="alice")
    mem0_memory.vector_store.client.close()
    with pytest.raises(RuntimeError, match="closed"):
        memory.search("tea", filters={"user_id": "alice"})
    assert memory.pilot.stats()["requests"] == 0


def test_bad_answers_and_arguments_are_named(mem0_memory: Memory) -> None:
    pilot = ContextPilot(layout=MEMORY_LAYOUT)
    scope = scope_from_filters({"user_id": "a"})
    for plan in (plan_search_results, lambda *a: asyncio.run(aplan_search_results(*a))):
        with pytest.raises(TypeError, match="'results' list or a list of results, got dict"):
            plan(pilot, "q", {"memory": "x"}, scope)
        for answer in ({"results": [{"memory": "x"}, "y"]}, [{"memory": "x"}, "y"]):
            with pytest.raises(TypeError, match=r"results\[1\] must be a dict"):
                plan(pilot, "q", answer, scope)
        with pytest.raises(TypeError, match=r"results\[0\]\['memory'\] must be a str"):
            plan(pilot, "q", {"results": [{"id": "m1"}]}, scope)
    assert pilot.stats()["requests"] == 0
    with pytest.raises(TypeError, match="search"):
        ContextPilotMemory(object())
    with pytest.raises(TypeError, match="Planner"):
        ContextPilotMemory(mem0_memory, pilot=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="visibility"):
        ContextPilotMemory(mem0_memory, visibility="all")  # type: ignore[arg-type]
    memory = ContextPilotMemory(mem0_memory)
    _add_all(memory, FACTS[:1], user_id="alice")
    with pytest.raises(ValueError, match="turn=2 needs a scope.conversation_id"):
        memory.search("tea", filters={"user_id": "alice"}, turn=2)
    with pytest.raises(TypeError, match="conversation_id"):
        memory.search("tea", filters={"user_id": "alice"}, conversation_id=7)  # type: ignore[arg-type]
    memory.search("tea", filters={"user_id": "alice"}, rid="cp-mine")
    with pytest.raises(RidConflictError):
        memory.search("tea", filters={"user_id": "alice"}, rid="cp-mine")
    assert memory.pilot.stats()["requests"] == 1


def test_wrong_wrapper_for_sync_or_async(mem0_memory: Memory, mem0_async_memory: Any) -> None:
    with pytest.raises(TypeError, match="AsyncContextPilotMemory"):
        ContextPilotMemory(mem0_async_memory)
    with pytest.raises(TypeError, match="ContextPilotMemory"):
        AsyncContextPilotMemory(mem0_memory)


# --- everything else passes through ----------------------------------------------------------


def test_other_methods_pass_through(mem0_memory: Memory) -> None:
    memory = ContextPilotMemory(mem0_memory)
    assert memory.config is mem0_memory.config and memory.memory is mem0_memory
    added = memory.add(FACTS[0], user_id="alice", infer=False)
    memory_id = added["results"][0]["id"]
    assert added["results"][0]["memory"] == FACTS[0]
    assert memory.get(memory_id)["memory"] == FACTS[0]
    assert [m["id"] for m in memory.get_all(filters={"user_id": "alice"})["results"]] == [memory_id]
    memory.update(memory_id, text=FACTS[1])
    assert [h["event"] for h in memory.history(memory_id)] == ["ADD", "UPDATE"]
    memory.delete(memory_id)
    assert memory.get_all(filters={"user_id": "alice"})["results"] == []
    with pytest.raises(AttributeError):
        memory.no_such_method  # noqa: B018


class AwaitedOnlyPilot(ContextPilot):
    """A pilot whose blocking ``plan`` fails when called on an event loop's thread: the async
    wrapper must await ``aplan`` (which plans in a worker thread)."""

    def __init__(self) -> None:
        super().__init__(layout=MEMORY_LAYOUT)
        self.on_loop = self.in_worker = 0

    def plan(self, *args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.in_worker += 1
            return super().plan(*args, **kwargs)
        self.on_loop += 1
        raise AssertionError("a blocking plan() on the event loop")


def test_async_memory_search(mem0_async_memory: Any) -> None:
    pilot = AwaitedOnlyPilot()

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        memory = AsyncContextPilotMemory(mem0_async_memory, pilot=pilot)
        for text in FACTS:
            await memory.add(text, user_id="alice", infer=False)
        scope = {"filters": {"user_id": "alice"}}
        raw = await mem0_async_memory.search("What does Alice eat?", **scope, **ALL)
        first = await memory.search("What does Alice eat?", conversation_id="c", **scope, **ALL)
        second = await memory.search("What does Alice drink?", conversation_id="c", **scope, **ALL)
        return raw, first, second

    raw, first, second = asyncio.run(scenario())
    assert sorted(r["id"] for r in first["results"]) == sorted(r["id"] for r in raw["results"])
    assert len(_placed(first["results"])) == len(FACTS)
    assert {r["memory"] for r in _hinted(second["results"])} == set(FACTS)
    assert pilot.on_loop == 0 and pilot.in_worker == 2


def test_wrappers_sharing_a_pilot_align_against_one_index(tmp_path: Path, mem0_config: Any) -> None:
    # Two application processes' memories (two Mem0 stores, the same user's facts), one index:
    # the second wrapper's memories come in the order the first one placed them.
    stores = [Memory.from_config(mem0_config(tmp_path / name)) for name in ("a", "b")]
    pilot = ContextPilot(layout=MEMORY_LAYOUT)
    first, second = (ContextPilotMemory(store, pilot=pilot) for store in stores)
    for memory in (first, second):
        _add_all(memory, FACTS, user_id="alice")
    user = {"filters": {"user_id": "alice"}, **ALL}
    placed = first.search("green tea sencha gyokuro", **user)["results"]
    raw = stores[1].search("half marathon canal running club", **user)["results"]
    again = second.search("half marathon canal running club", **user)["results"]
    assert [r["memory"] for r in raw] != [r["memory"] for r in placed]
    assert [r["memory"] for r in again] == [r["memory"] for r in placed]
    assert pilot.stats()["requests"] == 2
    for store in stores:
        store.close()
