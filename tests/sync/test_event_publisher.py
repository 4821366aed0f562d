"""KVEventPublisher, the protocol publisher the tests and benchmarks drive: what it sends and
what its replay socket answers, read with plain ZMQ sockets."""

from __future__ import annotations

import time

import zmq

from contextpilot_integrations.sync.event_publisher import KVEventPublisher
from contextpilot_integrations.sync.kv_events import KVEventBatch, KVEventDecoder
from contextpilot_integrations.sync.replay_client import END_OF_REPLAY


def replay_from(endpoint: str, start: int) -> list[list[bytes]]:
    context: zmq.Context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        replies = []
        while dealer.poll(5_000):
            replies.append(dealer.recv_multipart())
            if replies[-1][-2] == END_OF_REPLAY:
                return replies
        raise AssertionError(f"no end of replay: {replies}")
    finally:
        dealer.close()


def test_raw_frames_of_any_sequence_type_are_sent_as_they_are() -> None:
    # A tuple of three frames must not be taken for a queued (seq, payload, drop) message: it
    # would be kept for replay with seq b"" and never sent, and the next replay request would
    # kill the publisher's thread (bytes >= int).
    context: zmq.Context = zmq.Context.instance()
    with KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as publisher:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        try:
            deadline = time.monotonic() + 10
            while not sub.poll(20):  # PUB/SUB drops what precedes the subscription
                assert time.monotonic() < deadline, "never subscribed"
                publisher.send_raw_frames([b"probe"])
            while sub.poll(100):
                sub.recv_multipart()
            publisher.send_raw_frames((b"", b"\x00" * 8, b"raw"))
            seq = publisher.publish(KVEventBatch(ts=1.0, events=[]))
            publisher.flush()
            assert sub.recv_multipart() == [b"", b"\x00" * 8, b"raw"]
            topic, seq_frame, payload = sub.recv_multipart()
        finally:
            sub.close()
        assert int.from_bytes(seq_frame, "big") == seq
        assert publisher.replay_endpoint is not None
        replies = replay_from(publisher.replay_endpoint, 0)  # the thread is still serving
        assert [r[-2] for r in replies] == [seq.to_bytes(8, "big"), END_OF_REPLAY]
        assert KVEventDecoder().decode(replies[0][-1]).ts == 1.0
        assert publisher.sent == 1 and publisher.dropped == 0
