"""Fault injection: threads planning, batching, evicting and snapshotting one
IndexService at once (zero exceptions, no hint to a turn not handed out), and fuzzed plus
concurrent requests against a real server while a hostile KV-event stream runs (zero hangs,
zero server errors).

The request counts of the second test are small in CI; ``CONTEXTPILOT_FAULT_REQUESTS=10000``
runs 10,000 + 10,000 (as ``benchmarks/micro/bench_service_faults.py`` does by default).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

from service_testing import check_hints

from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.service_config import ServiceConfig
from contextpilot_integrations.service.tenants import TenantKeys

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "micro" / "bench_service_faults.py"
TENANTS = {"alice": TenantKeys(("alice-key",)), "bob": TenantKeys(("bob-key",))}


def test_threads_plan_batch_evict_and_snapshot_one_service_at_once(tmp_path: Path) -> None:
    service = IndexService(
        ServiceConfig(
            tenants=TENANTS,
            snapshot_path=tmp_path / "index.json",
            snapshot_interval_s=0.05,
            max_requests=150,  # LRU evictions all along
            cache_sync={"kind": "capacity", "capacity_tokens": 20_000},  # engine evictions too
        )
    )
    service.start()
    pool = [f"passage {i}: " + " ".join(f"w{i}-{j}" for j in range(30)) for i in range(40)]
    errors: list[BaseException] = []
    received: dict[tuple[str, str], dict[int, Plan]] = {}
    rids: list[str] = []
    stop = threading.Event()
    counts = {"plans": 0, "batches": 0, "evictions": 0, "saves": 0}

    def guarded(work):  # type: ignore[no-untyped-def]
        def run(worker: int) -> None:
            rng = random.Random(worker)
            try:
                while not stop.is_set():
                    work(worker, rng)
            except BaseException as error:  # noqa: BLE001 - every one is a failure here
                errors.append(error)

        return run

    def plan(worker: int, rng: random.Random) -> None:
        tenant = ("alice", "bob")[worker % 2]
        conversation = f"chat-{worker}-{rng.randrange(3)}"  # each thread owns its chats
        texts = rng.sample(pool, rng.randrange(1, 6))
        made = service.plan(PlanRequest("q", texts, scope=Scope(conversation)), caller=tenant)
        turns = received.setdefault((tenant, conversation), {})
        check_hints(made, turns)
        assert made.scope.turn is not None and made.scope.turn not in turns
        turns[made.scope.turn] = made
        rids.append(made.rid)
        counts["plans"] += 1

    def batch(worker: int, rng: random.Random) -> None:
        requests = [PlanRequest("b", rng.sample(pool, 4)) for _ in range(rng.randrange(1, 6))]
        made = service.plan_batch(requests, caller=("alice", "bob")[worker % 2])
        assert sorted(made.schedule) == list(range(len(requests)))
        counts["batches"] += 1

    def evict(worker: int, rng: random.Random) -> None:
        if rids:
            rid = rng.choice(rids)
            service.evict(rid, caller=rng.choice(["alice", "bob"]))
            service.record_usage(rid, 100, rng.randrange(101), caller="alice")
        if rng.random() < 0.05:
            service.forget_conversation("", f"chat-{rng.randrange(8)}-0", caller="bob")
        service.stats(caller="alice")
        counts["evictions"] += 1

    def save(worker: int, rng: random.Random) -> None:
        assert service.save_snapshot()
        service.metrics.exposition()
        counts["saves"] += 1

    works = [plan, plan, plan, plan, batch, evict, evict, save]
    threads = [threading.Thread(target=guarded(w), args=(n,)) for n, w in enumerate(works)]
    for thread in threads:
        thread.start()
    time.sleep(3.0)
    stop.set()
    for thread in threads:
        thread.join(60)
    service.stop()
    assert not errors, errors[:3]
    assert min(counts.values()) > 0, counts
    stats = service.stats(caller="alice")
    assert stats["requests"] <= 150 and stats["sync"]["failures"] == {}
    restored = IndexService(ServiceConfig(tenants=TENANTS, snapshot_path=tmp_path / "index.json"))
    assert restored.stats(caller="alice")["conversations"]["amnesic"] is False  # final save
    print(f"no exception in {counts}")


def test_fuzzed_and_concurrent_requests_with_hostile_events(tmp_path: Path) -> None:
    count = os.environ.get("CONTEXTPILOT_FAULT_REQUESTS", "400")
    completed = subprocess.run(
        [sys.executable, str(BENCHMARK), "--fuzzed", count, "--concurrent", count, "--json"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    figures = json.loads(completed.stdout)
    print(
        f"{figures['fuzzed_requests']} fuzzed + {figures['concurrent_requests']} concurrent "
        f"requests: {figures['hangs']} hangs, {figures['server_errors']} server errors"
    )
    assert figures["fuzzed_requests"] == figures["concurrent_requests"] == int(count)
    assert figures["hangs"] == 0 and figures["server_errors"] == 0, figures
    assert figures["transport_errors"] == 0, figures
    assert figures["hostile_event_batches"] > 0
    assert figures["healthy_after"] and figures["stopped_by_sigterm"], figures
    assert figures["final_snapshot_saved"], figures
    assert set(figures["concurrent_statuses"]) == {"200"}, figures["concurrent_statuses"]
