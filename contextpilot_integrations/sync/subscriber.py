"""A subscriber to an engine's KV-cache event stream (SGLang and vLLM ``--kv-events-config``).

Protocol (SGLang ``ZmqEventPublisher`` in ``sglang/srt/disaggregation/kv_events.py``, the same
in vLLM ``vllm/distributed/kv_events.py``; ``shared/notes/engine-kv-events.md``):

- PUB socket, one per data-parallel rank, the port offset by the rank (``inproc`` endpoints
  get a ``_dp<rank>`` suffix). Each message has three frames: topic, sequence number (8 bytes,
  big-endian, counting from 0 per publisher process), msgpack batch.
- Optional ROUTER replay socket (same rank offset): a request ``(b"", start_seq as 8 bytes)``
  is answered with every buffered message whose sequence number is at least ``start_seq``,
  then an end marker whose sequence frame is -1 (8 signed bytes). Two reply forms exist and
  both are read: ``(b"", seq, payload)`` / end ``(b"", END, b"")`` (SGLang <= 0.5.18, vLLM)
  and ``(b"", topic, seq, payload)`` / end ``(b"", b"", END, b"")`` (SGLang 0.5.2x). The
  publisher keeps the last ``buffer_steps`` batches (10,000 by default).

Sequence tracking, per rank:

- first message (or first after a restart) with seq > 0: the batches before it are fetched
  from the replay socket starting at 0; when that fails the rank is resynchronised;
- seq > expected: a gap; the missing range is fetched from the replay socket and applied in
  order before the live batch (``repaired``). The replay returns everything buffered from the
  missing seq on, so the batches after the live one are applied at once too, and their live
  copies (same seq, same payload) skipped: one replay covers every gap up to the publisher's
  head. When replay is not configured, times out or no longer holds the whole range,
  ``on_resync(rank)`` is called (the receiver forgets what it believes cached on that rank),
  then the contiguous tail the replay did return is applied;
- seq < expected (and not the live copy of a batch a replay already applied): the publisher
  restarted (a new engine process, empty cache): ``on_resync`` then the first-message rule;
- after the SUB socket reconnects (a ZMQ socket monitor reports it), the new stream may have
  passed the old sequence number already, which seq alone cannot tell from a gap. So the
  replay socket is asked for batch ``expected - 1``: the same publisher returns the very
  payload last applied; anything else is a restart, handled as above;
- idle: when a rank has been silent for ``idle_probe_interval_s``, the replay socket is asked
  for anything from the expected seq on. This finds a lost *last* message (no later message
  would reveal the gap) and the batches a subscriber missed by joining after the engine went
  quiet. While the replay socket does not answer (engine down), probes back off to 30 s.

Malformed messages (wrong frame count, bad sequence frame, undecodable payload) are logged,
counted and skipped; their sequence number, when readable, still counts as received. A
handler exception is logged and counted; the stream goes on (DESIGN.md invariant 5).

Connecting before the engine binds is fine: ZMQ connects in the background and retries.
Note that ZMQ PUB/SUB drops messages published before a subscription reaches the publisher;
the first-message rule repairs that from the replay socket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from contextpilot_integrations.sync.kv_events import (
    KVEventBatch,
    KVEventDecoder,
    MalformedEventBatchError,
)

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame of the replay end marker."""

BatchHandler = Callable[[int, KVEventBatch], object]
"""``on_batch(rank, batch)``: called in sequence order on the subscriber's thread."""

ResyncHandler = Callable[[int], object]
"""``on_resync(rank)``: the stream of ``rank`` lost continuity; forget that rank's cache."""


def rank_endpoint(endpoint: str, rank: int, *, keep_host: bool = False) -> str:
    """The endpoint of data-parallel ``rank``, as the engines derive it from the configured one.

    ``tcp://host:P`` -> ``tcp://host:P+rank``; ``inproc://name`` -> ``inproc://name_dp<rank>``;
    rank 0 keeps the endpoint. A wildcard bind host (``*``, ``0.0.0.0``) becomes ``127.0.0.1``
    so that the engine's own config string can be passed as is (``keep_host``: no rewrite).

    Raises:
        ValueError: ``rank`` > 0 with an endpoint that is neither tcp nor inproc (the engines
            reject those too), or a tcp endpoint without a numeric port.
    """
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"endpoint must be tcp://host:port, got {endpoint!r}")
        if keep_host:
            pass
        elif host in ("*", "0.0.0.0"):
            host = "127.0.0.1"
        elif host in ("[::]", "::"):
            host = "[::1]"
        return f"tcp://{host}:{int(port) + rank}"
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    raise ValueError(
        f"endpoint {endpoint!r} cannot be offset for dp rank {rank}: use tcp:// or inproc://"
    )


class _RankStream:
    """Sequence state and sockets of one rank (touched only by the subscriber thread, except
    ``expected``/``last_seq``, which are plain ints read for stats)."""

    def __init__(self, rank: int, endpoint: str, replay_endpoint: str | None) -> None:
        self.rank = rank
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.expected: int | None = None
        self.joined = False  # the first batch received and the replay before it applied
        self.sub: zmq.Socket | None = None
        self.replay: zmq.Socket | None = None
        self.next_probe = 0.0
        self.probe_backoff_s = 0.0
        self.monitor: zmq.Socket | None = None
        self.connected = False
        self.suspect = False  # reconnected: the publisher may be a new process
        self.last_payload: bytes | None = None
        # Batches applied from a replay that the SUB socket may still deliver: seq -> payload.
        self.duplicates: dict[int, bytes] = {}


class KVEventSubscriber:
    """Follows an engine's KV-cache events on a background thread.

    Args:
        endpoint: the engine's event endpoint (its ``--kv-events-config`` ``endpoint``), e.g.
            ``tcp://127.0.0.1:5557``; the endpoint of rank r is derived by
            :func:`rank_endpoint`.
        replay_endpoint: the engine's ``replay_endpoint``; None disables gap repair (gaps
            then resynchronise).
        topic: the publisher's topic (SGLang default ``""``, vLLM ``"kv-events"``); a prefix
            filter, as ZMQ subscriptions are.
        on_batch: ``on_batch(rank, batch)`` for each batch, in sequence order per rank, e.g.
            ``CacheMirror.apply_batch``.
        on_resync: ``on_resync(rank)`` when continuity is lost, e.g. ``CacheMirror.resync``.
        dp_size: number of data-parallel ranks to follow (ranks 0 .. dp_size - 1).
        replay_timeout_s: how long the replay socket may stay silent (before its first answer
            or between two) before the request counts as failed.
        replay_attempts: replay requests made for one gap before resynchronising.
        poll_interval_s: longest wait between checks of the stop flag (bounds ``stop()``).
        idle_probe_interval_s: silence after which the replay socket is probed for missed
            batches (see the module docstring); None disables probing.
        bind: bind the SUB sockets instead of connecting, for a publisher that connects (SGLang
            <= 0.5.18 and vLLM connect on a ``tcp://`` endpoint with a concrete host; a
            connecting subscriber then receives nothing, without an error). The endpoint is
            used as given (no wildcard rewrite).

    Raises:
        ValueError: ``dp_size`` < 1, non-positive timeouts, or endpoints that cannot be
            offset per rank.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        on_batch: BatchHandler | None = None,
        on_resync: ResyncHandler | None = None,
        dp_size: int = 1,
        replay_timeout_s: float = 2.0,
        replay_attempts: int = 3,
        poll_interval_s: float = 0.1,
        idle_probe_interval_s: float | None = 1.0,
        bind: bool = False,
    ) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be at least 1, got {dp_size!r}")
        if replay_timeout_s <= 0:
            raise ValueError(f"replay_timeout_s must be positive, got {replay_timeout_s!r}")
        if replay_attempts < 1:
            raise ValueError(f"replay_attempts must be at least 1, got {replay_attempts!r}")
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive, got {poll_interval_s!r}")
        if idle_probe_interval_s is not None and idle_probe_interval_s <= 0:
            raise ValueError(
                f"idle_probe_interval_s must be positive or None, got {idle_probe_interval_s!r}"
            )
        self._bind = bind
        self._streams = [
            _RankStream(
                rank,
                rank_endpoint(endpoint, rank, keep_host=bind),
                rank_endpoint(replay_endpoint, rank) if replay_endpoint else None,
            )
            for rank in range(dp_size)
        ]
        self._topic = topic.encode("utf-8")
        self._on_batch = on_batch
        self._on_resync = on_resync
        self._replay_timeout_s = replay_timeout_s
        self._replay_attempts = replay_attempts
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._idle_probe_s = idle_probe_interval_s
        self._decoder = KVEventDecoder()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._context: zmq.Context | None = None
        self._counters = {
            "received": 0,
            "applied": 0,
            "replayed": 0,
            "gaps": 0,
            "repaired": 0,
            "probes": 0,
            "resyncs": 0,
            "restarts": 0,
            "connects": 0,
            "disconnects": 0,
            "malformed": 0,
            "handler_errors": 0,
        }

    # ----------------------------------------------------------------------------------------
    # Public API
    # ----------------------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """The PUB endpoint of each rank, in rank order."""
        return [stream.endpoint for stream in self._streams]

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> KVEventSubscriber:
        """Connect (in the background; the engine need not be up) and start the thread.

        Returns:
            self.

        Raises:
            RuntimeError: already running.
            zmq.ZMQError: an endpoint is invalid.
        """
        if self.running:
            raise RuntimeError("KVEventSubscriber is already running")
        self._stop.clear()
        self._ready.clear()
        self._start_error = None
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._thread = None
            raise self._start_error
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close the sockets (idempotent). Sequence state is kept, so a
        later :meth:`start` repairs whatever was published meanwhile."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("KV-event subscriber thread did not stop within %.1f s", timeout_s)
        self._thread = None

    def __enter__(self) -> KVEventSubscriber:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def stats(self) -> dict[str, Any]:
        """Counters (received, applied, replayed, gaps, repaired, probes, resyncs, restarts,
        connects, disconnects, malformed, handler_errors, unknown_events), and per rank
        ``expected_seq``, ``joined`` (the first batch and the replay of what preceded it are
        applied: the mirror reflects the engine) and ``connected`` (SUB socket connected now).
        """
        out: dict[str, Any] = dict(self._counters)
        out["unknown_events"] = self._decoder.unknown_events
        out["expected_seq"] = [stream.expected for stream in self._streams]
        out["joined"] = [stream.joined for stream in self._streams]
        out["connected"] = [stream.connected for stream in self._streams]
        return out

    # ----------------------------------------------------------------------------------------
    # Thread
    # ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        context = zmq.Context()
        poller = zmq.Poller()
        try:
            for stream in self._streams:
                stream.sub = context.socket(zmq.SUB)
                stream.sub.setsockopt(zmq.LINGER, 0)
                stream.sub.setsockopt(zmq.SUBSCRIBE, self._topic)
                # ZMQ's default of 1,000 queued messages drops silently under a burst; the
                # engines' PUB side queues 100,000 (SGLang and vLLM ``hwm``).
                stream.sub.setsockopt(zmq.RCVHWM, 100_000)
                stream.monitor = stream.sub.get_monitor_socket(
                    zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED
                )
                if self._bind:
                    stream.sub.bind(stream.endpoint)
                else:
                    stream.sub.connect(stream.endpoint)
                poller.register(stream.sub, zmq.POLLIN)
                poller.register(stream.monitor, zmq.POLLIN)
        except BaseException as exc:  # surfaced by start()
            self._start_error = exc
            self._close(context)
            self._ready.set()
            return
        self._context = context
        self._ready.set()
        now = time.monotonic()
        for stream in self._streams:
            stream.next_probe = now + (self._idle_probe_s or 0.0)
            stream.probe_backoff_s = self._idle_probe_s or 0.0
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(self._poll_ms))
                for stream in self._streams:
                    if stream.monitor in ready:
                        self._on_monitor(stream)
                    if stream.sub in ready:
                        self._drain(stream)
                        stream.next_probe = time.monotonic() + stream.probe_backoff_s
                    elif self._probing(stream) and time.monotonic() >= stream.next_probe:
                        self._probe(stream)
        except Exception:
            logger.exception("KV-event subscriber thread failed; events are no longer followed")
        finally:
            self._close(context)
            self._context = None

    def _close(self, context: zmq.Context) -> None:
        for stream in self._streams:
            if stream.monitor is not None and stream.sub is not None:
                stream.sub.disable_monitor()
            for socket in (stream.monitor, stream.sub, stream.replay):
                if socket is not None:
                    socket.close(linger=0)
            stream.sub = stream.replay = stream.monitor = None
            stream.connected = False
        context.term()

    def _on_monitor(self, stream: _RankStream) -> None:
        assert stream.monitor is not None
        while True:
            try:
                event = recv_monitor_message(stream.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self._counters["connects"] += 1
                stream.connected = True
                if stream.expected is not None:
                    stream.suspect = True
                    # Probe soon: a restarted engine may have nothing more to publish.
                    stream.next_probe = time.monotonic() + 0.2
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._counters["disconnects"] += 1
                stream.connected = False
                logger.warning(
                    "KV events rank %d: disconnected from %s; requests go on, cache state "
                    "follows again once the engine is back",
                    stream.rank,
                    stream.endpoint,
                )

    def _drain(self, stream: _RankStream) -> None:
        assert stream.sub is not None
        while not self._stop.is_set():
            try:
                frames = stream.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._counters["received"] += 1
            self._on_message(stream, frames)

    def _on_message(self, stream: _RankStream, frames: list[bytes]) -> None:
        seq = _sequence_of(frames)
        if seq is None:
            self._count_malformed(stream, f"{len(frames)} frames / bad sequence frame")
            return
        payload = frames[2]
        if stream.suspect:
            self._check_same_publisher(stream)
        if stream.expected is not None and seq < stream.expected:
            if stream.duplicates.pop(seq, None) == payload:
                return  # already applied from a replay
            self._counters["restarts"] += 1
            logger.warning(
                "KV events rank %d: seq went back from %d to %d: publisher restarted",
                stream.rank,
                stream.expected,
                seq,
            )
            self._resync(stream)
            stream.expected = None
            stream.joined = False
        stream.duplicates.clear()
        if stream.expected is None:
            stream.expected = seq
            if seq > 0:  # batches 0 .. seq - 1 were missed
                self._counters["gaps"] += 1
                self._repair(stream, 0, seq)
        elif seq > stream.expected:
            self._counters["gaps"] += 1
            logger.info(
                "KV events rank %d: gap, expected seq %d, got %d; repairing",
                stream.rank,
                stream.expected,
                seq,
            )
            self._repair(stream, stream.expected, seq)
        if seq >= stream.expected:  # else the repair applied it from the replay
            self._apply(stream, seq, payload)
        stream.joined = True

    def _check_same_publisher(self, stream: _RankStream) -> None:
        """After a reconnect: compare the publisher's batch ``expected - 1`` with the payload
        last applied; on a mismatch the publisher restarted (resync, then join afresh)."""
        stream.suspect = False
        if stream.expected is None or stream.expected == 0 or stream.replay_endpoint is None:
            return
        last = stream.expected - 1
        replayed = self._request_replay(stream, last)
        if replayed is None:
            return  # cannot tell; the seq rules still apply
        if replayed.get(last) == stream.last_payload:
            # Same publisher: what it sent while we were away is in the same answer.
            if stream.expected in replayed:
                self._counters["repaired"] += 1
                self._apply_replayed(stream, replayed, stream.expected, live=last)
            return
        self._counters["restarts"] += 1
        logger.warning(
            "KV events rank %d: batch %d differs after reconnecting: publisher restarted",
            stream.rank,
            last,
        )
        self._resync(stream)
        stream.expected = None
        stream.joined = False
        stream.last_payload = None
        stream.duplicates.clear()

    def _repair(self, stream: _RankStream, start: int, end: int) -> None:
        """Fill batches ``start .. end - 1`` (``end``: the live batch in hand) from the replay
        socket; resync when they cannot all be had.

        The replay returns every buffered batch from ``start`` on, also those after ``end``
        that the SUB socket will deliver again: they are applied at once (one replay covers
        every gap up to the publisher's head) and their live copies are skipped.
        """
        replayed = None
        for _ in range(self._replay_attempts if stream.replay_endpoint else 0):
            # A resync drops everything believed cached: worth a retry on a busy machine.
            replayed = self._request_replay(stream, start)
            if replayed is not None:
                break
        replayed = replayed or {}
        run_start = end
        while run_start > start and run_start - 1 in replayed:
            run_start -= 1
        if run_start == start:
            self._counters["repaired"] += 1
        else:
            logger.warning(
                "KV events rank %d: batches %d..%d could not be replayed; resynchronising",
                stream.rank,
                start,
                run_start - 1,
            )
            self._resync(stream)
        # After a resync, what the replay returned up to the live batch is still a true
        # (partial) history, so it is applied too.
        self._apply_replayed(stream, replayed, run_start, live=end)

    def _probing(self, stream: _RankStream) -> bool:
        return self._idle_probe_s is not None and stream.replay_endpoint is not None

    def _probe(self, stream: _RankStream) -> None:
        """Ask the replay socket for batches from the expected seq after a silence."""
        assert self._idle_probe_s is not None
        self._counters["probes"] += 1
        if stream.suspect:
            self._check_same_publisher(stream)
        start = stream.expected or 0
        timeout_s = min(self._replay_timeout_s, 0.5)
        replayed = self._request_replay(stream, start, timeout_s=timeout_s, quiet=True)
        if replayed is None:  # engine down or not up yet: back off
            stream.probe_backoff_s = min(max(2 * stream.probe_backoff_s, 1.0), 30.0)
        else:
            stream.probe_backoff_s = self._idle_probe_s
        stream.next_probe = time.monotonic() + stream.probe_backoff_s
        newer = sorted(seq for seq in (replayed or {}) if seq >= start)
        if not newer or replayed is None:
            return
        self._counters["gaps"] += 1
        if newer[0] == start:
            self._counters["repaired"] += 1
        else:
            logger.warning(
                "KV events rank %d: batches from %d are gone from the replay buffer "
                "(it starts at %d); resynchronising",
                stream.rank,
                start,
                newer[0],
            )
            self._resync(stream)
        self._apply_replayed(stream, replayed, newer[0], live=newer[0] - 1)
        stream.joined = True

    def _apply_replayed(
        self, stream: _RankStream, replayed: dict[int, bytes], start: int, *, live: int
    ) -> None:
        """Apply the contiguous run of replayed batches from ``start``; remember those after
        ``live`` (the newest seq the SUB socket delivered) to skip their live copies."""
        seq = start
        while seq in replayed:
            self._counters["replayed"] += 1
            self._apply(stream, seq, replayed[seq])
            if seq > live:
                stream.duplicates[seq] = replayed[seq]
            seq += 1

    def _request_replay(
        self,
        stream: _RankStream,
        start: int,
        *,
        timeout_s: float | None = None,
        quiet: bool = False,
    ) -> dict[int, bytes] | None:
        """Ask the replay socket for batches from ``start``; None on timeout or error."""
        assert self._context is not None and stream.replay_endpoint is not None
        if stream.replay is None:
            stream.replay = self._context.socket(zmq.DEALER)
            stream.replay.setsockopt(zmq.LINGER, 0)
            stream.replay.setsockopt(zmq.SNDTIMEO, 0)
            stream.replay.connect(stream.replay_endpoint)
        socket = stream.replay
        # An inactivity timeout: a long replay (up to the publisher's whole buffer) is fine as
        # long as frames keep coming.
        timeout_s = self._replay_timeout_s if timeout_s is None else timeout_s
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
                    self._count_malformed(stream, f"replay reply of {len(frames)} frames")
                    continue
                seq_frame, payload = frames[-2], frames[-1]
                if seq_frame == END_OF_REPLAY:
                    return batches
                batches[int.from_bytes(seq_frame, "big")] = payload
        except (TimeoutError, zmq.ZMQError) as exc:
            level = logging.DEBUG if quiet else logging.WARNING
            logger.log(
                level, "KV events rank %d: replay from %d failed: %s", stream.rank, start, exc
            )
            # A late answer must not be read as the answer to the next request.
            socket.close(linger=0)
            stream.replay = None
            return None

    def _resync(self, stream: _RankStream) -> None:
        self._counters["resyncs"] += 1
        if self._on_resync is None:
            return
        try:
            self._on_resync(stream.rank)
        except Exception:
            self._counters["handler_errors"] += 1
            logger.exception("on_resync(%d) failed", stream.rank)

    def _apply(self, stream: _RankStream, seq: int, payload: bytes) -> None:
        stream.expected = seq + 1
        stream.last_payload = payload
        try:
            batch = self._decoder.decode(payload)
        except MalformedEventBatchError as exc:
            self._count_malformed(stream, f"seq {seq}: {exc}")
            return
        self._counters["applied"] += 1
        if self._on_batch is None:
            return
        try:
            self._on_batch(stream.rank, batch)
        except Exception:
            self._counters["handler_errors"] += 1
            logger.exception("on_batch failed for rank %d seq %d", stream.rank, seq)

    def _count_malformed(self, stream: _RankStream, what: str) -> None:
        self._counters["malformed"] += 1
        # The first few at warning level, the rest at debug: a bad peer must not flood logs.
        level = logging.WARNING if self._counters["malformed"] <= 10 else logging.DEBUG
        logger.log(level, "KV events rank %d: skipping malformed message (%s)", stream.rank, what)


def _sequence_of(frames: Sequence[bytes]) -> int | None:
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big")
