"""A publisher of the engines' KV-event protocol, for tests, benchmarks and simulators.

It speaks the protocol of SGLang's and vLLM's ``ZmqEventPublisher`` (see
:mod:`contextpilot_integrations.sync.subscriber`): PUB frames ``(topic, seq as 8 bytes
big-endian, msgpack batch)`` with seq counting from 0, and a ROUTER replay socket answering
``(b"", start_seq)`` with the buffered messages from ``start_seq`` and the end marker. It can
encode batches in either wire shape, and inject faults: a message kept in the replay buffer
but not sent (a drop), raw frames (malformed input). It is written from the protocol
description, not from the engines' code, and is no substitute for testing against the real
publisher (the ``sglang`` test tier does that).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Sequence
from typing import Literal, NamedTuple

import zmq

from contextpilot_integrations.sync.kv_events import (
    KVEventBatch,
    encode_mapped,
    encode_positional,
)
from contextpilot_integrations.sync.replay_client import END_OF_REPLAY

logger = logging.getLogger(__name__)

WireShape = Literal["map", "positional"]


class _Sequenced(NamedTuple):
    """A message of the sequence: kept for replay, sent unless ``drop``."""

    seq: int
    payload: bytes
    drop: bool


class _RawFrames(NamedTuple):
    """Frames sent as they are, outside the sequence."""

    frames: tuple[bytes, ...]


_Outgoing = _Sequenced | _RawFrames | threading.Event | None
"""What the publisher thread sends, in order: a message, raw frames, a flush marker (set once
everything before it is sent), or None (stop)."""


class KVEventPublisher:
    """PUB + ROUTER replay publisher on a background thread.

    Args:
        endpoint: where the PUB socket binds, e.g. ``tcp://127.0.0.1:5557`` or
            ``tcp://127.0.0.1:*`` (any free port; see :attr:`endpoint` after :meth:`start`).
        replay_endpoint: where the ROUTER binds; None: no replay.
        topic: the topic frame.
        shape: wire shape of the events, ``"map"`` (SGLang 0.5.20+) or ``"positional"``
            (SGLang <= 0.5.18).
        buffer_steps: messages kept for replay.
        first_seq: the first sequence number (0 for a fresh engine process).
        replay_topic_frame: replies carry the topic frame as SGLang 0.5.2x does
            (``(topic, seq, payload)``); False: ``(seq, payload)`` as SGLang <= 0.5.18 and vLLM.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        shape: WireShape = "map",
        buffer_steps: int = 10_000,
        first_seq: int = 0,
        replay_topic_frame: bool = True,
    ) -> None:
        if shape not in ("map", "positional"):
            raise ValueError(f"shape must be 'map' or 'positional', got {shape!r}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._encode = encode_mapped if shape == "map" else encode_positional
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = first_seq
        self._replay_prefix = (self._topic,) if replay_topic_frame else ()
        self._seq_lock = threading.Lock()
        self._outbox: queue.Queue[_Outgoing] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._idle = threading.Event()
        self.sent = 0
        self.dropped = 0

    def start(self) -> KVEventPublisher:
        """Bind the sockets and start the thread; returns self.

        Raises:
            zmq.ZMQError: an endpoint cannot be bound (e.g. the port is taken).
        """
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def stop(self) -> None:
        """Send what is queued, then close the sockets (idempotent)."""
        if self._thread is None:
            return
        self._outbox.put(None)
        self._thread.join()
        self._thread = None

    def __enter__(self) -> KVEventPublisher:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def publish(self, batch: KVEventBatch, *, drop: bool = False) -> int:
        """Queue ``batch``; returns its sequence number. ``drop``: buffer it for replay but do
        not send it (a message lost on the way)."""
        return self.publish_payload(self._encode(batch), drop=drop)

    def publish_payload(self, payload: bytes, *, drop: bool = False) -> int:
        """Queue an already encoded (possibly malformed) payload under the next seq."""
        with self._seq_lock:
            seq = self._next_seq
            self._next_seq += 1
            self._outbox.put(_Sequenced(seq, payload, drop))
        return seq

    def send_raw_frames(self, frames: Sequence[bytes]) -> None:
        """Queue frames sent as they are, outside the sequence (malformed-input tests)."""
        self._outbox.put(_RawFrames(tuple(frames)))

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until everything queued so far has been sent.

        Raises:
            TimeoutError: not sent within ``timeout_s``.
        """
        marker = threading.Event()
        self._outbox.put(marker)
        if not marker.wait(timeout_s):
            raise TimeoutError(f"publisher did not flush within {timeout_s} s")

    def _run(self) -> None:
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 1_000_000)
        router = None
        try:
            pub.bind(self.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.replay_endpoint is not None:
                router = context.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(self.replay_endpoint)
                self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as exc:
            self._error = exc
            pub.close()
            if router is not None:
                router.close()
            context.term()
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                if router is not None and router.poll(0):
                    self._serve_replay(router)
                items: list[_Outgoing] = []
                try:
                    items.append(self._outbox.get(timeout=0.001))
                    while True:  # drain what is queued: one replay poll per burst
                        items.append(self._outbox.get_nowait())
                except queue.Empty:
                    pass
                if items and not self._send(pub, items):
                    break
        finally:
            pub.close()
            if router is not None:
                router.close()
            context.term()

    def _send(self, pub: zmq.Socket, items: list[_Outgoing]) -> bool:
        """Send queued items in order; False once the stop marker is reached."""
        for item in items:
            if item is None:
                return False
            if isinstance(item, threading.Event):
                item.set()
            elif isinstance(item, _RawFrames):
                pub.send_multipart(item.frames)
            else:
                self._buffer.append((item.seq, item.payload))
                if item.drop:
                    self.dropped += 1
                else:
                    pub.send_multipart((self._topic, item.seq.to_bytes(8, "big"), item.payload))
                    self.sent += 1
        return True

    def _serve_replay(self, router: zmq.Socket) -> None:
        frames = router.recv_multipart()
        if len(frames) != 3:
            logger.warning("ignoring a replay request of %d frames", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        prefix = self._replay_prefix
        for seq, payload in self._buffer:
            if seq >= start:
                router.send_multipart((client, b"", *prefix, seq.to_bytes(8, "big"), payload))
        router.send_multipart((client, b"", *(b"" for _ in prefix), END_OF_REPLAY, b""))
