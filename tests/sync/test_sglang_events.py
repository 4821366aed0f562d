"""The sglang tier: our subscriber and mirror against the real SGLang code.

Drives the real ``RadixCache.create_simulated(..., enable_kv_cache_events=True)`` (SGLang
0.5.23) and publishes its events through the real ``EventPublisherFactory.create(config, 0)``
ZMQ publisher on tcp://127.0.0.1 with its replay endpoint, stepping the way SGLang's scheduler
does (``take_events`` then ``publish(KVEventBatch(ts, events))``). The old positional wire
shape comes from the real publisher of SGLang 0.5.18 (its ``kv_events.py``, extracted from the
wheel by scripts/setup-sglang-env.sh).

Run: ``bash scripts/setup-sglang-env.sh && .venv-sglang/bin/python -m pytest -m sglang tests/sync``
(skipped where SGLang is not installed). ``CONTEXTPILOT_CAPTURE_FRAMES=DIR`` also writes the
captured wire frames of both versions to DIR.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

pytestmark = pytest.mark.sglang

radix_cache = pytest.importorskip(
    "sglang.srt.mem_cache.radix_cache",
    reason="SGLang tier: run it in .venv-sglang (bash scripts/setup-sglang-env.sh)",
)

from sglang.srt.disaggregation import kv_events as sglang_kv_events  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.utils import hash_str_to_int64  # noqa: E402

from contextpilot_integrations.core.index.context_index import ContextIndex  # noqa: E402
from contextpilot_integrations.sync.cache_mirror import CacheMirror  # noqa: E402
from contextpilot_integrations.sync.kv_events import (  # noqa: E402
    BlockStored,
    KVEventDecoder,
    event_kind,
)
from contextpilot_integrations.sync.subscriber import KVEventSubscriber  # noqa: E402

OLD_SGLANG_KV_EVENTS = Path(sys.prefix) / "sglang-0.5.18" / "kv_events.py"


class PoolStandIn:
    """The KV pool allocator ``create_simulated`` takes: counts freed slots (no GPU memory)."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        self.freed += len(indices)


class SimulatedEngine:
    """SGLang's radix cache and event publisher, stepped as the scheduler steps them.

    Requests are served as a scheduler would: match the prefix, lock it, evict least recently
    used leaves until the new tokens fit in ``capacity_tokens``, insert, unlock, publish.
    """

    def __init__(self, publisher: Any, page_size: int, capacity_tokens: int) -> None:
        self.cache = radix_cache.RadixCache.create_simulated(
            mock_allocator=PoolStandIn(), page_size=page_size, enable_kv_cache_events=True
        )
        self.publisher = publisher
        self.page_size = page_size
        self.capacity_tokens = capacity_tokens
        self.published = 0
        self.step()  # the construction's AllBlocksCleared, as a fresh engine's first batch

    def serve(self, tokens: list[int]) -> None:
        key = radix_cache.RadixKey(tokens)
        match = self.cache.match_prefix(MatchPrefixParams(key=key))
        node = match.last_device_node
        self.cache.inc_lock_ref(node)
        aligned = len(tokens) // self.page_size * self.page_size
        overflow = self.cache.total_size() + aligned - match.device_prefix_len
        overflow -= self.capacity_tokens
        if overflow > 0:
            self.cache.evict(EvictParams(num_tokens=overflow))
        self.cache.dec_lock_ref(node)
        self.cache.insert(InsertParams(key=key, value=None))
        self.step()

    def reset(self) -> None:
        self.cache.reset()
        self.step()

    def step(self) -> None:
        events = self.cache.take_events()
        if events:
            self.publisher.publish(self.batch(events))
            self.published += 1

    def batch(self, events: list[Any]) -> Any:
        return sglang_kv_events.KVEventBatch(ts=time.time(), events=events)

    def blocks(self) -> dict[int, tuple[int | None, tuple[int, ...]]]:
        """The engine's cached pages: hash -> (parent hash, page tokens), read from the tree's
        own hash values (SGLang's ``hash_str_to_int64`` gives the published form)."""
        out: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        stack = [(child, None) for child in self.cache.root_node.children.values()]
        while stack:
            node, parent = stack.pop()
            tokens = list(node.key.token_ids)
            for index, value in enumerate(node.hash_value):
                block_hash = hash_str_to_int64(value)
                page = tokens[index * self.page_size : (index + 1) * self.page_size]
                out[block_hash] = (parent, tuple(page))
                parent = block_hash
            stack.extend((child, parent) for child in node.children.values())
        return out

    def fully_cached(self, tokens: list[int]) -> bool:
        """Whether every whole page of ``tokens`` is cached (walks ``blocks()``: no LRU touch)."""
        children = {(parent, page): h for h, (parent, page) in self.blocks().items()}
        parent = None
        for start in range(0, len(tokens) // self.page_size * self.page_size, self.page_size):
            parent = children.get((parent, tuple(tokens[start : start + self.page_size])))
            if parent is None:
                return False
        return True

    def shutdown(self) -> None:
        self.publisher.shutdown()


def sglang_config(base: int, topic: str = "kv") -> str:
    return json.dumps(
        {
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{base}",
            "bind": True,
            "replay_endpoint": f"tcp://127.0.0.1:{base + 1}",
            "topic": topic,
            "buffer_steps": 10_000,
        }
    )


def wait_caught_up(subscriber: KVEventSubscriber, engine: SimulatedEngine, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while subscriber.stats()["expected_seq"][0] != engine.published:
        if time.monotonic() > deadline:
            raise AssertionError(f"subscriber behind: {subscriber.stats()}, {engine.published}")
        time.sleep(0.01)


def workload(seed: int, count: int) -> list[tuple[str, list[int], list[int]]]:
    """(rid, document ids, prompt tokens): a shared system prompt, 3 of 10 documents in a
    random order, a unique question; token ids are small ints (a fake vocabulary)."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 500) for _ in range(8)]
    documents = [[rng.randrange(1, 500) for _ in range(rng.randrange(6, 20))] for _ in range(10)]
    requests = []
    for number in range(count):
        chosen = rng.sample(range(10), 3)
        question = [rng.randrange(500, 1000) for _ in range(5)]
        tokens = system + [t for d in chosen for t in documents[d]] + question
        requests.append((f"rid-{number}", chosen, tokens))
    return requests


def assert_mirror_equals_engine(mirror: CacheMirror, engine: SimulatedEngine) -> None:
    expected = engine.blocks()
    assert mirror.block_hashes(0) == set(expected)
    for block_hash, (parent, tokens) in expected.items():
        block = mirror.block(block_hash)
        assert block is not None
        assert block["parent"] == parent and tuple(block["token_ids"]) == tokens


@pytest.mark.parametrize("page_size", [1, 4])
def test_mirror_follows_inserts_lru_evictions_and_reset_exactly(
    page_size: int, free_port_range
) -> None:
    base = free_port_range(2)
    mirror = CacheMirror()
    # The subscriber starts before the engine exists (its first batches may be lost to the
    # PUB/SUB join and come back through the replay socket).
    subscriber = KVEventSubscriber(
        f"tcp://127.0.0.1:{base}",
        f"tcp://127.0.0.1:{base + 1}",
        topic="kv",
        on_batch=mirror.apply_batch,
        on_resync=mirror.resync,
    ).start()
    engine = SimulatedEngine(
        sglang_kv_events.EventPublisherFactory.create(sglang_config(base), 0),
        page_size=page_size,
        capacity_tokens=160,
    )
    try:
        for number, (_, _, tokens) in enumerate(workload(seed=page_size, count=80)):
            engine.serve(tokens)
            if number % 10 == 9:
                wait_caught_up(subscriber, engine)
                assert_mirror_equals_engine(mirror, engine)
        assert mirror.stats()["removed_blocks"] > 50  # LRU evictions really happened
        engine.reset()
        wait_caught_up(subscriber, engine)
        assert mirror.block_hashes(0) == set()
        stats = subscriber.stats()
        assert stats["malformed"] == 0 and stats["resyncs"] == 0
        assert mirror.stats()["unknown_removals"] == 0
    finally:
        subscriber.stop()
        engine.shutdown()


def test_context_index_drops_exactly_the_evicted_requests(free_port_range) -> None:
    base = free_port_range(2)
    index = ContextIndex(max_requests=None)
    mirror = CacheMirror(index.evict)
    subscriber = KVEventSubscriber(
        f"tcp://127.0.0.1:{base}",
        f"tcp://127.0.0.1:{base + 1}",
        topic="kv",
        on_batch=mirror.apply_batch,
        on_resync=mirror.resync,
    ).start()
    engine = SimulatedEngine(
        sglang_kv_events.EventPublisherFactory.create(sglang_config(base), 0),
        page_size=2,
        capacity_tokens=200,
    )
    served: dict[str, list[int]] = {}
    expected_evicted: set[str] = set()
    try:
        for rid, documents, tokens in workload(seed=7, count=70):
            index.insert(rid, documents)
            # RadixCache does not echo session_id: attribution is by the prompt's tokens.
            mirror.register_request(rid, tokens)
            engine.serve(tokens)
            served[rid] = tokens
            for other, other_tokens in served.items():
                if other not in expected_evicted and not engine.fully_cached(other_tokens):
                    expected_evicted.add(other)
        wait_caught_up(subscriber, engine)
        assert expected_evicted and len(expected_evicted) < len(served)
        assert set(index.rids()) == set(served) - expected_evicted
        assert mirror.cached_requests() == set(served) - expected_evicted
        assert mirror.stats()["evicted_requests"] == len(expected_evicted)
        engine.reset()
        wait_caught_up(subscriber, engine)
        assert index.rids() == [] and mirror.cached_requests() == set()
    finally:
        subscriber.stop()
        engine.shutdown()


def test_gap_repaired_from_the_real_replay_socket(free_port_range) -> None:
    base = free_port_range(2)
    mirror = CacheMirror()
    resyncs: list[int] = []
    subscriber = KVEventSubscriber(
        f"tcp://127.0.0.1:{base}",
        f"tcp://127.0.0.1:{base + 1}",
        topic="kv",
        on_batch=mirror.apply_batch,
        on_resync=resyncs.append,
    ).start()
    engine = SimulatedEngine(
        sglang_kv_events.EventPublisherFactory.create(sglang_config(base), 0),
        page_size=1,
        capacity_tokens=120,
    )
    requests = workload(seed=3, count=30)
    try:
        for _, _, tokens in requests[:10]:
            engine.serve(tokens)
        wait_caught_up(subscriber, engine)
        repaired_before = subscriber.stats()["repaired"]
        subscriber.stop()  # batches published meanwhile are lost to this subscriber
        for _, _, tokens in requests[10:25]:
            engine.serve(tokens)
        subscriber.start()
        time.sleep(0.3)  # let the subscription reach the publisher
        for _, _, tokens in requests[25:]:
            engine.serve(tokens)
        wait_caught_up(subscriber, engine)
        assert_mirror_equals_engine(mirror, engine)
        assert subscriber.stats()["repaired"] > repaired_before and resyncs == []
    finally:
        subscriber.stop()
        engine.shutdown()


# ---------------------------------------------------------------------------------------------
# Wire shapes captured from the real publishers of SGLang 0.5.23 and 0.5.18.
# ---------------------------------------------------------------------------------------------


def load_sglang_0518() -> Any:
    if not OLD_SGLANG_KV_EVENTS.exists():
        pytest.skip(f"{OLD_SGLANG_KV_EVENTS} missing: run scripts/setup-sglang-env.sh")
    spec = importlib.util.spec_from_file_location("sglang_0_5_18_kv_events", OLD_SGLANG_KV_EVENTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Sglang0518Engine(SimulatedEngine):
    """The 0.5.23 radix cache publishing through SGLang 0.5.18's publisher and event structs:
    the same fields 0.5.18's cache recorded (no session_id, lora_name; a salted store adds
    0.5.18's trailing metadata)."""

    def __init__(self, old: Any, publisher: Any, page_size: int, capacity_tokens: int) -> None:
        self.old = old
        super().__init__(publisher, page_size, capacity_tokens)

    def batch(self, events: list[Any]) -> Any:
        converted = []
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                converted.append(
                    self.old.BlockStored(
                        block_hashes=list(event.block_hashes),
                        parent_block_hash=event.parent_block_hash,
                        token_ids=list(event.token_ids),
                        block_size=event.block_size,
                        lora_id=event.lora_id,
                        medium=event.medium,
                    )
                )
            elif kind == "BlockRemoved":
                converted.append(
                    self.old.BlockRemoved(
                        block_hashes=list(event.block_hashes), medium=event.medium
                    )
                )
            else:
                converted.append(self.old.AllBlocksCleared())
        return self.old.KVEventBatch(ts=time.time(), events=converted)


def capture(endpoint: str, topic: bytes, count: int, produce: Any) -> list[list[bytes]]:
    """Frames as a plain zmq SUB receives them (``bind``: for a connecting publisher)."""
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, topic)
    socket.connect(endpoint)
    try:
        frames: list[list[bytes]] = []
        deadline = time.monotonic() + 20
        produce()
        while len(frames) < count:
            assert time.monotonic() < deadline, f"captured only {len(frames)} messages"
            if socket.poll(100):
                frames.append(socket.recv_multipart())
            else:
                produce()
        return frames
    finally:
        socket.close(linger=0)
        context.term()


def save_frames(name: str, frames: list[list[bytes]]) -> None:
    target = os.environ.get("CONTEXTPILOT_CAPTURE_FRAMES")
    if target:
        path = Path(target) / f"{name}.msgpack"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(msgspec.msgpack.encode(frames))


def test_map_shape_captured_from_sglang_0523(free_port_range) -> None:
    base = free_port_range(2)
    engine = SimulatedEngine(
        sglang_kv_events.EventPublisherFactory.create(sglang_config(base, topic="kv"), 0),
        page_size=2,
        capacity_tokens=40,
    )
    requests = iter(workload(seed=11, count=200))
    try:
        frames = capture(
            f"tcp://127.0.0.1:{base}", b"kv", 8, lambda: engine.serve(next(requests)[2])
        )
    finally:
        engine.shutdown()
    save_frames("sglang-0.5.23-map", frames)
    decoder = KVEventDecoder()
    kinds = set()
    for topic, seq, payload in frames:
        assert topic == b"kv" and len(seq) == 8
        raw = msgspec.msgpack.decode(payload)
        assert all(isinstance(event, dict) and "type" in event for event in raw[1])
        assert raw[2] == 0  # attn_dp_rank
        batch = decoder.decode(payload)
        kinds.update(event_kind(event) for event in batch.events)
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.medium == "GPU" and len(event.token_ids) == 2 * len(event.block_hashes)
    assert {"BlockStored", "BlockRemoved"} <= kinds


def test_positional_shape_from_the_sglang_0518_publisher_is_followed_exactly(
    free_port_range,
) -> None:
    old = load_sglang_0518()
    base = free_port_range(2)
    # 0.5.18 binds only wildcard, ipc and inproc endpoints (a tcp://127.0.0.1 endpoint makes
    # it connect): use ipc for the PUB socket, tcp on loopback for the replay ROUTER.
    endpoint = f"ipc:///tmp/contextpilot-sglang0518-{base}.ipc"
    config = json.dumps(
        {
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": f"tcp://127.0.0.1:{base + 1}",
            "topic": "kv",
        }
    )
    publisher = old.EventPublisherFactory.create(config, 0)
    engine = Sglang0518Engine(old, publisher, page_size=2, capacity_tokens=120)
    mirror = CacheMirror()
    subscriber = KVEventSubscriber(
        endpoint,
        f"tcp://127.0.0.1:{base + 1}",
        topic="kv",
        on_batch=mirror.apply_batch,
        on_resync=mirror.resync,
    )
    requests = workload(seed=5, count=60)
    try:
        frames = capture(endpoint, b"kv", 3, lambda: engine.serve(requests.pop()[2]))
        save_frames("sglang-0.5.18-positional", frames)
        for _, _, payload in frames:
            raw = msgspec.msgpack.decode(payload)
            assert all(isinstance(event, list) and isinstance(event[0], str) for event in raw[1])
        # Start late: everything before comes from 0.5.18's replay socket (no topic frame).
        subscriber.start()
        time.sleep(0.3)
        while requests:
            engine.serve(requests.pop()[2])
        wait_caught_up(subscriber, engine)
        assert_mirror_equals_engine(mirror, engine)
        # A salted store: 0.5.18 appends {"cache_salt": ...} as an eighth positional item.
        salted = old.BlockStoredWithMetadata(
            block_hashes=[424242],
            parent_block_hash=None,
            token_ids=[1, 2],
            block_size=2,
            lora_id=None,
            medium="GPU",
            metadata=old.BlockStoredMetadata(cache_salt="tenant-a"),
        )
        engine.publisher.publish(old.KVEventBatch(ts=time.time(), events=[salted]))
        engine.published += 1
        wait_caught_up(subscriber, engine)
        # The salt is part of the block's key: only its tenant's namespace holds it.
        assert mirror.block(424242) is None
        assert mirror.block(424242, cache_salt="tenant-a") == {
            "parent": None,
            "token_ids": [1, 2],
            "session_id": None,
            "media": ["GPU"],
        }
        stats = subscriber.stats()
        assert stats["repaired"] >= 1 and stats["resyncs"] == 0 and stats["malformed"] == 0
    finally:
        subscriber.stop()
        engine.shutdown()
