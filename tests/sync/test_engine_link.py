"""EngineLink: each source kind through the link (capacity, TTL, KV events from the real ZMQ
protocol publisher), resync after a restore, failures absorbed, lifecycle, engine_connected."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from contextpilot_integrations.core.index.context_index import ContextIndex
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.sync.cache_state_source import SentRequest
from contextpilot_integrations.sync.capacity_model import CapacityModel
from contextpilot_integrations.sync.engine_link import EngineLink
from contextpilot_integrations.sync.event_publisher import KVEventPublisher
from contextpilot_integrations.sync.kv_event_source import KVEventSource
from contextpilot_integrations.sync.kv_events import BlockRemoved, BlockStored, KVEventBatch
from contextpilot_integrations.sync.ttl_model import TTLModel


class Planner:
    """Plans through a real ContextPilot (no engine link of its own): the plans' rids, block
    ids and tokens are the ones a user's link records."""

    def __init__(self) -> None:
        self.pilot = ContextPilot()
        self.index = self.pilot.index

    def plan(self, rid: str, *texts: str) -> Plan:
        return self.pilot.plan(f"question {rid}?", list(texts), rid=rid)


def tokens_of(plan: Plan) -> int:
    return sum(p.tokens for p in plan.blocks)


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events))  # type: ignore[arg-type]


def held(link: EngineLink) -> list[str]:
    """The rids the link's capacity or TTL model holds, least recently used first."""
    assert isinstance(link.source, (CapacityModel, TTLModel))
    return link.source.held_requests()


def link_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("engine-link", "kv-"))]


# ---------------------------------------------------------------------------------------------
# Capacity
# ---------------------------------------------------------------------------------------------


def test_capacity_lru_evictions_reach_on_evict_with_their_cause() -> None:
    planner = Planner()
    first = planner.plan("a", "alpha " * 40)
    budget = 2 * tokens_of(first) + 5  # room for two requests of this size, not three
    link = EngineLink({"kind": "capacity", "capacity_tokens": budget}).bind(planner.index.evict)
    with link:
        assert isinstance(link.source, CapacityModel) and link.engine_connected is None
        link.record([first])
        link.record([planner.plan("b", "beta " * 40)])
        link.touch("a")  # a cache hit: b is now the least recently used
        link.record([planner.plan("c", "gamma " * 40)])
        assert sorted(planner.index.rids()) == ["a", "c"]
        assert link.stats()["evictions"] == {"capacity": 1}
        assert held(link) == ["a", "c"]
        link.forget("a")  # the index dropped it by itself: no callback, no eviction counted
        assert held(link) == ["c"] and "a" in planner.index.rids()
        link.record([planner.plan("empty", "   ")])  # shows no block: not recorded
        assert held(link) == ["c"]
        link.register_tokens("c", [1, 2, 3])  # token matching is for KV events only
        stats = link.stats()
    assert stats["cache_model"] == "capacity" and stats["failures"] == {}
    assert stats["source"]["evicted"] == 1 and stats["resync_pending"] is False


def test_capacity_resync_records_the_restored_requests_oldest_first() -> None:
    index = ContextIndex(max_requests=None)
    for rid in ("old", "mid", "new"):
        index.insert(rid, [1])
    restored = [("old", ((1, 60),)), ("mid", ((2, 60),)), ("new", ((3, 60),))]
    with EngineLink({"kind": "capacity", "capacity_tokens": 150}).bind(index.evict) as link:
        link.resync(restored, downtime_s=10_000.0)  # no time in a capacity model
        assert held(link) == ["mid", "new"]
        assert index.rids() == ["mid", "new"]
        assert link.stats()["evictions"] == {"capacity": 1}
        assert not link.resync_pending


def ttl_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "ttl-model-expiry"]


def test_a_pilot_binds_starts_and_stops_an_unbound_link() -> None:
    link = EngineLink({"kind": "capacity", "capacity_tokens": 100})
    assert not link.bound
    with ContextPilot(engine=link) as pilot:
        assert pilot.engine is link and link.bound
        pilot.plan("q1", ["one " * 60], rid="first")
        pilot.plan("q2", ["two " * 60], rid="second")
        assert pilot.index.rids() == ["second"]
        assert pilot.stats()["sync"]["evictions"] == {"capacity": 1}
    ttl = EngineLink({"kind": "ttl", "ttl_s": 60})
    with ContextPilot(engine=ttl):
        assert ttl_threads() == ["ttl-model-expiry"]
    assert ttl_threads() == []


def test_a_link_its_owner_bound_is_only_recorded_with() -> None:
    evicted: list[str] = []

    def owner(rid: str) -> bool:
        evicted.append(rid)
        return True

    with EngineLink({"kind": "ttl", "ttl_s": 60, "min_cached_tokens": 0}).bind(owner) as link:
        with ContextPilot(engine=link) as first, ContextPilot(engine=link) as second:
            first.plan("q1", ["one " * 60], rid="a")
            second.plan("q2", ["two " * 60], rid="b")
            assert held(link) == ["a", "b"]
        assert ttl_threads() == ["ttl-model-expiry"]  # the pilots did not stop it
    assert ttl_threads() == []
    with pytest.raises(ValueError, match="bound already"):
        link.bind(owner)


def test_a_pilots_engine_must_be_a_link() -> None:
    with pytest.raises(TypeError, match=r"engine must be an engine link.*'kv-events'"):
        ContextPilot(engine={"kind": "kv-events"})  # type: ignore[arg-type]


def test_the_configuration_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match=r"cache_sync must be a mapping.*'kv-events'"):
        EngineLink("kv-events")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# TTL
# ---------------------------------------------------------------------------------------------


def ttl_link(index: ContextIndex, ttl_s: float) -> EngineLink:
    return EngineLink({"kind": "ttl", "ttl_s": ttl_s, "min_cached_tokens": 0}).bind(index.evict)


def test_ttl_expiry_reaches_on_evict_and_a_hit_refreshes() -> None:
    planner = Planner()
    with ttl_link(planner.index, ttl_s=0.3) as link:
        assert isinstance(link.source, TTLModel) and link.engine_connected is None
        link.record([planner.plan("a", "alpha " * 40), planner.plan("b", "beta " * 40)])
        time.sleep(0.2)
        link.touch("b")
        time.sleep(0.15)  # a: 0.35 s since its use, b: 0.15 s
        link.record([planner.plan("c", "gamma " * 40)])  # expiry runs on each record
        assert sorted(planner.index.rids()) == ["b", "c"]
        assert link.stats()["evictions"] == {"ttl": 1}


def test_ttl_resync_after_downtime_below_ttl_keeps_them_until_they_expire() -> None:
    index = ContextIndex(max_requests=None)
    index.insert("r1", [1])
    index.insert("r2", [2])
    with ttl_link(index, ttl_s=0.3) as link:
        link.resync([("r1", ((1, 50),)), ("r2", ((2, 50),))], downtime_s=0.1)
        assert held(link) == ["r1", "r2"]
        assert index.rids() == ["r1", "r2"] and link.stats()["evictions"] == {}
        time.sleep(0.35)
        assert isinstance(link.source, TTLModel) and link.source.expire() == ["r1", "r2"]
        assert index.rids() == [] and link.stats()["evictions"] == {"ttl": 2}


def test_ttl_resync_after_downtime_at_or_above_ttl_evicts_every_restored_request() -> None:
    index = ContextIndex(max_requests=None)
    index.insert("r1", [1])
    index.insert("r2", [2])
    with ttl_link(index, ttl_s=300.0) as link:
        link.resync([("r1", ((1, 50),)), ("r2", ((2, 50),)), ("unknown", ())], downtime_s=300.0)
        assert index.rids() == []
        # "unknown" was not indexed: not counted as an eviction.
        assert link.stats()["evictions"] == {"resync": 2}
        assert held(link) == []


# ---------------------------------------------------------------------------------------------
# KV events, from the protocol publisher over ZMQ
# ---------------------------------------------------------------------------------------------


def kv_link(pub_ep: str, replay_ep: str | None, index: ContextIndex, **settings) -> EngineLink:
    config = {"kind": "kv-events", "endpoint": pub_ep, "replay_endpoint": replay_ep, **settings}
    return EngineLink(config).bind(index.evict)


def test_kv_events_stored_and_removed_evict_the_right_rid(endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    planner = Planner()
    a = planner.plan("a", "alpha " * 40)
    b = planner.plan("b", "alpha " * 40, "beta " * 40)
    c = planner.plan("c", "gamma " * 40)
    with (
        kv_link(pub_ep, replay_ep, planner.index) as link,
        KVEventPublisher(pub_ep, replay_ep) as engine,
    ):
        assert isinstance(link.source, KVEventSource)
        link.record([a, b, c])
        link.register_tokens("c", [7, 7, 8, 8])  # c's engine echoes no session id
        engine.publish(
            batch(
                BlockStored([1, 2], None, [1, 1, 2, 2], block_size=2, session_id="a"),
                BlockStored([3], 2, [3, 3], block_size=2, session_id="b"),  # extends a's prefix
                BlockStored([4, 5], None, [7, 7, 8, 8], block_size=2),
            )
        )
        # Nothing else is published: the idle probe fetches the batch if the subscription
        # missed it.
        wait_for(lambda: link.source.mirror.cached_requests() == {"a", "b", "c"})
        engine.publish(batch(BlockRemoved([3])))  # b's leaf
        wait_for(lambda: sorted(planner.index.rids()) == ["a", "c"])
        engine.publish(batch(BlockRemoved([4])))  # an inner block of c's chain
        wait_for(lambda: planner.index.rids() == ["a"])
        engine.publish(batch(BlockRemoved([2])))
        wait_for(lambda: planner.index.rids() == [])
        stats = link.stats()
    assert stats["evictions"] == {"kv-events": 3} and stats["failures"] == {}
    assert stats["source"]["subscriber"]["malformed"] == 0


def test_kv_events_resync_is_pending_until_the_stream_is_joined(endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    index = ContextIndex(max_requests=None)
    for rid in ("kept", "gone", "later"):
        index.insert(rid, [1])
    restored = [("kept", ((1, 50),)), ("gone", ((2, 50),))]
    with kv_link(pub_ep, replay_ep, index, engine_grace_s=30.0) as link:
        link.resync(restored, downtime_s=30.0)
        assert link.resync_pending and link.stats()["resync_pending"]
        time.sleep(0.3)  # no engine yet: still waiting, within the grace
        assert link.resync_pending and sorted(index.rids()) == ["gone", "kept", "later"]
        link.resync([("later", ())], downtime_s=30.0)  # a second restore joins the first
        with KVEventPublisher(pub_ep, replay_ep) as engine:
            # The engine still caches "kept" (the replay of its buffer re-attributes it).
            engine.publish(batch(BlockStored([10], None, [5, 5], block_size=2, session_id="kept")))
            wait_for(lambda: not link.resync_pending)
            assert index.rids() == ["kept"]
            assert link.stats()["evictions"] == {"resync": 2}
            assert link.stats()["failures"] == {}
            engine.publish(batch(BlockRemoved([10])))
            wait_for(lambda: index.rids() == [])
            assert link.stats()["evictions"] == {"resync": 2, "kv-events": 1}


def test_a_rank_that_never_publishes_does_not_keep_the_resync_pending(
    free_port_range, wait_for
) -> None:
    # After a restore, a data-parallel rank that never publishes must not keep the service
    # resync_pending for good. After the grace the resync finishes with the ranks that
    # joined: what none of them holds is evicted, and a failure is counted.
    base = free_port_range(4)
    pub_ep, replay_ep = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 2}"
    index = ContextIndex(max_requests=None)
    for rid in ("kept", "gone"):
        index.insert(rid, [1])
    link = kv_link(pub_ep, replay_ep, index, dp_size=2, engine_grace_s=1.0)
    with KVEventPublisher(pub_ep, replay_ep) as rank0, link:  # rank 1 never comes up
        assert isinstance(link.source, KVEventSource)
        rank0.publish(batch(BlockStored([10], None, [5, 5], block_size=2, session_id="kept")))
        wait_for(lambda: link.source.mirror.cached_requests() == {"kept"})  # type: ignore[union-attr]
        link.resync([("kept", ((1, 50),)), ("gone", ((2, 50),))], downtime_s=30.0)
        assert link.resync_pending
        assert link.source.subscriber.stats()["joined"] == [True, False]
        wait_for(lambda: not link.resync_pending, timeout_s=5)
        stats = link.stats()
    assert index.rids() == ["kept"] and stats["evictions"] == {"resync": 1}
    assert stats["failures"]["resync_timeout"] == 1


def test_a_resync_waiting_over_a_stop_goes_on_after_the_next_start(endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    index = ContextIndex(max_requests=None)
    index.insert("gone", [1])
    link = kv_link(pub_ep, replay_ep, index)
    link.resync([("gone", ())], downtime_s=1.0)  # before start: waits for it
    assert link.resync_pending and "kv-events-resync" not in link_threads()
    link.start()
    link.stop()
    assert link.resync_pending and index.rids() == ["gone"]
    with KVEventPublisher(pub_ep, replay_ep) as engine, link:
        engine.publish(batch(BlockStored([1], None, [1, 1], block_size=2, session_id="other")))
        wait_for(lambda: not link.resync_pending)
    assert index.rids() == [] and link.stats()["evictions"] == {"resync": 1}


def test_engine_connected_follows_the_publisher(endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    index = ContextIndex(max_requests=None)
    with kv_link(pub_ep, replay_ep, index, engine_grace_s=0.2) as link:
        assert link.engine_connected is False
        wait_for(lambda: link.stats()["failures"].get("engine_unreachable") == 1)
        with KVEventPublisher(pub_ep, replay_ep):
            wait_for(lambda: link.engine_connected is True)
        wait_for(lambda: link.engine_connected is False)
        # A second outage is counted again, once.
        wait_for(lambda: link.stats()["failures"]["engine_unreachable"] == 2)
        time.sleep(0.3)
        assert link.stats()["failures"]["engine_unreachable"] == 2
        assert link.stats()["engine_connected"] is False


# ---------------------------------------------------------------------------------------------
# Failures absorbed, lifecycle
# ---------------------------------------------------------------------------------------------


class FailingSource:
    """A cache-state source whose every call raises."""

    def record(self, request: SentRequest) -> list[str]:
        raise RuntimeError("record broke")

    def touch(self, rid: str) -> bool:
        raise RuntimeError("touch broke")

    def forget(self, rid: str) -> bool:
        raise RuntimeError("forget broke")

    def start(self) -> None:
        pass

    def stop(self) -> None:
        raise RuntimeError("stop broke")

    def stats(self) -> dict:
        raise RuntimeError("stats broke")


def test_a_source_that_raises_is_counted_and_logged_once_never_raised(caplog) -> None:
    planner = Planner()
    link = EngineLink({"kind": "capacity", "capacity_tokens": 1_000}).bind(planner.index.evict)
    link.source = FailingSource()
    caplog.set_level(logging.DEBUG, logger="contextpilot_integrations.sync.engine_link")
    link.start()
    for rid in ("a", "b", "c"):
        link.record([planner.plan(rid, f"text of {rid} " * 10)])
    link.touch("a")
    link.forget("a")
    stats = link.stats()
    link.stop()
    assert stats["failures"] == {"record": 3, "touch": 1, "forget": 1, "stats": 1}
    assert stats["source"] == {}
    assert link.stats()["failures"]["stop"] == 1
    records = [r for r in caplog.records if r.name == "contextpilot_integrations.sync.engine_link"]
    warnings = [r.getMessage().split(")")[0] for r in records if r.levelno == logging.WARNING]
    assert sorted(warnings) == [
        f"sync path failure ({kind}" for kind in ("forget", "record", "stats", "stop", "touch")
    ]
    assert sum("record broke" in r.getMessage() for r in records) == 3  # the later two at debug
    assert sorted(planner.index.rids()) == ["a", "b", "c"]  # planning went on


def test_an_on_evict_that_raises_is_counted_not_raised() -> None:
    calls: list[str] = []

    def broken_index(rid: str) -> bool:
        calls.append(rid)
        raise RuntimeError("index unavailable")

    with EngineLink({"kind": "capacity", "capacity_tokens": 100}).bind(broken_index) as link:
        link.source.record(SentRequest("a", ((1, 80),)))
        link.source.record(SentRequest("b", ((2, 80),)))  # evicts a through the link
        link.resync([("c", ((3, 80),))], downtime_s=0.0)  # evicts b
        stats = link.stats()
    assert calls == ["a", "b"]
    assert stats["failures"] == {"evict": 2} and stats["evictions"] == {}


def test_start_and_stop_are_idempotent(endpoints) -> None:
    pub_ep, replay_ep = endpoints()
    link = kv_link(pub_ep, replay_ep, ContextIndex(max_requests=None))
    assert isinstance(link.source, KVEventSource)
    assert link.start() is link and link.start() is link
    assert link.source.subscriber.running and link_threads().count("engine-link-watch") == 1
    link.stop()
    link.stop()
    assert not link.source.subscriber.running and "engine-link-watch" not in link_threads()
    with link:  # restartable
        assert link.source.subscriber.running
    assert not link.source.subscriber.running


def test_bad_configuration_names_the_field() -> None:
    with pytest.raises(ValueError, match="capacity_tokens"):
        EngineLink({"kind": "capacity"})
    with pytest.raises(ValueError, match="engine_grace_s"):
        EngineLink({"kind": "kv-events", "endpoint": "tcp://127.0.0.1:1", "engine_grace_s": 0})
