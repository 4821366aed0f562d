"""No event-driven work on the event loop: a call stuck in the engine
link holds a worker thread, never the server; ``/health`` and plans go on, and SIGTERM still
stops the server and saves the snapshot within a bounded time."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path

import httpx
from service_testing import blocks_of, free_port, saved_requests, wait_for

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.sync.event_publisher import KVEventPublisher
from contextpilot_integrations.sync.kv_events import BlockRemoved, BlockStored, KVEventBatch

STUCK_SERVER = Path(__file__).with_name("stuck_server.py")


def _timed_get(url: str, timeout_s: float = 2.0) -> float:
    started = time.perf_counter()
    response = httpx.get(url, timeout=timeout_s)
    assert response.status_code == 200, response.text
    return time.perf_counter() - started


def test_a_stuck_eviction_holds_a_thread_not_the_server(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    snapshot = tmp_path / "index.json"
    server = server_factory(
        "--snapshot", str(snapshot), "--shutdown-timeout", "2", launcher=STUCK_SERVER
    )
    with ContextPilotClient(server.base_url, fallback=False) as client:
        rids = [client.plan(f"q{i}", blocks_of(i), rid=f"r{i}").rid for i in range(3)]

    def stuck(rid: str) -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server goes away under it
            httpx.post(f"{server.base_url}/v1/evict", json={"rid": rid}, timeout=60)

    callers = [threading.Thread(target=stuck, args=(rid,), daemon=True) for rid in rids]
    for caller in callers:
        caller.start()
    time.sleep(0.5)  # the evictions are in their worker threads now, for ever
    assert _timed_get(f"{server.base_url}/health") < 1.0
    with ContextPilotClient(server.base_url, fallback=False) as client:
        started = time.perf_counter()
        plan = client.plan("still planning", blocks_of(7), rid="after")
        batch = client.plan_batch([])
        stats = client.stats()
        assert time.perf_counter() - started < 2.0
    assert plan.rid == "after" and batch.plans == () and stats["requests"] == 4
    started = time.perf_counter()
    server.stop(signal.SIGTERM, timeout_s=30)
    stopped_s = time.perf_counter() - started
    assert stopped_s < 12, stopped_s  # 2 s for the requests in flight, 2 s for the save, slack
    assert "Application shutdown complete" in server.log()
    assert sorted(entry["rid"] for entry in saved_requests(snapshot)) == ["after", *rids]
    assert json.loads(snapshot.read_text())["final"] is True  # no plan was in flight


def test_a_hostile_event_stream_never_stops_the_server(server_factory) -> None:  # type: ignore[no-untyped-def]
    publisher, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with KVEventPublisher(publisher, replay) as engine:
        server = server_factory("--kv-events", publisher, "--kv-events-replay", replay)
        wait_for(lambda: httpx.get(f"{server.base_url}/health").json()["engine_connected"])
        with ContextPilotClient(server.base_url, fallback=False) as client:
            plan = client.plan("q", blocks_of(1), rid="victim")
            # A block naming itself as parent, two naming each other, then their removal: the
            # mirror walk must not loop for ever under the mirror lock.
            engine.publish(
                KVEventBatch(
                    ts=time.time(),
                    events=[
                        BlockStored(block_hashes=[7], parent_block_hash=7, session_id=plan.rid),
                        BlockStored(block_hashes=[8], parent_block_hash=9, session_id=plan.rid),
                        BlockStored(block_hashes=[9], parent_block_hash=8, session_id=plan.rid),
                        BlockRemoved(block_hashes=[7, 8, 9]),
                    ],
                )
            )
            time.sleep(0.5)
            for _ in range(5):
                assert _timed_get(f"{server.base_url}/health") < 1.0
                assert client.plan("q", blocks_of(2)).order
                assert client.evict("nothing-like-it") is False
            assert isinstance(client.stats()["requests"], int)
        assert server.stop(signal.SIGTERM, timeout_s=30) in (0, -signal.SIGTERM)
