"""A subscriber to an engine's KV-cache event stream (SGLang and vLLM ``--kv-events-config``).

Protocol (SGLang ``ZmqEventPublisher`` in ``sglang/srt/disaggregation/kv_events.py``, the same
in vLLM ``vllm/distributed/kv_events.py``; docs/DESIGN.md, "SGLang KV events"): a PUB socket
per data-parallel rank, the port offset by the rank (``inproc`` endpoints get a ``_dp<rank>``
suffix). Each message has three frames: topic, sequence number (8 bytes, big-endian, counting
from 0 per publisher process), msgpack batch. An optional ROUTER replay socket per rank
returns buffered batches (:mod:`~contextpilot_integrations.sync.replay_client`).

:class:`KVEventSubscriber` owns the thread and the sockets (a SUB socket and a socket monitor
per rank, polled together). Each message goes to the rank's
:class:`~contextpilot_integrations.sync.rank_stream.RankStream` (the sequence rules), which
hands batches back in order, to be decoded (:mod:`~contextpilot_integrations.sync.kv_events`)
and passed to ``on_batch``; ``on_batch`` and ``on_resync`` run on the subscriber's thread.

Errors: a malformed message (wrong frame count, bad sequence frame, undecodable payload) is
logged, counted and skipped; a frame over
:data:`~contextpilot_integrations.sync.kv_events.MAX_PAYLOAD_BYTES` is refused by the socket
(ZMQ's ``MAXMSGSIZE``: the peer is disconnected, then reconnects); a handler exception is logged
and counted (docs/DESIGN.md, "Never break a request"). Any unexpected exception closes the
sockets, is counted (``thread_restarts``) and logged, and the thread opens new sockets after a
pause (0.1 s, doubling to 5 s while it keeps failing) and goes on from its sequence state: only
:meth:`KVEventSubscriber.stop` ends it. Connecting before the engine binds is fine (ZMQ
retries); messages published before a subscription reaches the publisher are repaired from the
replay socket by the first-message rule.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from contextpilot_integrations.sync.kv_events import (
    MAX_PAYLOAD_BYTES,
    KVEventBatch,
    KVEventDecoder,
    MalformedEventBatchError,
)
from contextpilot_integrations.sync.rank_stream import RankStream
from contextpilot_integrations.sync.replay_client import ReplayClient

__all__ = ["BatchHandler", "KVEventSubscriber", "ResyncHandler", "rank_endpoint"]

logger = logging.getLogger(__name__)

_RESTART_PAUSE_S = 0.1
_MAX_RESTART_PAUSE_S = 5.0
_HEALTHY_RUN_S = 60.0

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


class _RankSockets:
    """The endpoints and sockets of one rank (the sockets exist while the thread runs)."""

    __slots__ = ("endpoint", "replay_endpoint", "sub", "monitor", "connected")

    def __init__(self, endpoint: str, replay_endpoint: str | None) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.sub: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.connected = False  # read for stats from other threads


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
            batches (see :mod:`~contextpilot_integrations.sync.rank_stream`); None disables
            probing.
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
        self._sockets = [
            _RankSockets(
                rank_endpoint(endpoint, rank, keep_host=bind),
                rank_endpoint(replay_endpoint, rank) if replay_endpoint else None,
            )
            for rank in range(dp_size)
        ]
        self._streams = [
            RankStream(
                rank,
                deliver=functools.partial(self._deliver, rank),
                resync=functools.partial(self._resync, rank),
                replay_attempts=replay_attempts,
                idle_probe_s=idle_probe_interval_s,
            )
            for rank in range(dp_size)
        ]
        self._topic = topic.encode("utf-8")
        self._on_batch = on_batch
        self._on_resync = on_resync
        self._replay_timeout_s = replay_timeout_s
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._decoder = KVEventDecoder()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._counters = {
            "received": 0,
            "applied": 0,
            "resyncs": 0,
            "connects": 0,
            "disconnects": 0,
            "malformed": 0,
            "handler_errors": 0,
            "thread_restarts": 0,
        }

    # ----------------------------------------------------------------------------------------
    # Public API
    # ----------------------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """The PUB endpoint of each rank, in rank order."""
        return [sockets.endpoint for sockets in self._sockets]

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
        """Counters (received, applied, replayed, gaps, repaired, probes, resyncs, restarts
        (of the publisher), bad_sequence (frames dropped for a sequence number that did not fit:
        :mod:`~contextpilot_integrations.sync.rank_stream`), connects, disconnects, malformed
        (frames), malformed_events and unknown_events (events skipped inside decoded batches),
        handler_errors, thread_restarts (of this subscriber's thread, after an unexpected
        error)), and per rank ``expected_seq``, ``joined`` (the first batch and the replay of
        what preceded it are applied: the mirror reflects the engine) and ``connected`` (SUB
        socket connected now).
        """
        out: dict[str, Any] = dict(self._counters)
        for stream in self._streams:
            for name, count in stream.counters.items():
                out[name] = out.get(name, 0) + count
        out["unknown_events"] = self._decoder.unknown_events
        out["malformed_events"] = self._decoder.malformed_events
        out["expected_seq"] = [stream.expected for stream in self._streams]
        out["joined"] = [stream.joined for stream in self._streams]
        out["connected"] = [sockets.connected for sockets in self._sockets]
        return out

    # ----------------------------------------------------------------------------------------
    # Thread
    # ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        """Open the sockets and follow the streams until :meth:`stop`; after an unexpected
        error, open them again (see the module docstring). The first opening's error is
        :meth:`start`'s to raise."""
        pause = _RESTART_PAUSE_S
        first = True
        while True:
            context = zmq.Context()
            try:
                poller = self._open(context)
            except BaseException as exc:
                self._close(context)
                if first:  # surfaced by start()
                    self._start_error = exc
                    self._ready.set()
                    return
                if not isinstance(exc, Exception):
                    raise
                self._restarting(exc)
            else:
                if first:
                    first = False
                    self._ready.set()
                followed_since = time.monotonic()
                try:
                    self._follow(poller)
                    return  # stopped
                except Exception as exc:
                    self._restarting(exc)
                finally:
                    self._close(context)
                if time.monotonic() - followed_since > _HEALTHY_RUN_S:
                    pause = _RESTART_PAUSE_S  # an isolated failure: no long pause
            if self._stop.wait(pause):
                return
            pause = min(2 * pause, _MAX_RESTART_PAUSE_S)

    def _open(self, context: zmq.Context) -> zmq.Poller:
        """Create, connect (or bind) and register every rank's sockets."""
        poller = zmq.Poller()
        for sockets in self._sockets:
            sub = sockets.sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            # ZMQ's default of 1,000 queued messages drops silently under a burst; the
            # engines' PUB side queues 100,000 (SGLang and vLLM ``hwm``).
            sub.setsockopt(zmq.RCVHWM, 100_000)
            # A frame larger than the decoder takes is refused before it is allocated.
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)
            sockets.monitor = sub.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED
            )
            if self._bind:
                sub.bind(sockets.endpoint)
            else:
                sub.connect(sockets.endpoint)
            poller.register(sub, zmq.POLLIN)
            poller.register(sockets.monitor, zmq.POLLIN)
        for sockets, stream in zip(self._sockets, self._streams, strict=True):
            if sockets.replay_endpoint is not None:
                stream.replay = ReplayClient(
                    context,
                    sockets.replay_endpoint,
                    timeout_s=self._replay_timeout_s,
                    rank=stream.rank,
                    on_malformed=functools.partial(self._count_malformed, stream.rank),
                    max_message_bytes=MAX_PAYLOAD_BYTES,
                )
            stream.started()
        return poller

    def _follow(self, poller: zmq.Poller) -> None:
        """The loop: read every rank's messages in order until :meth:`stop`."""
        while not self._stop.is_set():
            ready = dict(poller.poll(self._poll_ms))
            for sockets, stream in zip(self._sockets, self._streams, strict=True):
                if sockets.monitor in ready:
                    self._on_monitor(sockets, stream)
                if sockets.sub in ready:
                    self._drain(sockets, stream)
                    stream.heard()
                else:
                    stream.tick()

    def _restarting(self, exc: Exception) -> None:
        self._counters["thread_restarts"] += 1
        if self._counters["thread_restarts"] == 1:
            logger.warning(
                "KV-event subscriber failed (%s: %s); reopening its sockets (later failures "
                "are logged at debug level and counted as thread_restarts)",
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
        else:
            logger.debug("KV-event subscriber failed again; reopening", exc_info=exc)

    def _close(self, context: zmq.Context) -> None:
        for sockets, stream in zip(self._sockets, self._streams, strict=True):
            try:
                if sockets.monitor is not None and sockets.sub is not None:
                    sockets.sub.disable_monitor()
                for socket in (sockets.monitor, sockets.sub):
                    if socket is not None:
                        socket.close(linger=0)
                if stream.replay is not None:
                    stream.replay.close()
            except zmq.ZMQError:
                logger.debug("closing the sockets of rank %d failed", stream.rank, exc_info=True)
            sockets.sub = sockets.monitor = None
            sockets.connected = False
            stream.replay = None
        context.term()

    def _on_monitor(self, sockets: _RankSockets, stream: RankStream) -> None:
        assert sockets.monitor is not None
        while True:
            try:
                event = recv_monitor_message(sockets.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self._counters["connects"] += 1
                sockets.connected = True
                stream.connected()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._counters["disconnects"] += 1
                sockets.connected = False
                logger.warning(
                    "KV events rank %d: disconnected from %s; requests go on, cache state "
                    "follows again once the engine is back",
                    stream.rank,
                    sockets.endpoint,
                )

    def _drain(self, sockets: _RankSockets, stream: RankStream) -> None:
        assert sockets.sub is not None
        while not self._stop.is_set():
            try:
                frames = sockets.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._counters["received"] += 1
            seq = _sequence_of(frames)
            if seq is None:
                self._count_malformed(stream.rank, f"{len(frames)} frames / bad sequence frame")
            else:
                stream.on_message(seq, frames[2])

    # ----------------------------------------------------------------------------------------
    # Handlers (called by the rank streams, on the thread)
    # ----------------------------------------------------------------------------------------

    def _deliver(self, rank: int, seq: int, payload: bytes) -> None:
        try:
            batch = self._decoder.decode(payload)
        except MalformedEventBatchError as exc:
            self._count_malformed(rank, f"seq {seq}: {exc}")
            return
        except Exception as exc:  # never let one payload stop the stream (nor replay it forever)
            self._count_malformed(rank, f"seq {seq}: {type(exc).__name__}: {exc}")
            return
        self._counters["applied"] += 1
        if self._on_batch is None:
            return
        try:
            self._on_batch(rank, batch)
        except Exception:
            self._counters["handler_errors"] += 1
            logger.exception("on_batch failed for rank %d seq %d", rank, seq)

    def _resync(self, rank: int) -> None:
        self._counters["resyncs"] += 1
        if self._on_resync is None:
            return
        try:
            self._on_resync(rank)
        except Exception:
            self._counters["handler_errors"] += 1
            logger.exception("on_resync(%d) failed", rank)

    def _count_malformed(self, rank: int, what: str) -> None:
        self._counters["malformed"] += 1
        # The first few at warning level, the rest at debug: a bad peer must not flood logs.
        level = logging.WARNING if self._counters["malformed"] <= 10 else logging.DEBUG
        logger.log(level, "KV events rank %d: skipping malformed message (%s)", rank, what)


def _sequence_of(frames: Sequence[bytes]) -> int | None:
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big")
