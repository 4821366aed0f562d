"""The client side of the engines' KV-event replay socket (``replay_endpoint``).

Protocol (SGLang ``ZmqEventPublisher`` in ``sglang/srt/disaggregation/kv_events.py``, the same
in vLLM ``vllm/distributed/kv_events.py``; docs/DESIGN.md, "SGLang KV events"): a ROUTER
socket, one per data-parallel rank (the port offset by the rank). A request
``(b"", start_seq as 8 bytes big-endian)`` is answered with every buffered message whose
sequence number is at least ``start_seq``, then an end marker whose sequence frame is -1
(8 signed bytes, :data:`END_OF_REPLAY`). Two reply forms exist and both are read:

- ``(b"", seq, payload)``, end ``(b"", END, b"")``: SGLang <= 0.5.18 and vLLM;
- ``(b"", topic, seq, payload)``, end ``(b"", b"", END, b"")``: SGLang 0.5.2x.

The publisher keeps the last ``buffer_steps`` batches (10,000 by default).

Public API: :class:`ReplayClient`, :data:`END_OF_REPLAY`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

__all__ = ["END_OF_REPLAY", "ReplayClient"]

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame of the replay end marker."""


class ReplayClient:
    """Asks one rank's replay socket for buffered batches (a DEALER socket, made on demand).

    Args:
        context: the ZMQ context of the thread that uses the client (ZMQ sockets are not
            thread-safe: one client, one thread).
        endpoint: the rank's replay endpoint.
        timeout_s: how long the socket may stay silent (before its first answer or between
            two) before a request counts as failed.
        rank: the data-parallel rank, for log messages.
        on_malformed: called with a description of each reply that has neither form (the reply
            is skipped).
        max_message_bytes: frames larger than this are refused by the socket (ZMQ's
            ``MAXMSGSIZE``: the request then fails); None: no limit.
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        *,
        timeout_s: float,
        rank: int = 0,
        on_malformed: Callable[[str], object] | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self._context = context
        self._rank = rank
        self._on_malformed = on_malformed
        self._socket: zmq.Socket | None = None

    def request(
        self, start: int, *, timeout_s: float | None = None, quiet: bool = False
    ) -> dict[int, bytes] | None:
        """The buffered batches from sequence number ``start`` on, as ``{seq: payload}``.

        Args:
            start: the first sequence number wanted.
            timeout_s: the inactivity timeout for this request (default: the client's).
            quiet: log a failure at debug level (an idle probe of an engine that is down).

        Returns:
            the batches (possibly none, or starting after ``start`` when the buffer no longer
            holds it), or None when the socket failed or did not finish the answer in time.
            After a failure the socket is closed, so that a late answer is never read as the
            answer to the next request.
        """
        socket = self._socket
        if socket is None:
            socket = self._socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDTIMEO, 0)
            if self._max_message_bytes is not None:
                socket.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            socket.connect(self.endpoint)
        # An inactivity timeout: a long replay (up to the publisher's whole buffer) is fine as
        # long as frames keep coming.
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        batches: dict[int, bytes] = {}
        try:
            socket.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not socket.poll(remaining_ms):
                    raise TimeoutError(f"no end marker within {timeout_s} s")
                frames = socket.recv_multipart()
                deadline = time.monotonic() + timeout_s
                if frames and frames[0] == b"":
                    frames = frames[1:]
                # (seq, payload) or (topic, seq, payload): see the module docstring.
                if len(frames) not in (2, 3) or len(frames[-2]) != 8:
                    if self._on_malformed is not None:
                        self._on_malformed(f"replay reply of {len(frames)} frames")
                    continue
                seq_frame, payload = frames[-2], frames[-1]
                if seq_frame == END_OF_REPLAY:
                    return batches
                batches[int.from_bytes(seq_frame, "big")] = payload
        except (TimeoutError, zmq.ZMQError) as exc:
            level = logging.DEBUG if quiet else logging.WARNING
            logger.log(
                level, "KV events rank %d: replay from %d failed: %s", self._rank, start, exc
            )
            self.close()
            return None

    def close(self) -> None:
        """Close the socket (idempotent; the next request opens a new one)."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
