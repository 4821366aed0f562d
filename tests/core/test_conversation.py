"""ConversationStore: records, visibility, turn numbering, bounds (LRU, TTL, turns), threads."""

from __future__ import annotations

import threading

import pytest

from contextpilot_integrations.core.conversation import (
    ConversationStore,
    Location,
    TurnVisibility,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _record(store: ConversationStore, conv: str, turn: int | None, ids: list[int]) -> int:
    with store.open_turn("t", conv, turn) as history:
        for i, key in enumerate(ids):
            history.record_block(key, f"[Doc {i + 1}]")
            history.record_sub_block(key, f"[Doc {i + 1}]", 0)
        return history.turn


def test_first_visible_occurrence_is_returned() -> None:
    store = ConversationStore()
    _record(store, "c", 1, [10, 20])
    _record(store, "c", 2, [20, 30])
    with store.open_turn("t", "c", 3) as history:
        assert history.find_block(20) == Location(1, "[Doc 2]")
        assert history.find_sub_block(30) == Location(2, "[Doc 2]", 0)
        assert history.find_block(99) is None
    with store.open_turn("t", "c", 4, TurnVisibility.last(2)) as history:
        assert history.find_block(10) is None  # turn 1 is outside the window
        assert history.find_block(20) == Location(2, "[Doc 1]")
    with store.open_turn("t", "c", 5, TurnVisibility.only([1])) as history:
        assert history.find_block(30) is None
        assert history.find_block(20) == Location(1, "[Doc 2]")


def test_current_turn_is_always_visible() -> None:
    store = ConversationStore()
    with store.open_turn("t", "c", 1, TurnVisibility.last(0)) as history:
        history.record_block(5, "[Doc 1]")
        assert history.find_block(5) == Location(1, "[Doc 1]")


def test_turn_visibility_rules() -> None:
    assert TurnVisibility.all().includes(1, 9)
    assert not TurnVisibility.all().includes(10, 9)
    window = TurnVisibility.last(2)
    assert [t for t in range(1, 10) if window.includes(t, 6)] == [4, 5, 6]
    explicit = TurnVisibility.only({1, 3})
    assert [t for t in range(1, 6) if explicit.includes(t, 5)] == [1, 3, 5]


def test_turn_numbers_default_to_one_after_the_latest() -> None:
    store = ConversationStore()
    assert _record(store, "c", None, [1]) == 1
    assert _record(store, "c", None, [2]) == 2
    assert _record(store, "c", 7, [3]) == 7
    assert _record(store, "c", None, [4]) == 8


def test_replanning_a_turn_drops_it_and_later_turns() -> None:
    store = ConversationStore()
    _record(store, "c", 1, [1])
    _record(store, "c", 2, [2])
    _record(store, "c", 3, [3])
    _record(store, "c", 2, [4])  # retry of turn 2 with other blocks
    with store.open_turn("t", "c", None) as history:
        assert history.turn == 3
        assert history.find_block(1) == Location(1, "[Doc 1]")
        assert history.find_block(2) is None
        assert history.find_block(3) is None
        assert history.find_block(4) == Location(2, "[Doc 1]")


def test_error_inside_a_turn_drops_its_records() -> None:
    store = ConversationStore()
    with pytest.raises(KeyError), store.open_turn("t", "c", 1) as history:
        history.record_block(1, "[Doc 1]")
        raise KeyError("boom")
    with store.open_turn("t", "c", 2) as history:
        assert history.find_block(1) is None
    assert store.stats()["blocks"] == 0


def test_handle_is_dead_after_its_block() -> None:
    store = ConversationStore()
    with store.open_turn("t", "c", 1) as history:
        pass
    with pytest.raises(RuntimeError, match="after its open_turn"):
        history.record_block(1, "[Doc 1]")
    with pytest.raises(RuntimeError):
        history.find_block(1)


def test_tenants_and_conversations_are_separate() -> None:
    store = ConversationStore()
    with store.open_turn("tenant-a", "c", 1) as history:
        history.record_block(1, "[Doc 1]")
    for tenant, conv in (("tenant-b", "c"), ("tenant-a", "other")):
        with store.open_turn(tenant, conv, 2) as history:
            assert history.find_block(1) is None
    assert len(store) == 3


def test_lru_eviction_keeps_the_most_recently_used() -> None:
    store = ConversationStore(max_conversations=2)
    _record(store, "a", 1, [1])
    _record(store, "b", 1, [1])
    _record(store, "a", 2, [2])  # a is now the most recent
    _record(store, "c", 1, [1])  # evicts b
    assert ("t", "a") in store and ("t", "c") in store and ("t", "b") not in store
    assert store.stats()["evicted"] == 1
    with store.open_turn("t", "b", 2) as history:  # b starts over: nothing to point to
        assert history.find_block(1) is None


def test_ttl_expiry_is_sliding() -> None:
    clock = FakeClock()
    store = ConversationStore(ttl_seconds=10, clock=clock)
    _record(store, "a", 1, [1])
    clock.now = 8
    _record(store, "b", 1, [1])
    clock.now = 15  # a unused for 15 s, b for 7 s
    assert ("t", "a") not in store and ("t", "b") in store
    clock.now = 17
    with store.open_turn("t", "b", 2) as history:  # still alive (9 s), and refreshed
        assert history.find_block(1) == Location(1, "[Doc 1]")
    clock.now = 26
    assert len(store) == 1
    clock.now = 28
    assert len(store) == 0
    assert store.stats()["expired"] == 2


def test_max_turns_drops_oldest_turns() -> None:
    store = ConversationStore(max_turns=2)
    for turn in (1, 2, 3):
        _record(store, "c", turn, [turn])
    with store.open_turn("t", "c", 4) as history:
        assert history.find_block(1) is None
        assert history.find_block(2) == Location(2, "[Doc 1]")
    assert store.stats()["turns"] == 2


def test_forget() -> None:
    store = ConversationStore()
    _record(store, "c", 1, [1])
    assert store.forget("t", "c") is True
    assert store.forget("t", "c") is False
    assert len(store) == 0


def test_bad_arguments_name_the_field() -> None:
    store = ConversationStore()
    with pytest.raises(TypeError, match="conversation_id"), store.open_turn("t", None):  # type: ignore[arg-type]
        pass
    with pytest.raises(ValueError, match="conversation_id"), store.open_turn("t", ""):
        pass
    with pytest.raises(TypeError, match="tenant"), store.open_turn(None, "c"):  # type: ignore[arg-type]
        pass
    with pytest.raises(ValueError, match="turn"), store.open_turn("t", "c", -1):
        pass
    with pytest.raises(TypeError, match="turn"), store.open_turn("t", "c", True):
        pass
    with pytest.raises(TypeError, match="visibility"), store.open_turn("t", "c", 1, 3):  # type: ignore[arg-type]
        pass
    with pytest.raises(ValueError, match="n "):
        TurnVisibility.last(-1)
    with pytest.raises(TypeError, match="turns"):
        TurnVisibility.only("12")
    with pytest.raises(TypeError, match="turns"):
        TurnVisibility.only([1, "2"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not both"):
        TurnVisibility(last_turns=1, turns=frozenset({1}))
    with pytest.raises(ValueError, match="max_conversations"):
        ConversationStore(max_conversations=0)
    with pytest.raises(ValueError, match="ttl_seconds"):
        ConversationStore(ttl_seconds=0)
    with pytest.raises(ValueError, match="max_turns"):
        ConversationStore(max_turns=0)
    assert len(store) == 0


def test_concurrent_turns_on_one_conversation_get_distinct_turn_numbers() -> None:
    store = ConversationStore(max_turns=10_000)
    turns: list[int] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        for i in range(50):
            with store.open_turn("t", "shared") as history:
                history.record_block(seed * 1000 + i, "[Doc 1]")
                with lock:
                    turns.append(history.turn)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(turns) == list(range(1, 401))
    assert store.stats()["blocks"] == 400


def test_concurrent_conversations_see_only_their_own_records() -> None:
    store = ConversationStore(max_conversations=100)
    errors: list[str] = []

    def worker(conv: int) -> None:
        for turn in range(1, 40):
            with store.open_turn("t", f"c{conv}", turn) as history:
                # every conversation records the same ids, each with its own label
                if turn > 1 and history.find_block(7) != Location(1, f"[Doc {conv}]"):
                    errors.append(f"c{conv} turn {turn}: {history.find_block(7)}")
                if turn == 1:
                    history.record_block(7, f"[Doc {conv}]")
                history.record_block(turn, "[Doc 1]")

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert store.stats()["conversations"] == 16


def test_a_turn_that_records_nothing_still_takes_its_number():
    store = ConversationStore()
    with store.open_turn("", "c") as first:
        first.record_block(1, "[Doc 1]")
    with store.open_turn("", "c") as second:
        assert second.turn == 2  # records nothing: every block was replaced by a hint
    with store.open_turn("", "c") as third:
        assert third.turn == 3
