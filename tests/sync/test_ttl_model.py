"""TTLModel: expiry after the last use, refresh on use, minimum cacheable prompt, timer."""

from __future__ import annotations

import time

import pytest

from contextpilot_integrations.sync.cache_state_source import SentRequest
from contextpilot_integrations.sync.ttl_model import TTLModel


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def sent(rid: str, tokens: int = 2_000) -> SentRequest:
    return SentRequest(rid, ((1, tokens),))


def test_entries_expire_ttl_after_their_last_use() -> None:
    clock, evicted = Clock(), []
    model = TTLModel(300, evicted.append, clock=clock)
    model.record(sent("a"))
    clock.now += 200
    model.record(sent("b"))
    clock.now += 99
    assert model.expire() == []
    clock.now += 1  # a is 300 s old
    assert model.expire() == ["a"] and evicted == ["a"]
    assert model.touch("b")  # a cache hit refreshes b
    clock.now += 299
    assert model.expire() == [] and model.held_requests() == ["b"]
    assert not model.touch("a")


def test_record_expires_lazily_and_short_prompts_are_never_cached() -> None:
    clock, evicted = Clock(), []
    model = TTLModel.openai(evicted.append, clock=clock)
    model.record(sent("old"))
    clock.now += 301
    assert model.record(sent("short", tokens=1_000)) == ["old", "short"]
    assert model.stats()["too_short"] == 1 and model.held_requests() == []


def test_presets_follow_the_providers_documentation() -> None:
    assert TTLModel.openai().ttl_s == 300 and TTLModel.openai().min_cached_tokens == 1024
    assert TTLModel.anthropic().ttl_s == 300
    assert TTLModel.anthropic(one_hour=True).ttl_s == 3600


def test_bounded_by_max_requests() -> None:
    model = TTLModel(60, max_requests=2)
    model.record(sent("a"))
    model.record(sent("b"))
    assert model.record(sent("c")) == ["a"]


def test_timer_thread_expires_in_the_background() -> None:
    evicted: list[str] = []
    model = TTLModel(0.05, evicted.append, check_interval_s=0.02)
    model.record(sent("a"))
    model.start()
    model.start()  # idempotent
    try:
        deadline = time.monotonic() + 5
        while not evicted:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        model.stop()
    assert evicted == ["a"]
    model.stop()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ttl_s": 0}, "ttl_s"),
        ({"ttl_s": 1, "min_cached_tokens": -1}, "min_cached_tokens"),
        ({"ttl_s": 1, "max_requests": 0}, "max_requests"),
        ({"ttl_s": 1, "check_interval_s": 0}, "check_interval_s"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TTLModel(**kwargs)
