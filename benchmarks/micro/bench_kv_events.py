"""Engine sync figures: event-to-index-update latency and mirror divergence after repair.

1. Latency: a publisher process sends KV-event batches (one event each) at ``--rate`` events
   per second over ZMQ on 127.0.0.1 for ``--seconds``; this process runs the subscriber, the
   cache mirror and a ContextIndex (evictions go to ``ContextIndex.evict``). Latency is the
   time from the batch's ``ts`` (set by the publisher just before encoding) to the end of the
   mirror update including the index evictions. Target: p99 <= 10 ms at 10,000 events/s.
2. Divergence: ``--events`` random store/remove events (one per message) with ``--drop`` of
   the messages not sent (kept in the replay buffer); the subscriber repairs the gaps from the
   replay socket. Divergence = blocks the mirror and the publisher's cache disagree on
   (presence or parent). Target: 0.

The publisher is this package's ``KVEventPublisher`` (the engines' protocol); the real
SGLang publisher is exercised by the ``sglang`` test tier.

Usage: ``.venv/bin/python benchmarks/micro/bench_kv_events.py [--rate 10000 --seconds 5 --repeat 3
--events 100000 --drop 0.01]``
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import random
import socket
import sys
import time
from collections import OrderedDict

import numpy as np

from contextpilot_integrations.core.index.context_index import ContextIndex
from contextpilot_integrations.sync.cache_mirror import CacheMirror
from contextpilot_integrations.sync.event_publisher import KVEventPublisher
from contextpilot_integrations.sync.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from contextpilot_integrations.sync.subscriber import KVEventSubscriber

PAGE = 16  # tokens per block


class EngineCacheModel:
    """A prefix cache of ``capacity`` blocks that stores chains of 1-4 new blocks under a
    random cached block (or the root), each with a session id, and evicts the least recently
    stored leaf when full: the event mix of a busy engine."""

    def __init__(self, seed: int, capacity: int = 4_000) -> None:
        self.rng = random.Random(seed)
        self.capacity = capacity
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}
        self.leaves: OrderedDict[int, None] = OrderedDict()
        self.next_hash = 1
        self.sessions = 0

    def step(self) -> KVEvent:
        if len(self.parent) + 4 > self.capacity:
            leaf, _ = self.leaves.popitem(last=False)
            parent = self.parent.pop(leaf)
            self.children.pop(leaf, None)
            if parent is not None:
                self.children[parent] -= 1
                if self.children[parent] == 0:
                    self.leaves[parent] = None
            return BlockRemoved([leaf])
        anchors = list(self.leaves) if self.leaves and self.rng.random() < 0.7 else []
        parent = self.rng.choice(anchors) if anchors else None
        count = self.rng.randint(1, 4)
        hashes = list(range(self.next_hash, self.next_hash + count))
        self.next_hash += count
        previous = parent
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1
            self.leaves.pop(parent, None)
        for block in hashes:
            self.parent[block] = previous
            previous = block
        for block in hashes[:-1]:
            self.children[block] = 1
        self.leaves[hashes[-1]] = None
        self.sessions += 1
        tokens = [self.rng.randrange(50_000) for _ in range(PAGE * count)]
        return BlockStored(
            hashes, parent, tokens, block_size=PAGE, session_id=f"rid-{self.sessions}"
        )


def free_port_pair() -> int:
    for _ in range(100):
        base = random.randrange(20_000, 60_000)
        sockets = [socket.socket(), socket.socket()]
        try:
            for offset, sock in enumerate(sockets):
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free port pair")


def publish(
    base: int, seed: int, events: int, rate: float, drop: float, ready, done, result
) -> None:
    """Publisher process: waits for ``ready``, sends ``events`` paced at ``rate``."""
    model = EngineCacheModel(seed)
    rng = random.Random(seed + 1)
    publisher = KVEventPublisher(
        f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}", buffer_steps=events + 10
    ).start()
    # The publisher thread must get the GIL promptly after each publish (as the engine's
    # publisher thread does beside a scheduler that mostly waits on the GPU).
    sys.setswitchinterval(0.0002)
    ready.wait()
    start = time.perf_counter()
    interval = 1.0 / rate if rate > 0 else 0.0
    dropped = 0
    for number in range(events):
        # Pace by sleeping (which releases the GIL), never by spinning; when behind, catch up.
        delay = start + number * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        lost = rng.random() < drop
        dropped += lost
        publisher.publish(KVEventBatch(ts=time.time(), events=[model.step()]), drop=lost)
    publisher.flush(60)
    elapsed = time.perf_counter() - start
    result.put(
        {
            "sent_rate": events / elapsed,
            "dropped": dropped,
            "blocks": {h: p for h, p in model.parent.items()},
        }
    )
    done.wait()
    publisher.stop()


def run(events: int, rate: float, drop: float, seed: int, freeze_gc: bool = False) -> dict:
    base = free_port_pair()
    context = multiprocessing.get_context("spawn")
    ready, done, result = context.Event(), context.Event(), context.Queue()
    process = context.Process(
        target=publish, args=(base, seed, events, rate, drop, ready, done, result)
    )
    process.start()
    index = ContextIndex(max_requests=None)
    for number in range(1, events + 1):  # every rid the publisher will attribute
        index.insert(f"rid-{number}", [10**6 + number % 997, 2 * 10**6 + number % 991, -number])
    mirror = CacheMirror(index.evict)
    latencies = np.zeros(events + 1, dtype=np.float64)
    if freeze_gc:
        # Long-lived state (the index) out of the collector's reach, as a service does after
        # building or restoring its index: full collections then scan only new objects.
        gc.collect()
        gc.freeze()
    applied = 0

    cpu = [0.0, 0.0]  # the subscriber thread's CPU seconds at the first and the last batch

    def on_batch(rank: int, batch: KVEventBatch) -> None:
        nonlocal applied
        mirror.apply_batch(rank, batch)
        latencies[applied] = time.time() - batch.ts
        cpu[applied > 0] = time.thread_time()
        applied += 1

    subscriber = KVEventSubscriber(
        f"tcp://127.0.0.1:{base}",
        f"tcp://127.0.0.1:{base + 1}",
        on_batch=on_batch,
        on_resync=mirror.resync,
        idle_probe_interval_s=0.2,
    ).start()
    deadline = time.monotonic() + 20
    while not subscriber.stats()["connected"][0]:
        if time.monotonic() > deadline:
            raise RuntimeError("subscriber did not connect")
        time.sleep(0.01)
    time.sleep(0.3)  # let the subscription reach the publisher
    ready.set()
    outcome = result.get(timeout=max(120.0, 3 * events / max(rate, 1.0)))
    deadline = time.monotonic() + 60
    while subscriber.stats()["expected_seq"][0] != events:
        if time.monotonic() > deadline:
            raise RuntimeError(f"subscriber behind: {subscriber.stats()}")
        time.sleep(0.01)
    subscriber.stop()
    done.set()
    process.join(30)
    if freeze_gc:
        gc.unfreeze()
    engine_blocks: dict[int, int | None] = outcome["blocks"]
    mirrored = mirror.block_hashes(0)
    divergence = len(mirrored ^ set(engine_blocks))
    divergence += sum(
        1
        for block, parent in engine_blocks.items()
        if block in mirrored and (mirror.block(block) or {}).get("parent") != parent
    )
    return {
        "latency_ms": latencies[:applied] * 1000.0,
        "cpu_us_per_event": (cpu[1] - cpu[0]) / max(applied - 1, 1) * 1e6,
        "sent_rate": outcome["sent_rate"],
        "dropped": outcome["dropped"],
        "divergence": divergence,
        "blocks": len(engine_blocks),
        "subscriber": subscriber.stats(),
        "mirror": mirror.stats(),
        "index_requests": len(index),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10_000, help="events per second")
    parser.add_argument("--seconds", type=float, default=5.0, help="latency run length")
    parser.add_argument("--events", type=int, default=100_000, help="divergence run events")
    parser.add_argument("--drop", type=float, default=0.01, help="fraction of messages lost")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="latency runs (median p99)")
    parser.add_argument(
        "--no-freeze-gc",
        dest="freeze_gc",
        action="store_false",
        help="leave the index to the collector (by default it is gc.freeze()d after its build, "
        "as a long-lived service should: a full collection over a 50,000-request index "
        "pauses 0.2-0.5 s on these machines)",
    )
    args = parser.parse_args(argv)

    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"machine: {os.cpu_count()} cores, load average {load} (other work skews latency)")
    print(f"gc: {'index frozen after its build' if args.freeze_gc else 'default'}")
    p99s = []
    for repeat in range(args.repeat):
        latency = run(
            int(args.rate * args.seconds), args.rate, 0.0, args.seed + 2 * repeat, args.freeze_gc
        )
        ms = latency["latency_ms"]
        p50, p99 = np.percentile(ms, [50, 99])
        p99s.append(p99)
        print(
            f"latency run {repeat + 1}/{args.repeat}: {len(ms):,} events at "
            f"{latency['sent_rate']:,.0f} events/s (asked {args.rate:,.0f}), "
            f"{latency['mirror']['evicted_requests']:,} index evictions: "
            f"p50 {p50:.3f} ms, p99 {p99:.3f} ms, max {ms.max():.3f} ms; subscriber CPU "
            f"{latency['cpu_us_per_event']:.1f} us/event "
            f"(~{1e6 / latency['cpu_us_per_event']:,.0f} events/s per core)"
        )
    p99 = float(np.median(p99s))
    print(
        f"  event -> index update latency p99 (median of {args.repeat} runs): {p99:.3f} ms   "
        f"(target <= 10 ms at {args.rate:,.0f} events/s: {'met' if p99 <= 10 else 'MISSED'})"
    )

    diverge = run(args.events, args.rate, args.drop, args.seed + 1001, args.freeze_gc)
    sub = diverge["subscriber"]
    print(
        f"divergence run: {args.events:,} events, {diverge['dropped']:,} messages dropped "
        f"({args.drop:.1%}); gaps {sub['gaps']:,}, repaired {sub['repaired']:,}, "
        f"replayed {sub['replayed']:,}, resyncs {sub['resyncs']}, malformed {sub['malformed']}"
    )
    print(
        f"  mirror divergence after repair: {diverge['divergence']} blocks of "
        f"{diverge['blocks']:,} cached   (target 0: "
        f"{'met' if diverge['divergence'] == 0 else 'MISSED'})"
    )
    return 0 if p99 <= 10 and diverge["divergence"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
