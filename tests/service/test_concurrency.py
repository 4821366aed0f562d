"""Many clients at once against one real server: threads, separate processes, the same rid
raced, and a long batch build that must not hold up single plans."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from service_testing import blocks_of

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.core.request import PlanRequest, RidConflictError, Scope


def _lossless(plan, count: int) -> bool:  # type: ignore[no-untyped-def]
    """Every input index has exactly one placement, and every shown block is in the prompt."""
    placed = sorted(p.index for p in plan.output_order())
    shown = sorted(plan.order)
    return placed == list(range(count)) and all(
        plan.placements[i].rendered_text in plan.prompt for i in shown
    )


def test_threads_share_one_client(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory()
    client = ContextPilotClient(server.base_url, fallback=False)

    def work(worker: int) -> list[str]:
        rids = []
        for i in range(25):
            texts = blocks_of(worker * 100 + i % 5)
            plan = client.plan(f"q {worker} {i}", texts, rid=f"w{worker}-{i}")
            assert _lossless(plan, len(texts))
            rids.append(plan.rid)
        return rids

    with ThreadPoolExecutor(8) as pool:
        rids = [rid for chunk in pool.map(work, range(8)) for rid in chunk]
    stats = client.stats()
    client.close()
    assert len(set(rids)) == 200
    assert stats["requests"] == 200 and stats["inserts"] == 200
    assert stats["client"]["service_failures"] == 0


def _process_worker(base_url: str, worker: int, count: int, queue) -> None:  # type: ignore[no-untyped-def]
    with ContextPilotClient(base_url, fallback=False) as client:
        rids = []
        for i in range(count):
            texts = blocks_of(worker * 1000 + i % 3)
            plan = client.plan(f"p{worker} {i}", texts, rid=f"p{worker}-{i}")
            if not _lossless(plan, len(texts)):
                raise AssertionError(f"lost a block in {plan.rid}")
            rids.append(plan.rid)
        batch = client.plan_batch(
            [PlanRequest(f"b{worker} {j}", blocks_of(worker + j)) for j in range(5)]
        )
        rids.extend(p.rid for p in batch.plans)
    queue.put(rids)


def test_separate_processes_share_one_index(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [
        context.Process(target=_process_worker, args=(server.base_url, w, 30, queue))
        for w in range(4)
    ]
    for process in workers:
        process.start()
    results = [queue.get(timeout=120) for _ in workers]
    for process in workers:
        process.join(60)
        assert process.exitcode == 0
    rids = [rid for chunk in results for rid in chunk]
    assert len(set(rids)) == 4 * 35
    stats = httpx.get(f"{server.base_url}/v1/stats").json()
    assert stats["requests"] == 4 * 35
    # Every process reused the prefix the others had indexed: the index is shared.
    with ContextPilotClient(server.base_url) as client:
        again = client.plan("again", blocks_of(2 * 1000))
    assert again.matched_prefix_blocks == len(blocks_of(0))


def test_the_same_rid_raced_is_planned_exactly_once(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory()
    client = ContextPilotClient(server.base_url, fallback=False)
    barrier = threading.Barrier(8)

    def race(worker: int) -> str:
        barrier.wait()
        try:
            client.plan(f"q{worker}", blocks_of(worker), rid="contested", scope=Scope(f"c{worker}"))
        except RidConflictError as error:
            return str(error)
        return "planned"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(race, range(8)))
    stats = client.stats()
    client.close()
    assert outcomes.count("planned") == 1, outcomes
    assert all("contested" in o for o in outcomes if o != "planned")
    assert stats["requests"] == 1
    # Only the winner recorded a conversation turn (a refused plan leaves no trace).
    assert stats["conversations"]["conversations"] == 1


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the metrics")


def test_a_long_batch_build_does_not_hold_up_single_plans(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory()
    rng = random.Random(0)
    pool = [f"passage {i} " + "y" * 40 for i in range(3000)]
    size = 4000
    requests = [PlanRequest(f"q{i}", rng.sample(pool, 20)) for i in range(size)]
    finished = threading.Event()

    def batch() -> None:
        with ContextPilotClient(server.base_url, fallback=False, timeout=300) as client:
            client.plan_batch(requests)
        finished.set()

    runner = threading.Thread(target=batch)
    latencies: list[float] = []
    # A generous read timeout: on a loaded machine a single plan can take over the client's
    # default second while the build runs; the assertion below, not the timeout, judges it.
    with ContextPilotClient(server.base_url, fallback=False, timeout=60) as client:
        client.plan("warm up", ["a block"])
        runner.start()
        while not finished.is_set():
            start = time.perf_counter()
            client.plan(f"single {len(latencies)}", blocks_of(len(latencies) % 7))
            latencies.append(time.perf_counter() - start)
        runner.join()
    metrics = httpx.get(f"{server.base_url}/metrics").text
    build_s = _metric(
        metrics, 'contextpilot_http_request_duration_seconds_sum{endpoint="/v1/plan_batch"}'
    )
    # On the event loop, the build would stall every request that arrives meanwhile: one
    # single plan would wait about the whole build. In a worker thread they keep going.
    assert build_s > 1.0, build_s
    assert max(latencies) < 0.5 * build_s, (max(latencies), build_s, len(latencies))


def test_a_planning_window_plans_concurrent_requests_jointly(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory("--window-ms", "300")
    client = ContextPilotClient(server.base_url, timeout=5.0)
    shared = [f"window shared passage {i}: " + "common words " * 40 for i in range(3)]
    barrier = threading.Barrier(6)

    def plan(i: int):  # type: ignore[no-untyped-def]
        barrier.wait()
        return client.plan(f"q{i}", [f"own passage {i}: " + "words " * 30, *reversed(shared)])

    with ThreadPoolExecutor(6) as pool:
        plans = list(pool.map(plan, range(6)))
    window = client.stats()["service"]["window"]
    # The very first request finds no recent arrivals and goes at once (adaptive); the rest
    # arrive together and are planned as one batch, all aligned to the same shared prefix.
    assert window["requests"] == 6 and window["windows"] <= 2
    prefixes = [tuple(b.text for b in p.blocks[:3]) for p in plans]
    common = max(set(prefixes), key=prefixes.count)
    assert prefixes.count(common) >= 5 and set(common) == set(shared)
    client.close()
