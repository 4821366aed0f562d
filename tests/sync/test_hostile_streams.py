"""Fault injection: the real ZMQ subscriber and mirror under hostile KV-event streams.

A protocol publisher (:class:`~contextpilot_integrations.sync.event_publisher.KVEventPublisher`)
sends a random but valid engine workload (chains stored under cached blocks with session ids,
leaf and inner removals, hashes in signed and unsigned form, clears) with hostile traffic
interleaved: cycles, a block that is its own parent, nesting 1,100 deep, events claiming more
items than the limits, shifted and mistyped fields, garbage payloads, frames of the wrong
shape, sequence numbers that jump (2^64 - 1, far ahead, back to 0), a frame over the size
limit. A plain reference model applies the valid events only. Checks: the subscriber keeps
applying valid events, the mirror equals the model (blocks, parents, evicted rids in order),
no resync or restart is caused, nothing hangs (every wait has a timeout), the mirror's size
stays within its bound (docs/DESIGN.md, "Bounded").
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import msgspec
import pytest

from contextpilot_integrations.sync.cache_mirror import CacheMirror
from contextpilot_integrations.sync.event_publisher import KVEventPublisher
from contextpilot_integrations.sync.kv_events import (
    MAX_HASHES_PER_EVENT,
    MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    canonical_block_hash,
    encode_mapped,
)
from contextpilot_integrations.sync.subscriber import KVEventSubscriber

pytestmark = pytest.mark.timeout(60)

PAGE = 2


class Reference:
    """The engine's cache as the valid events describe it, and the eviction rule restated:
    removing a block evicts every rid attached at it or below it; a clear evicts them all."""

    def __init__(self) -> None:
        self.parent: dict[object, object] = {}  # canonical hash -> canonical parent (or None)
        self.attached: dict[str, set[object]] = {}  # rid -> deepest blocks of its chains
        self.evicted: list[str] = []

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            hashes = [canonical_block_hash(h) for h in event.block_hashes]
            parent = event.parent_block_hash
            parent = None if parent is None else canonical_block_hash(parent)
            if parent in hashes:
                return  # refused by the mirror: a block cannot continue itself
            first_parent = parent
            for h in hashes:
                self.parent.setdefault(h, parent)
                parent = h
            if event.session_id and hashes:
                chains = self.attached.setdefault(event.session_id, set())
                chains.discard(first_parent)
                chains.add(hashes[-1])
        elif isinstance(event, BlockRemoved):
            for h in map(canonical_block_hash, event.block_hashes):
                if h in self.parent:
                    broken = sorted(r for r, deep in self.attached.items() if self._under(h, deep))
                    del self.parent[h]
                    for rid in broken:
                        del self.attached[rid]
                    self.evicted.extend(broken)
        else:
            self.evicted.extend(sorted(self.attached))
            self.attached.clear()
            self.parent.clear()

    def _under(self, removed: object, blocks: set[object]) -> bool:
        for node in blocks:
            seen: set[object] = set()
            while node is not None and node in self.parent and node not in seen:
                if node == removed:
                    return True
                seen.add(node)
                node = self.parent[node]
        return False


class Workload:
    """Random valid engine traffic (deterministic per seed); hashes are 63-bit signed ints,
    sent unsigned about a third of the time."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.present: list[int] = []
        self.sessions: dict[str, int] = {}  # rid -> its deepest block, for extending chains
        self.count = 0

    def wire(self, h: int) -> int:
        return h + 2**64 if h < 0 and self.rng.random() < 0.35 else h

    def new_hash(self) -> int:
        return self.rng.randrange(-(2**63), 2**63)

    def events(self) -> list[KVEvent]:
        return [self.event() for _ in range(self.rng.randint(1, 4))]

    def event(self) -> KVEvent:
        rng = self.rng
        roll = rng.random()
        if roll < 0.004:
            self.present.clear()
            self.sessions.clear()
            return AllBlocksCleared()
        if roll < 0.35 and self.present:
            victims = rng.sample(self.present, min(len(self.present), rng.randint(1, 2)))
            for victim in victims:
                self.present.remove(victim)
            return BlockRemoved([self.wire(v) for v in victims])
        self.count += 1
        rid = f"r{self.count}" if rng.random() < 0.8 else None
        parent = rng.choice(self.present) if self.present and rng.random() < 0.7 else None
        if rid is None and self.sessions and rng.random() < 0.5:  # a chain continued
            rid, parent = rng.choice(sorted(self.sessions.items()))
            if parent not in self.present:
                parent = None
        hashes = [self.new_hash() for _ in range(rng.randint(1, 3))]
        self.present.extend(hashes)
        if rid is not None:
            self.sessions[rid] = hashes[-1]
        tokens = [rng.randrange(50_000) for _ in range(PAGE * len(hashes))]
        if rng.random() < 0.1:
            tokens = tokens[:-1]  # do not split into pages: stored without tokens
        return BlockStored(
            [self.wire(h) for h in hashes],
            None if parent is None else self.wire(parent),
            tokens,
            block_size=PAGE,
            session_id=rid,
        )


# ---------------------------------------------------------------------------------------------
# Hostile traffic
# ---------------------------------------------------------------------------------------------

DEEP = b"\x91" * 1_100 + b"\x90"  # about 1 KB nested 1,100 deep


def batch_bytes(*events: bytes) -> bytes:
    return b"\x93\xcb" + b"\x00" * 8 + bytes([0x90 + len(events)]) + b"".join(events) + b"\x00"


def hostile_payloads(rng: random.Random) -> list[tuple[str, bytes, list[KVEvent]]]:
    """In-sequence payloads: (name, payload, the valid events in it that must be applied)."""
    cycle_a, cycle_b = 10**15 + rng.randrange(10**6), 2 * 10**15 + rng.randrange(10**6)
    good = BlockRemoved([rng.randrange(2**62)])  # unknown to the cache: harmless, valid
    cyclic = [
        BlockStored([cycle_a], cycle_b, [1, 1], block_size=PAGE),
        BlockStored([cycle_b], cycle_a, [2, 2], block_size=PAGE),
    ]
    self_parent = BlockStored([cycle_a + 7], cycle_a + 7, [3, 3], block_size=PAGE)
    encoded = msgspec.msgpack.encode
    mixed = [
        encoded(["BlockRemoved", good.block_hashes, "GPU"]),
        encoded(["BlockStored", [5, 6], [1, 2, 3, 4], 2, None, "GPU"]),  # parent slot shifted
        encoded(["BlockStored", [5], None, "GPU", [1, 2], 2]),  # fields swapped
        encoded({"type": "BlockStored", "block_hashes": ["not a hash"]}),
        encoded({"type": "BlockStored", "block_hashes": [9], "session_id": "x" * 10_000}),
        encoded({"type": "BlockStored", "deep": None}).replace(
            b"\xc0",
            DEEP[-800:],  # nested, within the recursion limit: one bad event
        ),
        b"\x92\xacBlockRemoved\xdd"
        + (MAX_HASHES_PER_EVENT + 1).to_bytes(4, "big")
        + b"\x01" * (MAX_HASHES_PER_EVENT + 1),
        encoded(["BlockRemoved", good.block_hashes]),
    ]
    return [
        ("garbage", bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))), []),
        ("deep", batch_bytes(DEEP), []),
        ("deep-event", batch_bytes(b"\x91" + DEEP), []),
        ("claims 2^32 events", b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff", []),
        ("mixed", batch_bytes(*mixed), [good, good]),
        ("cycle", encode_mapped(KVEventBatch(ts=0.0, events=[*cyclic, self_parent])), cyclic),
    ]


def hostile_frames(rng: random.Random, next_seq: int) -> list[tuple[str, list[bytes]]]:
    """Out-of-sequence raw frames: none of them may change the mirror."""
    store = encode_mapped(
        KVEventBatch(ts=0.0, events=[BlockStored([rng.randrange(2**62)], session_id="stray")])
    )
    seq = lambda n: n.to_bytes(8, "big")  # noqa: E731
    return [
        ("two frames", [b"", seq(next_seq)]),
        ("short seq frame", [b"", b"\x00\x01", store]),
        ("seq 2^64-1", [b"", b"\xff" * 8, store]),
        ("far ahead", [b"", seq(next_seq + 10**9), store]),
        ("just ahead", [b"", seq(next_seq + 3), store]),
        ("back to 0", [b"", seq(0), store]),
        ("garbage under a far seq", [b"", seq(next_seq + 10**12), b"\xc1" * 17]),
    ]


# ---------------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------------


def connect(subscriber: KVEventSubscriber, publisher: KVEventPublisher) -> None:
    """Publish empty batches until one arrives: PUB/SUB drops what precedes the subscription."""
    before = subscriber.stats()["applied"]
    deadline = time.monotonic() + 10
    while subscriber.stats()["applied"] == before:
        assert time.monotonic() < deadline, "subscriber never connected"
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        time.sleep(0.02)


def settle(
    subscriber: KVEventSubscriber,
    publisher: KVEventPublisher,
    done: Callable[[], bool],
    timeout_s: float = 20.0,
) -> None:
    """Wait until ``done()`` once every sequenced batch is applied (a last empty batch reveals a
    gap if the very last one was lost)."""
    publisher.flush()
    last = publisher.publish(KVEventBatch(ts=time.time(), events=[]))
    publisher.flush()
    deadline = time.monotonic() + timeout_s
    while subscriber.stats()["expected_seq"][0] != last + 1 or not done():
        assert time.monotonic() < deadline, f"not settled: {subscriber.stats()}"
        time.sleep(0.01)


class Recorder:
    def __init__(self) -> None:
        self.evicted: list[str] = []

    def __call__(self, rid: str) -> None:
        self.evicted.append(rid)


def assert_mirror_equals(mirror: CacheMirror, reference: Reference) -> None:
    assert mirror.block_hashes(0) == set(reference.parent)
    for h, parent in reference.parent.items():
        block = mirror.block(h)  # type: ignore[arg-type]
        assert block is not None and block["parent"] == parent, (h, block, parent)
    assert mirror.cached_requests() == set(reference.attached)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_valid_events_keep_flowing_through_hostile_traffic(seed: int, endpoints) -> None:
    rng = random.Random(seed)
    workload = Workload(seed)
    reference = Reference()
    recorder = Recorder()
    mirror = CacheMirror(recorder)
    pub_ep, replay_ep = endpoints()
    injected = {"payloads": 0, "frames": 0, "bad_events": 0}
    with (
        KVEventPublisher(pub_ep, replay_ep, buffer_steps=100_000) as publisher,
        KVEventSubscriber(
            pub_ep, replay_ep, on_batch=mirror.apply_batch, on_resync=mirror.resync
        ) as subscriber,
    ):
        connect(subscriber, publisher)
        payloads = hostile_payloads(rng)
        for step in range(600):
            events = workload.events()
            for event in events:
                reference.apply(event)
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
            if step % 7 == 3:
                name, payload, valid = payloads[(step // 7) % len(payloads)]
                for event in valid:
                    reference.apply(event)
                publisher.publish_payload(payload)
                injected["payloads"] += 1
            if step % 11 == 5:
                seq = publisher.publish(KVEventBatch(ts=time.time(), events=[])) + 1
                frames = hostile_frames(rng, seq)
                name, raw = frames[(step // 11) % len(frames)]
                publisher.send_raw_frames(raw)
                injected["frames"] += 1
            if step % 50 == 0:
                time.sleep(0.01)  # let the subscriber keep up: no PUB/SUB drops needed
        settle(subscriber, publisher, lambda: recorder.evicted == reference.evicted)
        stats = subscriber.stats()
        assert subscriber.running
    assert_mirror_equals(mirror, reference)
    assert recorder.evicted == reference.evicted and len(reference.evicted) > 50
    assert stats["resyncs"] == 0 and stats["restarts"] == 0 and stats["thread_restarts"] == 0
    assert stats["handler_errors"] == 0
    assert stats["malformed"] >= injected["payloads"] // 2  # garbage, deep, claims; frames
    assert stats["bad_sequence"] >= 1 and stats["malformed_events"] >= 1
    assert mirror.stats()["malformed_events"] >= 1  # the self-parent store
    assert mirror.stats()["cycles_refused"] >= 1


def test_no_replay_socket_hostile_jumps_cost_no_resync(endpoints, wait_for) -> None:
    # Without a replay socket a jump is held until the next message decides on it.
    pub_ep, _ = endpoints(replay=False)
    reference = Reference()
    recorder = Recorder()
    mirror = CacheMirror(recorder)
    workload = Workload(7)
    rng = random.Random(7)
    with (
        KVEventPublisher(pub_ep) as publisher,
        KVEventSubscriber(pub_ep, on_batch=mirror.apply_batch, on_resync=mirror.resync) as sub,
    ):
        connect(sub, publisher)
        resyncs_before = sub.stats()["resyncs"]
        for step in range(200):
            events = workload.events()
            for event in events:
                reference.apply(event)
            seq = publisher.publish(KVEventBatch(ts=time.time(), events=events))
            if step % 9 == 4:
                frames = hostile_frames(rng, seq + 1)
                publisher.send_raw_frames(frames[step % len(frames)][1])
            if step % 50 == 0:
                time.sleep(0.01)
        settle(sub, publisher, lambda: recorder.evicted == reference.evicted)
        stats = sub.stats()
    assert_mirror_equals(mirror, reference)
    assert stats["resyncs"] == resyncs_before and stats["restarts"] == 0
    assert stats["bad_sequence"] >= 1


def test_memory_stays_within_the_block_bound_under_a_flood(endpoints) -> None:
    # A flood of stores (and of huge claims, oversized and cyclic frames) with a small bound:
    # the mirror holds at most max_blocks blocks, its tables no more, and keeps applying.
    pub_ep, replay_ep = endpoints()
    bound = 500
    recorder = Recorder()
    mirror = CacheMirror(recorder, max_blocks=bound)
    stored = 0
    with (
        KVEventPublisher(pub_ep, replay_ep, buffer_steps=100_000) as publisher,
        KVEventSubscriber(pub_ep, replay_ep, on_batch=mirror.apply_batch) as subscriber,
    ):
        connect(subscriber, publisher)
        # Over the size limit: the socket refuses it (the peer is dropped and reconnects; the
        # replay fills what was lost meanwhile).
        publisher.send_raw_frames([b"", (1).to_bytes(8, "big"), b"\x00" * (MAX_PAYLOAD_BYTES + 1)])
        for step in range(300):
            base = 10**9 * (step + 1)
            events: list[KVEvent] = [
                BlockStored(
                    [base + k for k in range(4)], None, list(range(8)), PAGE, session_id=f"s{step}"
                ),
                BlockStored([base + 10], base + 11, [], 0),  # a cycle, in two stores
                BlockStored([base + 11], base + 10, [], 0),
            ]
            stored += 6
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
            if step % 100 == 50:  # a claim of 2^32 - 1 hashes, none of them sent
                publisher.publish_payload(batch_bytes(b"\x92\xacBlockRemoved\xdd\xff\xff\xff\xff"))
        settle(subscriber, publisher, lambda: mirror.stats()["stored_blocks"] == stored)
        stats = mirror.stats()
        internal = mirror._blocks._ranks[0]
    assert stats["blocks"] <= bound and stats["bound_evictions"] == stored - stats["blocks"]
    assert len(internal.leaves) <= bound and len(internal.tokens) <= bound
    assert len(internal.orphans) <= bound
    assert len(recorder.evicted) == len(set(recorder.evicted)) > 0
    assert subscriber.stats()["resyncs"] == 0
