"""The service beside an engine's KV-event stream: evictions followed end to end, resync after
a restore, and an unreachable engine that never breaks a request.

The engine side is the protocol publisher of :mod:`contextpilot_integrations.sync.event_publisher`
(the same PUB + replay ROUTER frames as SGLang's and vLLM's publishers; the sync tests and the
``sglang`` tier check our subscriber against the real ones).
"""

from __future__ import annotations

import signal
import socket
import time

import httpx
from service_testing import blocks_of, free_port, wait_for

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.core.request import PlanRequest
from contextpilot_integrations.sync.event_publisher import KVEventPublisher
from contextpilot_integrations.sync.kv_events import BlockRemoved, BlockStored, KVEventBatch


def _endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def _stored(hashes: list[int], session: str, parent: int | None = None) -> KVEventBatch:
    return KVEventBatch(
        ts=time.time(),
        events=[BlockStored(block_hashes=hashes, parent_block_hash=parent, session_id=session)],
    )


def _removed(hashes: list[int]) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=hashes)])


def _stats(base_url: str) -> dict:  # type: ignore[type-arg]
    return httpx.get(f"{base_url}/v1/stats").json()


def test_engine_evictions_reach_the_index(server_factory) -> None:  # type: ignore[no-untyped-def]
    pub, replay = _endpoints()
    with KVEventPublisher(pub, replay) as engine:
        server = server_factory("--kv-events", pub, "--kv-events-replay", replay)
        wait_for(lambda: httpx.get(f"{server.base_url}/health").json()["engine_connected"])
        with ContextPilotClient(server.base_url, fallback=False) as client:
            for rid in ("r1", "r2", "r3"):
                client.plan(rid, blocks_of(int(rid[1])), rid=rid)
        # The engine caches each request's pages under its session id (= the plan's rid).
        engine.publish(_stored([11, 12], "r1"))
        engine.publish(_stored([21], "r2", parent=11))
        engine.publish(_stored([31], "r3"))
        wait_for(lambda: _stats(server.base_url)["sync"]["source"]["mirror"]["blocks"] == 4)
        engine.publish(_removed([21]))  # LRU evicts r2's leaf
        wait_for(lambda: _stats(server.base_url)["requests"] == 2)
        engine.publish(_removed([12, 11]))
        wait_for(lambda: _stats(server.base_url)["requests"] == 1)
        metrics = httpx.get(f"{server.base_url}/metrics").text
    with ContextPilotClient(server.base_url, fallback=False) as client:
        assert [client.evict(rid) for rid in ("r1", "r2", "r3")] == [False, False, True]
    assert 'contextpilot_evictions_total{source="kv-events"} 2.0' in metrics
    assert _stats(server.base_url)["sync"]["failures"] == {}


def test_restart_with_snapshot_resyncs_with_the_engine(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    snapshot = tmp_path / "index.json"
    pub, replay = _endpoints()
    with KVEventPublisher(pub, replay) as engine:
        first = server_factory(
            "--snapshot", str(snapshot), "--kv-events", pub, "--kv-events-replay", replay
        )
        with ContextPilotClient(first.base_url, fallback=False) as client:
            for rid in ("kept", "gone", "never"):
                client.plan(rid, blocks_of(len(rid)), rid=rid)
        engine.publish(_stored([1], "kept"))
        engine.publish(_stored([2], "gone"))
        wait_for(lambda: _stats(first.base_url)["sync"]["source"]["mirror"]["blocks"] == 2)
        first.stop(signal.SIGTERM)

        # While the service is down the engine evicts "gone"; "never" was never cached.
        engine.publish(_removed([2]))
        second = server_factory(
            "--snapshot", str(snapshot), "--kv-events", pub, "--kv-events-replay", replay
        )
        restored = _stats(second.base_url)
        assert restored["requests"] == 3 and restored["sync"]["resync_pending"] is True
        # The next live batch makes the subscriber replay the engine's history from seq 0.
        wait_for(lambda: httpx.get(f"{second.base_url}/health").json()["engine_connected"])
        deadline = time.monotonic() + 20
        while _stats(second.base_url)["sync"]["resync_pending"]:
            assert time.monotonic() < deadline, second.log()
            engine.publish(KVEventBatch(ts=time.time(), events=[]))
            time.sleep(0.1)
    stats = _stats(second.base_url)
    assert stats["requests"] == 1, stats
    with ContextPilotClient(second.base_url, fallback=False) as client:
        assert client.evict("kept") is True
        assert client.evict("gone") is False and client.evict("never") is False
    # "gone" was evicted by the replayed BlockRemoved, "never" by the resync.
    assert "resync with the engine: 1 restored requests still cached, 1 evicted" in second.log()


def test_an_unreachable_engine_never_breaks_a_request(server_factory) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
    server = server_factory("--kv-events", endpoint, "--engine-grace", "0.3")
    with ContextPilotClient(server.base_url, fallback=False) as client:
        plans = [client.plan(f"q{i}", blocks_of(i)) for i in range(5)]
        wait_for(lambda: client.stats()["sync"]["failures"].get("engine_unreachable") == 1)
        plans += [client.plan(f"again {i}", blocks_of(i)) for i in range(5)]
        batch = client.plan_batch([PlanRequest("x", blocks_of(1)), PlanRequest("y", blocks_of(2))])
        time.sleep(0.5)
        stats = client.stats()
    assert all(sorted(p.order) == list(range(6)) for p in plans) and len(batch.plans) == 2
    assert stats["requests"] == 12
    assert stats["sync"]["engine_connected"] is False
    assert stats["sync"]["failures"] == {"engine_unreachable": 1}
    health = httpx.get(f"{server.base_url}/health").json()
    assert health["status"] == "ok" and health["engine_connected"] is False
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert 'contextpilot_sync_failures_total{kind="engine_unreachable"} 1.0' in metrics
    server.stop(signal.SIGTERM)
    warnings = [line for line in server.log().splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and "not connected" in warnings[0], warnings


def test_the_engine_coming_up_later_is_followed(server_factory) -> None:  # type: ignore[no-untyped-def]
    pub, replay = _endpoints()
    server = server_factory(
        "--kv-events", pub, "--kv-events-replay", replay, "--engine-grace", "0.3"
    )
    with ContextPilotClient(server.base_url, fallback=False) as client:
        client.plan("early", blocks_of(1), rid="early")
        wait_for(lambda: client.stats()["sync"]["failures"].get("engine_unreachable") == 1)
        with KVEventPublisher(pub, replay) as engine:
            wait_for(lambda: client.stats()["sync"]["engine_connected"] is True)
            engine.publish(_stored([5], "early"))
            engine.publish(_removed([5]))
            wait_for(lambda: client.stats()["requests"] == 0)
        assert client.stats()["sync"]["failures"] == {"engine_unreachable": 1}


def _free_port_pair() -> int:
    """A port whose successor is free too (rank r of a data-parallel engine: port + r)."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise AssertionError("no two consecutive free ports")


def test_a_rank_that_never_publishes_does_not_keep_resync_pending(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The service reports what the engine link decides (sync/).
    snapshot = tmp_path / "index.json"
    pub_base, replay_base = _free_port_pair(), _free_port_pair()
    pub, replay = f"tcp://127.0.0.1:{pub_base}", f"tcp://127.0.0.1:{replay_base}"
    events = ("--kv-events", pub, "--kv-events-replay", replay, "--dp-size", "2")
    first = server_factory("--snapshot", str(snapshot), *events)
    with ContextPilotClient(first.base_url, fallback=False) as client:
        for rid in ("kept", "gone"):
            client.plan(rid, blocks_of(len(rid)), rid=rid)
    first.stop(signal.SIGTERM)
    with KVEventPublisher(pub, replay) as rank0:  # rank 1 never comes up
        rank0.publish(_stored([1], "kept"))
        second = server_factory("--snapshot", str(snapshot), *events, "--engine-grace", "3")
        assert httpx.get(f"{second.base_url}/health").json()["resync_pending"] is True
        wait_for(
            lambda: httpx.get(f"{second.base_url}/health").json()["resync_pending"] is False,
            timeout_s=15,
            what="the resync finished without the silent rank",
        )
        stats = _stats(second.base_url)
    assert stats["sync"]["failures"].get("resync_timeout") == 1
    assert stats["requests"] == 1  # "kept" (rank 0 holds it); "gone" evicted
