"""KVEventSubscriber against a real pyzmq PUB/ROUTER publisher on 127.0.0.1: both wire shapes,
a dropped message repaired by replay, resync when repair is impossible, a publisher restart,
malformed frames, a subscriber started before the publisher, data-parallel ranks."""

from __future__ import annotations

import time

import msgspec
import pytest

from contextpilot_integrations.sync.cache_mirror import CacheMirror
from contextpilot_integrations.sync.event_publisher import KVEventPublisher
from contextpilot_integrations.sync.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from contextpilot_integrations.sync.subscriber import KVEventSubscriber, rank_endpoint


def store(h: int, parent: int | None = None, session: str | None = None) -> KVEventBatch:
    event = BlockStored([h], parent, [h, h + 1], block_size=2, session_id=session)
    return KVEventBatch(ts=time.time(), events=[event])


def remove(*hashes: int) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[BlockRemoved(list(hashes))])


class Resyncs:
    def __init__(self, mirror: CacheMirror) -> None:
        self.ranks: list[int] = []
        self.mirror = mirror

    def __call__(self, rank: int) -> None:
        self.ranks.append(rank)
        self.mirror.resync(rank)


def connected(subscriber: KVEventSubscriber, publisher: KVEventPublisher) -> None:
    """Publish probes until one arrives: PUB/SUB drops what precedes the subscription."""
    before = subscriber.stats()["applied"]
    probe = KVEventBatch(ts=time.time(), events=[])
    deadline = time.monotonic() + 10
    while subscriber.stats()["applied"] == before:
        assert time.monotonic() < deadline, "subscriber never connected"
        publisher.publish(probe)
        time.sleep(0.02)


@pytest.mark.parametrize("shape", ["map", "positional"])
def test_follows_stores_and_removals_in_both_shapes(shape: str, endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    evicted: list[str] = []
    mirror = CacheMirror(evicted.append)
    # The positional shape has no session_id: only the map shape attributes by session.
    sessions = shape == "map"
    with (
        KVEventPublisher(pub_ep, replay_ep, shape=shape) as publisher,  # type: ignore[arg-type]
        KVEventSubscriber(pub_ep, replay_ep, on_batch=mirror.apply_batch) as subscriber,
    ):
        connected(subscriber, publisher)
        publisher.publish(store(1, session="a"))
        publisher.publish(store(2, parent=1, session="b"))
        publisher.publish(store(3))
        publisher.publish(remove(2))
        wait_for(lambda: mirror.block_hashes(0) == {1, 3})
        assert mirror.block(2) is None and mirror.block(3)["token_ids"] == [3, 4]
        assert evicted == (["b"] if sessions else [])
        publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        wait_for(lambda: mirror.block_hashes(0) == set())
    assert evicted == (["b", "a"] if sessions else [])
    stats = subscriber.stats()
    assert stats["malformed"] == 0 and stats["resyncs"] == 0
    assert not subscriber.running


def test_positional_shape_drops_session_ids(endpoints, wait_for) -> None:
    # The old shape cannot carry session_id, so only token matching attributes there.
    pub_ep, replay_ep = endpoints()
    evicted: list[str] = []
    mirror = CacheMirror(evicted.append)
    mirror.register_request("r", [5, 6])
    with (
        KVEventPublisher(pub_ep, replay_ep, shape="positional") as publisher,
        KVEventSubscriber(pub_ep, replay_ep, on_batch=mirror.apply_batch) as subscriber,
    ):
        connected(subscriber, publisher)
        publisher.publish(store(5, session="ignored"))
        wait_for(lambda: mirror.request_blocks("r") == {0: {5}})
        publisher.publish(remove(5))
        wait_for(lambda: evicted == ["r"])


@pytest.mark.parametrize("topic_frame", [True, False], ids=["sglang-0.5.2x", "sglang-0.5.18-vllm"])
def test_a_dropped_message_is_repaired_from_the_replay_socket(
    topic_frame: bool, endpoints, wait_for
) -> None:
    pub_ep, replay_ep = endpoints()
    mirror = CacheMirror()
    resyncs = Resyncs(mirror)
    with (
        KVEventPublisher(pub_ep, replay_ep, replay_topic_frame=topic_frame) as publisher,
        KVEventSubscriber(
            pub_ep, replay_ep, on_batch=mirror.apply_batch, on_resync=resyncs
        ) as subscriber,
    ):
        connected(subscriber, publisher)
        gaps_before = subscriber.stats()["gaps"]
        publisher.publish(store(1))
        publisher.publish(store(2, parent=1), drop=True)
        publisher.publish(store(3, parent=2), drop=True)
        publisher.publish(store(4, parent=3))
        wait_for(lambda: mirror.block_hashes(0) == {1, 2, 3, 4})
        stats = subscriber.stats()
    assert stats["gaps"] == gaps_before + 1 and stats["repaired"] >= 1
    assert stats["replayed"] >= 2 and resyncs.ranks == []
    assert mirror.block(3) is not None and mirror.block(3)["parent"] == 2


def test_a_gap_without_replay_resyncs(endpoints, wait_for) -> None:
    pub_ep, _ = endpoints(replay=False)
    evicted: list[str] = []
    mirror = CacheMirror(evicted.append)
    resyncs = Resyncs(mirror)
    with (
        KVEventPublisher(pub_ep) as publisher,
        KVEventSubscriber(pub_ep, on_batch=mirror.apply_batch, on_resync=resyncs) as subscriber,
    ):
        connected(subscriber, publisher)
        resyncs.ranks.clear()
        publisher.publish(store(1, session="a"))
        publisher.publish(store(2, parent=1), drop=True)
        publisher.publish(store(3, session="c"))
        wait_for(lambda: 3 in mirror.block_hashes(0))
    assert resyncs.ranks == [0]
    assert evicted == ["a"]  # what was believed cached before the gap is forgotten
    assert mirror.block_hashes(0) == {3}


def test_replay_that_no_longer_holds_the_range_resyncs_then_applies_the_tail(
    endpoints, wait_for
) -> None:
    pub_ep, replay_ep = endpoints()
    mirror = CacheMirror()
    resyncs = Resyncs(mirror)
    with (
        KVEventPublisher(pub_ep, replay_ep, buffer_steps=3) as publisher,
        KVEventSubscriber(
            pub_ep, replay_ep, on_batch=mirror.apply_batch, on_resync=resyncs
        ) as subscriber,
    ):
        connected(subscriber, publisher)
        resyncs.ranks.clear()
        repaired_before = subscriber.stats()["repaired"]
        publisher.publish(store(1))
        for h in range(2, 8):
            publisher.publish(store(h), drop=True)  # 6 lost, the buffer keeps 3
        publisher.publish(store(8))
        wait_for(lambda: 8 in mirror.block_hashes(0))
        stats = subscriber.stats()
    assert resyncs.ranks == [0] and stats["repaired"] == repaired_before
    # Stores 6 and 7 were still in the buffer: applied after the resync; 1 was forgotten.
    assert mirror.block_hashes(0) == {6, 7, 8}


def test_publisher_restart_resyncs_and_follows_the_new_stream(endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    evicted: list[str] = []
    mirror = CacheMirror(evicted.append)
    resyncs = Resyncs(mirror)
    with KVEventSubscriber(
        pub_ep, replay_ep, on_batch=mirror.apply_batch, on_resync=resyncs
    ) as subscriber:
        with KVEventPublisher(pub_ep, replay_ep) as first:
            connected(subscriber, first)
            for h in range(1, 6):
                first.publish(store(h, session=f"old{h}"))
            wait_for(lambda: len(mirror.block_hashes(0)) == 5)
        resyncs.ranks.clear()
        with KVEventPublisher(pub_ep, replay_ep) as second:  # seq starts again at 0
            second.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
            second.publish(store(50, session="new"))
            # Both go out before the subscriber reconnects (lost on the PUB side); the next
            # batch it sees has a lower seq than expected: a restart, repaired by replay.
            connected(subscriber, second)
            wait_for(lambda: mirror.block_hashes(0) == {50})
            stats = subscriber.stats()
    assert stats["restarts"] == 1 and resyncs.ranks and set(resyncs.ranks) == {0}
    assert sorted(evicted) == [f"old{h}" for h in range(1, 6)]
    assert mirror.cached_requests() == {"new"}


def test_malformed_frames_are_counted_and_skipped(endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    mirror = CacheMirror()
    with (
        KVEventPublisher(pub_ep, replay_ep) as publisher,
        KVEventSubscriber(pub_ep, replay_ep, on_batch=mirror.apply_batch) as subscriber,
    ):
        connected(subscriber, publisher)
        gaps_before = subscriber.stats()["gaps"]
        publisher.publish(store(1))
        publisher.send_raw_frames([b"", b"\x00" * 8])  # two frames
        publisher.send_raw_frames([b"", b"\x01\x02", b"\x90"])  # bad sequence frame
        publisher.publish_payload(b"\xc1garbage")  # undecodable payload, valid seq
        publisher.publish_payload(msgspec.msgpack.encode([1.0, [["BlockStored", "x"]]]))
        publisher.publish(store(2, parent=1))
        wait_for(lambda: mirror.block_hashes(0) == {1, 2})
        stats = subscriber.stats()
    assert stats["malformed"] == 3 and stats["malformed_events"] == 1  # a bad event in a batch
    assert stats["gaps"] == gaps_before  # a bad payload still advances the sequence


def test_subscriber_started_before_the_publisher(endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    mirror = CacheMirror()
    with KVEventSubscriber(pub_ep, replay_ep, on_batch=mirror.apply_batch) as subscriber:
        time.sleep(0.2)  # nothing listens yet: ZMQ keeps retrying the connection
        assert subscriber.running and subscriber.stats()["received"] == 0
        with KVEventPublisher(pub_ep, replay_ep) as publisher:
            # Publish at once: the first batches go out before the subscription arrives and
            # are lost on the PUB side; the replay socket brings them back.
            for h in range(1, 51):
                publisher.publish(store(h, parent=h - 1 if h > 1 else None))
            time.sleep(0.3)
            publisher.publish(store(51, parent=50))
            wait_for(lambda: len(mirror.block_hashes(0)) == 51)
    assert mirror.block_hashes(0) == set(range(1, 52))


def test_data_parallel_ranks_use_offset_ports(wait_for, free_port_range) -> None:
    base = free_port_range(4)
    pub_ep, replay_ep = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 2}"
    mirror = CacheMirror()
    publishers = [
        KVEventPublisher(rank_endpoint(pub_ep, r), rank_endpoint(replay_ep, r)).start()
        for r in range(2)
    ]
    try:
        with KVEventSubscriber(
            pub_ep, replay_ep, on_batch=mirror.apply_batch, dp_size=2
        ) as subscriber:
            assert subscriber.endpoints == [pub_ep, f"tcp://127.0.0.1:{base + 1}"]
            for rank, publisher in enumerate(publishers):
                connected(subscriber, publisher)
                publisher.publish(store(10 + rank))
            wait_for(lambda: mirror.block_hashes(0) == {10} and mirror.block_hashes(1) == {11})
    finally:
        for publisher in publishers:
            publisher.stop()


def test_handler_errors_do_not_stop_the_stream(endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    seen: list[int] = []

    def flaky(rank: int, batch: KVEventBatch) -> None:
        seen.append(len(batch.events))
        if len(seen) == 2:
            raise RuntimeError("index unavailable")

    with (
        KVEventPublisher(pub_ep, replay_ep) as publisher,
        KVEventSubscriber(pub_ep, replay_ep, on_batch=flaky) as subscriber,
    ):
        connected(subscriber, publisher)
        publisher.publish(store(1))
        publisher.publish(store(2))
        wait_for(lambda: len(seen) >= 3)
    assert subscriber.stats()["handler_errors"] == 1


def test_start_stop_and_bad_arguments() -> None:
    subscriber = KVEventSubscriber("tcp://127.0.0.1:1", poll_interval_s=0.02)
    subscriber.start()
    with pytest.raises(RuntimeError, match="already running"):
        subscriber.start()
    started = time.monotonic()
    subscriber.stop()
    assert time.monotonic() - started < 1.0 and not subscriber.running
    subscriber.stop()  # idempotent
    subscriber.start().stop()  # restartable
    with pytest.raises(ValueError, match="dp_size"):
        KVEventSubscriber("tcp://127.0.0.1:1", dp_size=0)
    with pytest.raises(ValueError, match="ipc"):
        KVEventSubscriber("ipc:///tmp/x", dp_size=2)
    assert rank_endpoint("tcp://*:5557", 3) == "tcp://127.0.0.1:5560"
    assert rank_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    with pytest.raises(Exception):  # noqa: B017 - zmq rejects the address
        KVEventSubscriber("nonsense://x").start()


def test_a_lost_last_message_is_found_by_the_idle_probe(endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    mirror = CacheMirror()
    with (
        KVEventPublisher(pub_ep, replay_ep) as publisher,
        KVEventSubscriber(
            pub_ep, replay_ep, on_batch=mirror.apply_batch, idle_probe_interval_s=0.2
        ) as subscriber,
    ):
        connected(subscriber, publisher)
        publisher.publish(store(1))
        publisher.publish(remove(1), drop=True)  # nothing follows to reveal the gap
        wait_for(lambda: subscriber.stats()["probes"] > 0 and mirror.block_hashes(0) == set())
    assert subscriber.stats()["resyncs"] == 0


def test_a_restart_whose_new_stream_passed_the_old_seq_is_detected(endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    evicted: list[str] = []
    mirror = CacheMirror(evicted.append)
    with KVEventSubscriber(
        pub_ep, replay_ep, on_batch=mirror.apply_batch, on_resync=mirror.resync
    ) as subscriber:
        with KVEventPublisher(pub_ep, replay_ep) as first:
            connected(subscriber, first)
            first.publish(store(1, session="old"))
            wait_for(lambda: mirror.block_hashes(0) == {1})
        old_expected = subscriber.stats()["expected_seq"][0]
        with KVEventPublisher(pub_ep, replay_ep) as second:
            second.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
            for h in range(100, 100 + old_expected + 5):  # past the old sequence number
                second.publish(store(h))
            second.flush()
            wait_for(lambda: 1 not in mirror.block_hashes(0), timeout_s=15)
            expected = set(range(100, 100 + old_expected + 5))
            wait_for(lambda: mirror.block_hashes(0) == expected)
    assert evicted == ["old"] and subscriber.stats()["restarts"] == 1


def test_restarting_the_subscriber_catches_up_from_the_same_publisher(endpoints, wait_for) -> None:
    pub_ep, replay_ep = endpoints()
    mirror = CacheMirror()
    resyncs = Resyncs(mirror)
    subscriber = KVEventSubscriber(
        pub_ep, replay_ep, on_batch=mirror.apply_batch, on_resync=resyncs
    )
    with KVEventPublisher(pub_ep, replay_ep) as publisher:
        with subscriber:
            connected(subscriber, publisher)
            publisher.publish(store(1))
            wait_for(lambda: mirror.block_hashes(0) == {1})
        for h in range(2, 6):  # published while the subscriber is stopped
            publisher.publish(store(h, parent=h - 1))
        publisher.flush()
        with subscriber:  # reconnects: same publisher (checked by replay), nothing is lost
            wait_for(lambda: mirror.block_hashes(0) == {1, 2, 3, 4, 5})
    stats = subscriber.stats()
    assert stats["restarts"] == 0 and resyncs.ranks == [] and stats["repaired"] >= 1


def test_the_thread_restarts_itself_after_an_unexpected_error(endpoints, wait_for, caplog) -> None:
    # An error the loop does not expect (a RecursionError from the decoder, say) must not end
    # the thread for good: /health would say disconnected and evictions would stop.
    pub_ep, replay_ep = endpoints()
    mirror = CacheMirror()
    subscriber = KVEventSubscriber(pub_ep, replay_ep, on_batch=mirror.apply_batch)
    stream = subscriber._streams[0]
    real_on_message = stream.on_message
    failures = [RuntimeError("a bug"), MemoryError(), RecursionError()]

    def flaky(seq: int, payload: bytes) -> None:
        if failures:
            raise failures.pop(0)
        real_on_message(seq, payload)

    stream.on_message = flaky  # type: ignore[method-assign]
    with KVEventPublisher(pub_ep, replay_ep) as publisher, subscriber:
        published = 0
        deadline = time.monotonic() + 15
        while failures or mirror.block_hashes(0) != set(range(1, published + 1)):
            assert time.monotonic() < deadline, subscriber.stats()
            if failures or published == 0:
                published += 1
                publisher.publish(store(published))
            time.sleep(0.05)
        wait_for(lambda: all(subscriber.stats()["connected"]))
        stats = subscriber.stats()
        assert subscriber.running
    assert stats["thread_restarts"] == 3 and stats["resyncs"] == 0
    restarts = [r for r in caplog.records if "reopening its sockets" in r.getMessage()]
    assert len(restarts) == 1  # logged once, counted always
