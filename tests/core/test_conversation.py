"""ConversationStore: records, visibility, turn numbering, bounds (LRU, TTL, turns), threads."""

from __future__ import annotations

import threading

import pytest

from contextpilot_integrations.core.conversations.conversation import ConversationStore
from contextpilot_integrations.core.conversations.turns import MAX_TURN, Location, TurnVisibility


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
    history.commit()
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
    history.commit()
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
            history.commit()

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
            history.commit()

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
    first.commit()
    with store.open_turn("", "c") as second:
        assert second.turn == 2  # records nothing: every block was replaced by a hint
    second.commit()
    with store.open_turn("", "c") as third:
        assert third.turn == 3


def test_numbering_continues_after_ttl_lru_and_forget_and_old_turns_are_gone() -> None:
    clock = FakeClock()
    store = ConversationStore(ttl_seconds=10, max_conversations=2, clock=clock)
    assert _record(store, "a", None, [1]) == 1
    assert _record(store, "a", None, [2]) == 2
    clock.now = 20  # "a" expires
    assert ("t", "a") not in store
    assert _record(store, "a", None, [3]) == 3  # never turn 1 again
    with store.open_turn("t", "a") as history:
        assert history.turn == 4
        assert history.find_block(1) is None and history.find_block(3) == Location(3, "[Doc 1]")
    history.abort()
    _record(store, "b", None, [1])
    _record(store, "c", None, [1])  # evicts "a" (LRU)
    assert _record(store, "a", None, [5]) == 4
    assert store.forget("t", "a") is True
    assert _record(store, "a", None, [6]) == 5
    assert store.stats()["amnesic"] is False


def test_a_store_restored_from_a_checkpoint_numbers_no_turn_until_the_app_does() -> None:
    store = ConversationStore()
    _record(store, "c", None, [1])  # turn 1, numbered by the store
    _record(store, "c", None, [2])  # turn 2
    checkpoint = store.snapshot()
    restored = ConversationStore()
    assert restored.restore(checkpoint) == 0 and restored.stats()["amnesic"] is True
    # Turns may have been planned, retried or forgotten after the checkpoint: the store knows
    # neither the next number nor whether its records still hold, so it points to none.
    with restored.open_turn("t", "c") as history:
        assert history.turn is None and history.number == -1
        assert history.find_block(1) is None
        history.record_block(3, "[Doc 1]")
        assert history.find_block(3) == Location(-1, "[Doc 1]")  # in this message
    history.commit()  # records nothing
    with restored.open_turn("t", "c") as history:
        assert history.turn is None and history.find_block(3) is None
    history.abort()
    assert _record(restored, "c", 7, [4]) == 7  # the app's own number
    assert _record(restored, "c", None, [5]) == 8  # and the store counts on from it
    with restored.open_turn("t", "c", None, TurnVisibility.last(3)) as history:
        assert history.find_block(4) == Location(7, "[Doc 1]")
    history.abort()
    final = ConversationStore()
    assert final.restore(restored.snapshot(final=True)) == 1
    # A final snapshot loses nothing: "c" counts on; the store stays amnesic for others.
    assert final.stats()["amnesic"] is True and _record(final, "c", None, [6]) == 9
    clean = ConversationStore()
    _record(clean, "x", None, [1])
    clean_copy = ConversationStore()
    clean_copy.restore(clean.snapshot(final=True))
    assert clean_copy.stats()["amnesic"] is False and _record(clean_copy, "x", None, [2]) == 2
    with clean_copy.open_turn("t", "x") as history:
        assert history.find_block(1) == Location(1, "[Doc 1]")
    history.abort()


def test_new_conversations_of_an_amnesic_store_and_the_apps_numbers() -> None:
    store = ConversationStore()
    store.mark_history_lost()
    with store.open_turn("t", "new") as history:
        assert history.turn is None  # maybe not really its first turn
    history.commit()
    _record(store, "app", 7, [1])  # the app numbers its turns: its records are its own
    with store.open_turn("t", "app", 8) as history:
        assert history.find_block(1) == Location(7, "[Doc 1]")
    history.abort()
    assert store.stats()["unnumbered"] == 1


def test_snapshot_round_trip_and_malformed_snapshots() -> None:
    clock = FakeClock()
    store = ConversationStore(clock=clock)
    _record(store, "c", 1, [1, 2**64 - 1])
    _record(store, "gone", 1, [5])
    store.forget("t", "gone")
    snapshot = store.snapshot(final=True)
    import json

    copy = ConversationStore(clock=clock)
    copy.restore(json.loads(json.dumps(snapshot)))
    with copy.open_turn("t", "c", 2) as history:
        assert history.find_block(2**64 - 1) == Location(1, "[Doc 2]")
    history.abort()
    assert _record(copy, "gone", None, [1]) == 2  # the tombstone came along
    checkpoint = ConversationStore(clock=clock)
    assert checkpoint.restore(store.snapshot()) == 0
    assert _record(checkpoint, "gone", None, [1]) is None  # turns may be missing: unnumbered
    assert _record(checkpoint, "c", None, [1]) is None
    for bad in (
        None,
        {"version": 2},
        {"version": 1, "conversations": "x", "tombstones": []},
        {"version": 1, "conversations": [{"tenant": "t"}], "tombstones": []},
        {
            "version": 1,
            "tombstones": [],
            "conversations": [
                {
                    "tenant": "t",
                    "conversation_id": "c",
                    "idle_s": -1,
                    "floor": 0,
                    "continuous": True,
                    "unverified": [],
                    "turns": [],
                }
            ],
        },
        {"version": 1, "conversations": [], "tombstones": [["t", "c", -5, True]]},
    ):
        target = ConversationStore()
        with pytest.raises(ValueError, match="malformed conversation snapshot"):
            target.restore(bad)
        assert len(target) == 0 and target.stats()["amnesic"] is True


def test_tombstone_overflow_makes_the_store_amnesic() -> None:
    store = ConversationStore(max_conversations=1, max_tombstones=1)
    _record(store, "a", None, [1])
    _record(store, "b", None, [1])  # a buried
    assert store.stats()["amnesic"] is False
    _record(store, "c", None, [1])  # b buried, a's tombstone forgotten
    assert store.stats()["amnesic"] is True


def test_the_largest_turn_number_is_accepted_and_numbering_past_it_is_refused_clearly() -> None:
    store = ConversationStore()
    assert _record(store, "long chat", MAX_TURN, [1]) == MAX_TURN  # the app's own number
    with pytest.raises(ValueError) as refused:
        _record(store, "long chat", None, [2])
    message = str(refused.value)
    assert "conversation 'long chat' is at turn 2147483647" in message and "scope.turn" in message
    assert str(MAX_TURN + 1) not in message  # never a number the app did not send
    assert _record(store, "long chat", 7, [2]) == 7  # the app's own number goes on from there
    assert _record(store, "long chat", None, [3]) == 8
    with pytest.raises(ValueError, match=r"turn must be in 0\.\.2147483647, got 2147483648"):
        _record(store, "c", MAX_TURN + 1, [1])
