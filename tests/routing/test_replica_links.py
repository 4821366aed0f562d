"""One engine link per replica, over the real ZMQ protocol publisher (one per replica): an
eviction reaches only its replica's index, a replica whose events stop is marked down and its
requests evicted while routing goes on, and a gateway's placement of a routing key is learnt from
which replica's events carry its requests' rids."""

from __future__ import annotations

import time

from contextpilot_integrations.core.replicas.routing import ReplicaRouter
from contextpilot_integrations.sync.engine_link import EngineLink
from contextpilot_integrations.sync.event_publisher import KVEventPublisher
from contextpilot_integrations.sync.kv_events import BlockRemoved, BlockStored, KVEventBatch


def doc(name: str) -> str:
    return f"{name}: " + " ".join(f"{name}-word{i}" for i in range(60))


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events))  # type: ignore[arg-type]


def stored(hashes: list[int], rid: str, parent: int | None = None) -> BlockStored:
    tokens = [t for h in hashes for t in (h, h)]
    return BlockStored(hashes, parent, tokens, block_size=2, session_id=rid)


def router_over(endpoints, names=("a", "b"), grace_s: float = 5.0, **kwargs) -> ReplicaRouter:
    replicas = []
    for name in names:
        events, replay = endpoints(name)
        sync = {
            "kind": "kv-events",
            "endpoint": events,
            "replay_endpoint": replay,
            "engine_grace_s": grace_s,
        }
        replicas.append({"name": name, "base_url": f"http://{name}/v1", "cache_sync": sync})
    kwargs.setdefault("load", "recent-requests")
    return ReplicaRouter(replicas, link_factory=EngineLink, **kwargs)


def indexed(router: ReplicaRouter, name: str) -> int:
    return router.stats()["replicas"][name]["index"]["requests"]


def cached(router: ReplicaRouter, name: str) -> set[str]:
    return router._fleet.replicas[name].link.source.mirror.cached_requests()  # type: ignore[union-attr]


def test_an_eviction_on_one_replica_touches_only_its_index(ipc_endpoints, wait_for) -> None:
    with (
        KVEventPublisher(*ipc_endpoints("a")) as engine_a,
        KVEventPublisher(*ipc_endpoints("b")) as engine_b,
        router_over(ipc_endpoints, mode="direct") as router,
    ):
        on_a = router.plan("q", [doc("D1"), doc("D2")])
        on_b = router.plan("q", [doc("E1"), doc("E2")])
        assert (on_a.replica, on_b.replica) == ("a", "b")
        assert on_a.base_url == "http://a/v1" and on_a.routing_key is None
        # Both engines happen to publish the same hashes: still two caches.
        engine_a.publish(batch(stored([1, 2], on_a.rid)))
        engine_b.publish(batch(stored([1, 2], on_b.rid)))
        wait_for(lambda: cached(router, "a") == {on_a.rid} and cached(router, "b") == {on_b.rid})
        engine_a.publish(batch(BlockRemoved([2])))
        wait_for(lambda: indexed(router, "a") == 0)
        engine_b.publish(batch(stored([3], on_b.rid, parent=2)))  # b's stream goes on
        wait_for(lambda: router.stats()["replicas"]["b"]["sync"]["source"]["mirror"]["blocks"] == 3)
        stats = router.stats()["replicas"]
    assert indexed(router, "b") == 1 and router.replica_of(on_b.rid) == "b"
    assert stats["a"]["sync"]["evictions"] == {"kv-events": 1}
    assert stats["b"]["sync"]["evictions"] == {}


def test_a_replica_whose_events_stop_is_marked_down_and_routing_goes_on(
    ipc_endpoints, wait_for
) -> None:
    engine_a = KVEventPublisher(*ipc_endpoints("a")).start()
    with (
        KVEventPublisher(*ipc_endpoints("b")) as engine_b,
        router_over(ipc_endpoints, grace_s=0.3, max_imbalance=1.0) as router,
    ):
        wait_for(
            lambda: all(r["sync"]["engine_connected"] for r in router.stats()["replicas"].values())
        )
        on_a = router.plan("q", [doc("D1"), doc("D2")])
        on_b = router.plan("q", [doc("E1")])
        engine_a.publish(batch(stored([1, 2], on_a.rid)))
        engine_b.publish(batch(stored([7], on_b.rid)))
        wait_for(lambda: cached(router, "a") == {on_a.rid})
        engine_a.stop()  # replica a's engine is gone
        wait_for(lambda: not router.stats()["replicas"]["a"]["up"])
        stats = router.stats()["replicas"]
        assert stats["a"]["down_evictions"] == 1 and indexed(router, "a") == 0
        assert cached(router, "a") == set()
        assert stats["a"]["sync"]["failures"]["engine_unreachable"] == 1
        # Routing goes on with b alone, even for a's prefix.
        assert {
            router.plan("q", [doc("D1"), doc("D2"), doc(f"x{i}")]).replica for i in range(3)
        } == {"b"}
        assert indexed(router, "b") == 4
        engine_a = KVEventPublisher(*ipc_endpoints("a")).start()  # back again
        wait_for(lambda: router.stats()["replicas"]["a"]["up"])
        assert router.plan("q", [doc("F1")]).replica == "a"  # b is the busier one
        engine_a.stop()


def test_where_a_gateway_put_a_routing_key_is_learnt_from_the_events(
    ipc_endpoints, wait_for
) -> None:
    with (
        KVEventPublisher(*ipc_endpoints("a")) as engine_a,
        KVEventPublisher(*ipc_endpoints("b")) as engine_b,
        router_over(ipc_endpoints, key_prefix="k", max_imbalance=4.0) as router,
    ):
        meant_a = router.plan("q", [doc("D1"), doc("D2")])
        meant_b = router.plan("q", [doc("E1"), doc("E2")])
        assert (meant_a.replica, meant_a.routing_key) == ("a", "k0")
        assert (meant_b.replica, meant_b.routing_key) == ("b", "k1")
        assert meant_a.base_url is None
        # The gateway pinned k0 to worker b and k1 to worker a: each engine's events carry the
        # other's rid.
        engine_b.publish(batch(stored([1, 2], meant_a.rid)))
        engine_a.publish(batch(stored([5, 6], meant_b.rid)))
        wait_for(lambda: router.stats()["routing"]["remapped"] == 2)
        assert router.replica_of(meant_a.rid) == "b" and router.replica_of(meant_b.rid) == "a"
        stats = router.stats()
        assert stats["replicas"]["a"]["key"] == "k1" and stats["replicas"]["a"]["confirmed"]
        assert stats["replicas"]["b"]["key"] == "k0" and stats["routing"]["remapped_keys"] == 2
        assert indexed(router, "a") == 1 and indexed(router, "b") == 1
        # The moved requests are where their prefixes are: a request like meant_a's goes to b,
        # with the key that reaches b.
        again = router.plan("q", [doc("D1"), doc("D2"), doc("D3")])
        assert (again.replica, again.routing_key, again.matched_prefix_blocks) == ("b", "k0", 2)
        # Evictions follow them too.
        engine_b.publish(batch(BlockRemoved([2])))
        wait_for(lambda: indexed(router, "b") == 1 and router.evict(meant_a.rid) is False)
        assert router.stats()["replicas"]["b"]["sync"]["evictions"] == {"kv-events": 1}
