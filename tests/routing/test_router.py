"""The replica router: the replica with the longest aligned prefix within the imbalance bound,
a batch partitioned by the top of its prefix tree, conversations de-duplicated wherever they go,
the planner contract, replicas added and removed, the configuration."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import OrderingConfig, PlanRequest, Scope
from contextpilot_integrations.core.planner_protocol import check_planner
from contextpilot_integrations.core.replicas.replica_load import eligible
from contextpilot_integrations.core.replicas.routing import ReplicaRouter
from contextpilot_integrations.core.replicas.routing_config import ReplicaSpec, RouterConfig
from contextpilot_integrations.core.request import RidConflictError


def doc(name: str, words: int = 60) -> str:
    return f"{name}: " + " ".join(f"{name}-word{i}" for i in range(words))


D1, D2, D3, E1, E2, E3, X = (doc(n) for n in ("D1", "D2", "D3", "E1", "E2", "E3", "X"))


def two(**kwargs) -> ReplicaRouter:
    return ReplicaRouter([{"name": "a"}, {"name": "b"}], **kwargs)


def test_each_request_goes_where_the_longest_aligned_prefix_is() -> None:
    router = two(load="recent-requests", max_imbalance=4.0, key_prefix="k")
    assert router.plan("q", [D1, D2, D3]).replica == "a"  # cold: the first, least loaded
    assert router.plan("q", [E1, E2]).replica == "b"  # cold: the least loaded
    hit = router.plan("q", [E1, E2, E3])
    assert hit.replica == "b" and hit.matched_prefix_blocks == 2
    assert router.plan("q", [X, D2, D1]).replica == "a"
    # The request starts with E1 (cached on b), but a holds three of its blocks as a prefix:
    # alignment puts them first, so a wins.
    aligned = router.plan("q", [E1, D1, D2, D3])
    assert aligned.replica == "a" and aligned.matched_prefix_blocks == 3
    assert aligned.order[:3] == [1, 2, 3]
    assert aligned.routing_key == router.routing_key(aligned.rid) and aligned.base_url is None
    stats = router.stats()
    assert stats["replicas"]["a"]["routed_requests"] == 3
    assert stats["replicas"]["b"]["index"]["requests"] == 2


def test_a_hot_prefix_is_spread_within_the_imbalance_bound() -> None:
    router = two(load="recent-requests", max_imbalance=1.5)
    sent = {"a": 0, "b": 0}
    for i in range(20):
        plan = router.plan(f"q{i}", [D1, D2, doc(f"own{i}")])
        loads = sent.copy()
        assert eligible(loads[plan.replica], min(loads.values()), 1, 1.5)
        sent[plan.replica] += 1
        if i >= 3:  # once spilled, the prefix is cached on both: they share it evenly
            assert plan.matched_prefix_blocks == 2
    assert max(sent.values()) <= 1.5 * min(sent.values()) + 1
    balance = router.stats()["routing"]["balance"]
    assert balance["requests"] == max(sent.values()) / min(sent.values())


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from(range(6)), min_size=1, max_size=4), min_size=1, max_size=25),
    st.sampled_from([1.0, 1.25, 2.0]),
)
def test_no_request_goes_to_a_replica_beyond_the_bound(requests, factor) -> None:
    router = ReplicaRouter([{"name": n} for n in "abc"], load="recent-tokens", max_imbalance=factor)
    for i, picks in enumerate(requests):
        blocks = [doc(f"P{p}", 20) for p in dict.fromkeys(picks)]
        before = {n: r["load"] for n, r in router.stats()["replicas"].items()}
        plan = router.plan(f"q{i}", blocks)
        cost = router.stats()["replicas"][plan.replica]["load"] - before[plan.replica]
        assert eligible(before[plan.replica], min(before.values()), cost, factor)


def test_a_batch_is_partitioned_by_its_first_blocks_and_scheduled_per_replica() -> None:
    router = two(max_imbalance=1.25)
    groups = {g: [doc(f"G{g}a"), doc(f"G{g}b")] for g in range(4)}
    batch = [
        PlanRequest(f"q{g}-{i}", [*groups[g], doc(f"u{g}{i}")], rid=f"r{g}-{i}")
        for i in range(3)
        for g in range(4)
    ]
    planned = router.plan_batch(batch)
    replica_of = {p.rid: p.replica for p in planned.plans}
    for g in range(4):
        assert len({replica_of[f"r{g}-{i}"] for i in range(3)}) == 1  # a group stays together
    assert sorted(replica_of.values()).count("a") == 6  # two groups each
    assert sorted(planned.schedule) == list(range(12))
    first, second = planned.scheduled()[:2]
    assert first.replica != second.replica  # the parts' schedules interleave
    for plan in planned.plans:
        if plan.rid.endswith("-2"):  # a group's later requests share its prefix
            assert plan.shared_prefix_blocks == 2
    # A warm group goes back to the replica that caches it.
    warm = [PlanRequest("again", [*groups[3], doc("new")], rid="warm")]
    assert router.plan_batch(warm).plans[0].replica == replica_of["r3-0"]


def test_conversations_de_duplicate_wherever_they_are_routed() -> None:
    router = two()
    scope = Scope(conversation_id="c1", tenant="t")
    first = router.plan("q1", [D1, D2], scope=scope)
    assert first.replica == "a"
    router.remove_replica("a")  # the next turn cannot go where the first went
    second = router.plan("q2", [D1, E1], scope=Scope(conversation_id="c1", tenant="t"))
    assert second.replica == "b"
    assert [p.status.value for p in second.placements] == ["replaced", "shown"]
    assert router.stats()["conversations"]["conversations"] == 1


def test_a_conversation_sticks_to_the_replica_that_holds_its_history() -> None:
    router = two(load="recent-requests", max_imbalance=10.0)
    turn1 = router.plan("q1", [D1, D2, D3], scope=Scope(conversation_id="c", tenant="t"))
    router.plan("other", [E1, E2])
    turn2 = router.plan("q2", [E1, E2, X], scope=Scope(conversation_id="c", tenant="t"))
    # b caches E1 E2 (two blocks), but a holds the conversation's history (three).
    assert turn2.replica == turn1.replica == "a"


def test_a_conversation_follows_its_last_call_to_where_it_landed() -> None:
    router = two(load="recent-requests", max_imbalance=10.0)
    scope = Scope(conversation_id="c", tenant="t")
    first = router.route("r1", scope=scope, prompt_tokens=500)
    other = "b" if first.replica == "a" else "a"
    # The engine's events (or a gateway's answer) say r1 reached the other replica.
    router.landed("r1", other)
    assert router.route("r2", scope=scope, prompt_tokens=10).replica == other


def test_the_planner_contract_sync_and_async() -> None:
    router = two(mode="direct")
    check_planner(router)
    router.add_replica({"name": "c", "base_url": "http://c:8000/v1"})
    router.remove_replica("a")
    router.remove_replica("b")
    plan = asyncio.run(router.aplan("q", [D1, D2], rid="async-1"))
    assert plan.replica == "c" and plan.base_url == "http://c:8000/v1"
    assert plan.routing_key is None and router.routing_key("async-1") is None
    batch = asyncio.run(router.aplan_batch([PlanRequest("q", [D1, D3], rid="async-2")]))
    assert batch.plans[0].matched_prefix_blocks == 1
    assert router.evict("async-1") and not router.evict("async-1")
    assert router.replica_of("async-2") == "c"
    assert router.plan_batch([]).plans == ()


def test_rids_are_unique_across_replicas() -> None:
    router = two(load="recent-requests")
    router.plan("q", [D1], rid="same")
    with pytest.raises(RidConflictError, match="already indexed on 'a'"):
        router.plan("q", [E1], rid="same")  # would have gone to b
    with pytest.raises(RidConflictError):
        router.plan_batch([PlanRequest("q", [E1], rid="same")])
    router.plan("q", [E1], rid="other")  # a failed plan leaves no load and no reservation
    assert router.stats()["replicas"]["b"]["routed_requests"] == 1
    assert router.evict("same")
    router.plan("q", [D1], rid="same")  # an evicted rid may be planned again


def test_usage_is_counted_for_the_replica_the_request_went_to() -> None:
    router = two(load="in-flight-requests")
    first = router.plan("q", [D1])
    second = router.plan("q", [E1])
    assert (first.replica, second.replica) == ("a", "b")
    assert router.stats()["replicas"]["a"]["load"] == 1
    assert router.record_usage(first.rid, 200, 150)
    assert not router.record_usage("never-planned", 10, 0)
    stats = router.stats()
    assert stats["replicas"]["a"]["load"] == 0  # no longer in flight
    assert stats["replicas"]["a"]["usage"]["hit_ratio"] == 0.75
    assert stats["replicas"]["b"]["usage"]["reports"] == 0
    assert stats["usage"]["reports"] == 2 and stats["usage"]["prompt_tokens"] == 210


def test_replicas_are_added_and_removed_at_run_time() -> None:
    router = ReplicaRouter([ReplicaSpec("a")], load="recent-requests", max_imbalance=1.0)
    router.plan("q", [D1])
    router.plan("q", [D1, E1])
    router.add_replica(ReplicaSpec("b"))  # a (two requests) is beyond the bound now
    assert router.replicas == ["a", "b"] and router.plan("q", [D1, D2]).replica == "b"
    with pytest.raises(ValueError, match="already routed"):
        router.add_replica({"name": "b"})
    router.remove_replica("b")
    with pytest.raises(KeyError):
        router.remove_replica("b")
    with pytest.raises(ValueError, match="last replica"):
        router.remove_replica("a")
    assert router.plan("q", [D2]).replica == "a"


def test_the_configuration_names_what_is_wrong() -> None:
    good = {"replicas": [{"name": "a", "base_url": "http://a/v1"}], "max_imbalance": 1.5}
    router = ReplicaRouter.from_config(good, key_prefix="k")
    assert router.config.max_imbalance == 1.5 and router.config.replicas[0].base_url
    assert router.plan("q", [D1]).routing_key == "k0"
    cases = [
        ({"replicas": []}, "at least one replica"),
        ({"replicas": [{"name": "a"}, {"name": "a"}]}, "unique"),
        ({"replicas": [{"name": "a b"}]}, "letters"),
        ({"replicas": [{"name": "a", "url": "x"}]}, "unknown replica setting"),
        ({"replicas": [{"name": "a"}], "mode": "smg"}, "mode must be"),
        ({"replicas": [{"name": "a"}], "load": "queue"}, "load must be"),
        ({"replicas": [{"name": "a"}], "max_imbalance": 0.5}, "max_imbalance"),
        ({"replicas": [{"name": "a"}], "load_window": 0}, "load_window"),
        ({"replicas": [{"name": "a"}], "routing": "x"}, "unknown router setting"),
        ({"mode": "direct"}, "needs 'replicas'"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            RouterConfig.from_mapping(config)
    from contextpilot_integrations.sync.engine_link import EngineLink

    with pytest.raises(ValueError, match="endpoint"):
        ReplicaRouter([{"name": "a", "cache_sync": {"kind": "kv-events"}}], link_factory=EngineLink)
    with pytest.raises(ValueError, match="replica 'a' has cache_sync: give the router link_fa"):
        ReplicaRouter([{"name": "a", "cache_sync": {"kind": "capacity", "capacity_tokens": 9}}])


def test_every_replica_pilot_takes_the_routers_ordering() -> None:
    ordering = OrderingConfig(reorder="always", rest_order="retriever")
    router = ReplicaRouter([{"name": "a"}, {"name": "b"}], ordering=ordering, annotate=False)
    for replica in router._fleet.replicas.values():
        assert replica.pilot.ordering is ordering and replica.pilot.annotate is False


class FakeLink:
    """An engine link as the core sees it (EngineLinkProtocol), recording what it is told."""

    def __init__(self, settings: dict) -> None:
        self.settings = settings
        self.callbacks: tuple | None = None
        self.calls: list[str] = []

    @property
    def bound(self) -> bool:
        return self.callbacks is not None

    def bind(self, on_evict, *, on_session=None, on_health=None) -> FakeLink:
        self.callbacks = (on_evict, on_session, on_health)
        return self

    def start(self) -> FakeLink:
        self.calls.append("start")
        return self

    def stop(self) -> None:
        self.calls.append("stop")

    def record(self, plans) -> None:
        self.calls.extend(f"record {plan.rid}" for plan in plans)

    def touch(self, rid: str) -> None:
        self.calls.append(f"touch {rid}")

    def forget(self, rid: str) -> None:
        self.calls.append(f"forget {rid}")

    def reset(self) -> list[str]:
        return []

    def stats(self) -> dict:
        return {"fake": True}


def test_the_link_factory_builds_binds_starts_and_stops_each_replicas_link() -> None:
    links: list[FakeLink] = []

    def factory(settings: dict) -> FakeLink:
        links.append(FakeLink(settings))
        return links[-1]

    replicas = [{"name": "a", "cache_sync": {"kind": "capacity", "capacity_tokens": 9}}]
    with ReplicaRouter([*replicas, {"name": "b"}], link_factory=factory, mode="direct") as router:
        (link,) = links
        assert link.settings == {"kind": "capacity", "capacity_tokens": 9}
        assert link.bound and link.calls == ["start"]
        plan = router.plan("q", [D1], rid="r1")
        assert plan.replica == "a" and link.calls == ["start", "record r1"]
        on_evict, _, on_health = link.callbacks  # type: ignore[misc]
        assert on_evict("r1") and router.stats()["replicas"]["a"]["index"]["requests"] == 0
        on_health(False)
        assert router.stats()["replicas"]["a"]["up"] is False
        assert router.stats()["replicas"]["a"]["sync"] == {"fake": True}
    assert link.calls[-1] == "stop"
