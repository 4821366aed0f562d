"""Choosing the cache-state source by configuration; the KV-events source end to end."""

from __future__ import annotations

import time

import pytest

from contextpilot_integrations.core.index.context_index import ContextIndex
from contextpilot_integrations.sync.cache_state_source import CacheStateSource, SentRequest
from contextpilot_integrations.sync.capacity_model import CapacityModel
from contextpilot_integrations.sync.configuration import CacheSyncConfig, build_cache_state_source
from contextpilot_integrations.sync.event_publisher import KVEventPublisher
from contextpilot_integrations.sync.kv_event_source import KVEventSource
from contextpilot_integrations.sync.kv_events import BlockRemoved, BlockStored, KVEventBatch
from contextpilot_integrations.sync.ttl_model import TTLModel


def test_each_kind_builds_its_source() -> None:
    ttl = build_cache_state_source({"kind": "ttl", "provider": "anthropic-1h"}, None)
    assert isinstance(ttl, TTLModel) and ttl.ttl_s == 3600 and ttl.min_cached_tokens == 1024
    custom = build_cache_state_source({"kind": "ttl", "ttl_s": 10, "min_cached_tokens": 0}, None)
    assert isinstance(custom, TTLModel) and custom.ttl_s == 10 and custom.min_cached_tokens == 0
    capacity = build_cache_state_source({"kind": "capacity", "capacity_tokens": 5}, None)
    assert isinstance(capacity, CapacityModel) and capacity.capacity_tokens == 5
    events = build_cache_state_source(
        CacheSyncConfig(kind="kv-events", endpoint="tcp://*:5557", dp_size=2), None
    )
    assert isinstance(events, KVEventSource)
    assert events.subscriber.endpoints == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]
    bounded = build_cache_state_source(
        {"kind": "kv-events", "endpoint": "tcp://h:1", "max_blocks": 10}, None
    )
    assert isinstance(bounded, KVEventSource) and bounded.mirror._blocks.max_blocks == 10
    for source in (ttl, capacity, events):
        assert isinstance(source, CacheStateSource)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kind": "redis"}, "$.kind"),
        ({"kind": "kv-events"}, "'endpoint'"),
        ({"kind": "capacity"}, "'capacity_tokens'"),
        ({"kind": "capacity", "capacity_tokens": "many"}, "$.capacity_tokens"),
        ({"kind": "ttl"}, "'provider' or 'ttl_s'"),
        ({"kind": "ttl", "provider": "gemini"}, "$.provider"),
        ({"kind": "ttl", "ttl_s": 5, "colour": "red"}, "colour"),
        ({"kind": "kv-events", "endpoint": "tcp://h:1", "max_blocks": 0}, "max_blocks"),
    ],
)
def test_bad_configuration_names_the_field(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("$", r"\$")):
        build_cache_state_source(settings, None)


def test_kv_event_source_follows_the_engine_into_the_index(endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    index = ContextIndex(max_requests=None)
    source = build_cache_state_source(
        {"kind": "kv-events", "endpoint": pub_ep, "replay_endpoint": replay_ep}, index.evict
    )
    source.start()  # before the engine
    try:
        with KVEventPublisher(pub_ep, replay_ep) as engine:
            index.insert("by-tokens", [1, 2])
            source.record(SentRequest("by-tokens", ((1, 2), (2, 2)), token_ids=(7, 7, 8, 8)))
            index.insert("by-session", [3])
            source.record(SentRequest("by-session", ((3, 2),)))  # no tokens: session echo
            stored = [
                BlockStored([10, 11], None, [7, 7, 8, 8], block_size=2),
                BlockStored([20], None, [5, 5], block_size=2, session_id="by-session"),
            ]
            engine.publish(KVEventBatch(ts=time.time(), events=stored))
            # Nothing else is published: the idle probe fetches the batch from the replay
            # socket if the subscription missed it.
            wait_for(lambda: source.stats()["mirror"]["attributed_requests"] == 2)
            assert source.touch("by-tokens") and not source.touch("unknown")
            assert source.stats()["subscriber"]["joined"] == [True]
            engine.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved([11])]))
            wait_for(lambda: index.rids() == ["by-session"])
            engine.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved([20])]))
            wait_for(lambda: index.rids() == [])
            assert not source.forget("by-session")  # already evicted
    finally:
        source.stop()
    assert source.stats()["subscriber"]["malformed"] == 0


@pytest.mark.parametrize("field", ["endpoint", "replay_endpoint"])
@pytest.mark.parametrize("value", ["http://127.0.0.1:5557", "127.0.0.1:5557", "kv-events"])
def test_an_endpoint_that_is_not_zmq_is_named_at_once(field: str, value: str) -> None:
    settings = {"kind": "kv-events", "endpoint": "tcp://127.0.0.1:5557", field: value}
    with pytest.raises(ValueError, match=rf"{field} must be a ZMQ endpoint .*got '{value}'"):
        CacheSyncConfig.from_mapping(settings)


def test_zmq_transports_are_accepted() -> None:
    for endpoint in ("tcp://127.0.0.1:5557", "ipc:///tmp/kv.ipc", "inproc://kv"):
        assert CacheSyncConfig.from_mapping({"kind": "kv-events", "endpoint": endpoint})
