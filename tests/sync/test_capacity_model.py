"""CapacityModel: token budget, shared prefixes counted once, LRU eviction through on_evict."""

from __future__ import annotations

import pytest

from contextpilot_integrations.core.index.context_index import ContextIndex
from contextpilot_integrations.sync.cache_state_source import CacheStateSource, SentRequest
from contextpilot_integrations.sync.capacity_model import CapacityModel


def request(rid: str, *blocks: tuple[int, int]) -> SentRequest:
    return SentRequest(rid, tuple(blocks))


def test_shared_prefix_tokens_are_counted_once() -> None:
    model = CapacityModel(1_000)
    model.record(request("a", (1, 100), (2, 50)))
    model.record(request("b", (1, 100), (3, 70)))  # shares block 1 at the same position
    model.record(request("c", (2, 10), (1, 100)))  # block 1 at another position: not shared
    assert model.stats()["used_tokens"] == 100 + 50 + 70 + 10 + 100


def test_lru_requests_are_evicted_when_over_budget() -> None:
    evicted: list[str] = []
    model = CapacityModel(300, evicted.append)
    model.record(request("a", (1, 100), (2, 100)))
    model.record(request("b", (1, 100), (3, 100)))
    assert model.touch("a")  # a becomes most recently used
    assert model.record(request("c", (4, 100))) == ["b"]
    assert evicted == ["b"] and model.held_requests() == ["a", "c"]
    assert model.stats()["used_tokens"] == 300


def test_freeing_keeps_blocks_other_requests_hold() -> None:
    model = CapacityModel(250)
    model.record(request("a", (1, 100), (2, 100)))
    model.record(request("b", (1, 100), (3, 50)))
    assert model.record(request("c", (5, 100))) == ["a"]  # frees block 2 only
    assert model.stats()["used_tokens"] == 250


def test_a_request_larger_than_the_budget_is_evicted_too() -> None:
    model = CapacityModel(100)
    model.record(request("small", (1, 50)))
    assert model.record(request("huge", (2, 500))) == ["small", "huge"]
    assert model.stats()["used_tokens"] == 0


def test_re_recording_a_request_replaces_its_blocks() -> None:
    model = CapacityModel(1_000)
    model.record(request("a", (1, 100)))
    model.record(request("a", (2, 30)))
    assert model.stats() | {} == {
        "recorded": 2,
        "evicted": 0,
        "evict_callback_errors": 0,
        "used_tokens": 30,
        "capacity_tokens": 1_000,
        "requests": 1,
    }
    assert model.forget("a") and not model.forget("a") and model.stats()["used_tokens"] == 0


def test_evicts_from_the_context_index() -> None:
    index = ContextIndex(max_requests=None)
    model = CapacityModel(140, index.evict)
    assert isinstance(model, CacheStateSource)
    for rid, blocks in (("a", [1, 2]), ("b", [1, 3])):
        index.insert(rid, blocks)
        model.record(request(rid, *((b, 50) for b in blocks)))
    assert index.rids() == ["b"]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="capacity_tokens"):
        CapacityModel(0)
    with pytest.raises(ValueError, match="rid"):
        SentRequest("")
    with pytest.raises(ValueError, match="blocks"):
        SentRequest("r", ((1, -5),))
