"""Threads planning, batching, evicting and snapshotting one pilot at once: no exception, no lost
or phantom turn (a batch that read a request's path after an eviction removed it would raise
KeyError after its turns were recorded)."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections import Counter

from contextpilot_integrations import ContextPilot, PlanRequest, Scope

TEXTS = [f"passage {i}: " + " ".join(f"w{i}-{j}" for j in range(40)) for i in range(30)]


def test_planning_batching_evicting_and_snapshotting_at_once() -> None:
    pilot = ContextPilot(max_requests=50)  # a small bound: the index evicts by itself too
    errors: list[BaseException] = []
    returned: Counter[str] = Counter()  # conversation -> turns handed out
    lock = threading.Lock()
    stop = time.monotonic() + 3.0

    def guarded(work):  # type: ignore[no-untyped-def]
        def run(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while time.monotonic() < stop:
                    work(rng, seed)
            except BaseException as exc:  # noqa: BLE001 - the test reports every one
                errors.append(exc)

        return run

    def single(rng: random.Random, seed: int) -> None:
        conversation = f"single-{seed}-{rng.randrange(3)}"
        plan = pilot.plan("q", rng.sample(TEXTS, 5), scope=Scope(conversation))
        with lock:
            returned[conversation] += 1
        assert plan.scope.turn is not None

    def batch(rng: random.Random, seed: int) -> None:
        conversations = [f"batch-{seed}-{i}" for i in range(6)]
        plans = pilot.plan_batch(
            [PlanRequest("q", rng.sample(TEXTS, 6), scope=Scope(c)) for c in conversations]
        )
        with lock:
            returned.update(p.scope.conversation_id for p in plans.plans)

    def evict(rng: random.Random, seed: int) -> None:
        rids = pilot.index.rids()
        for rid in rng.sample(rids, min(10, len(rids))):
            pilot.evict(rid)
        if rng.random() < 0.05:
            pilot.index.clear()  # an engine's AllBlocksCleared

    def snapshot(rng: random.Random, seed: int) -> None:
        pilot.snapshot()
        time.sleep(0.01)

    threads = [
        threading.Thread(target=guarded(work), args=(seed,))
        for seed, work in enumerate([single, single, batch, batch, evict, evict, snapshot])
    ]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that narrow races show
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    # Every returned turn is recorded and nothing else: turn counts per conversation agree.
    store = pilot.deduplicator.store
    for conversation, count in returned.items():
        with store.open_turn("", conversation) as next_turn:
            assert next_turn.turn == count + 1, conversation
        next_turn.abort()
    assert sum(returned.values()) > 20  # the threads did real work
