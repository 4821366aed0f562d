"""One data-parallel rank's KV-event stream kept continuous: sequence numbers, gap repair from
the replay socket, restart detection and resync.

Each published message carries a sequence number counting from 0 per publisher process. Per
rank:

- first message (or first after a restart) with seq > 0: the batches before it are fetched
  from the replay socket starting at 0; when that fails the rank is resynchronised;
- seq > expected: a gap; the missing range is fetched from the replay socket and applied in
  order before the live batch (``repaired``). The replay returns everything buffered from the
  missing seq on, so the batches after the live one are applied at once too, and their live
  copies (same seq, same payload) skipped: one replay covers every gap up to the publisher's
  head. When replay is not configured, times out or no longer holds the whole range, the rank
  is resynchronised (the receiver forgets what it believes cached there), then the contiguous
  tail the replay did return is applied;
- seq < expected (and not the live copy of a batch a replay already applied): the publisher
  restarted (a new engine process, empty cache): resync, then the first-message rule;
- after the SUB socket reconnects (a ZMQ socket monitor reports it), the new stream may have
  passed the old sequence number already, which seq alone cannot tell from a gap. So the
  replay socket is asked for batch ``expected - 1``: the same publisher returns the very
  payload last applied; anything else is a restart, handled as above;
- idle: when a rank has been silent for ``idle_probe_s``, the replay socket is asked for
  anything from the expected seq on. This finds a lost *last* message (no later message would
  reveal the gap) and the batches a subscriber missed by joining after the engine went quiet.
  While the replay socket does not answer (engine down), probes back off to 30 s.

:class:`RankStream` holds that state and applies those rules; the
:class:`~contextpilot_integrations.sync.subscriber.KVEventSubscriber` owns the sockets and the
thread, and hands each received message to :meth:`RankStream.on_message`.

Public API: :class:`RankStream`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from contextpilot_integrations.sync.replay_client import ReplayClient

__all__ = ["RankStream"]

logger = logging.getLogger(__name__)

_MAX_PROBE_BACKOFF_S = 30.0
_RECONNECT_PROBE_DELAY_S = 0.2
_PROBE_TIMEOUT_S = 0.5


class RankStream:
    """The sequence state of one rank's stream and the rules that keep it continuous.

    Args:
        rank: the data-parallel rank.
        deliver: ``deliver(seq, payload)`` applies one batch (decode it, hand it on); called in
            sequence order, each seq once.
        resync: ``resync()``: the stream lost continuity; forget what the rank caches.
        replay_attempts: replay requests made for one gap before resynchronising.
        idle_probe_s: silence after which the replay socket is probed; None: never.
        clock: monotonic seconds, for the probe schedule.

    Touched only by the subscriber's thread, except :attr:`expected`, :attr:`joined` and
    :attr:`counters` (plain values), read for stats. The sequence state outlives the thread:
    a subscriber started again repairs whatever was published meanwhile.
    """

    def __init__(
        self,
        rank: int,
        *,
        deliver: Callable[[int, bytes], None],
        resync: Callable[[], None],
        replay_attempts: int,
        idle_probe_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank = rank
        self.replay: ReplayClient | None = None
        """The rank's replay client while the subscriber runs (None: no replay configured)."""
        self.expected: int | None = None
        """The next sequence number expected (None: nothing received since the last join); it
        moves once the batch before it is delivered."""
        self.joined = False
        """The first batch and the replay of what preceded it are applied."""
        self.counters = {"replayed": 0, "gaps": 0, "repaired": 0, "probes": 0, "restarts": 0}
        self._deliver = deliver
        self._resync = resync
        self._replay_attempts = replay_attempts
        self._idle_probe_s = idle_probe_s
        self._clock = clock
        self._suspect = False  # reconnected: the publisher may be a new process
        self._last_payload: bytes | None = None
        # Batches applied from a replay that the SUB socket may still deliver: seq -> payload.
        self._duplicates: dict[int, bytes] = {}
        self._next_probe = 0.0
        self._probe_backoff_s = 0.0

    # ----------------------------------------------------------------------------------------
    # Public API: what the subscriber's thread saw
    # ----------------------------------------------------------------------------------------

    def started(self) -> None:
        """The subscriber's thread started: schedule the first probe."""
        self._probe_backoff_s = self._idle_probe_s or 0.0
        self._next_probe = self._clock() + self._probe_backoff_s

    def connected(self) -> None:
        """The SUB socket (re)connected: after a reconnect the publisher may be a new process,
        which the next message or a probe soon (a restarted engine may publish nothing more)
        checks."""
        if self.expected is not None:
            self._suspect = True
            self._next_probe = self._clock() + _RECONNECT_PROBE_DELAY_S

    def heard(self) -> None:
        """Messages arrived: the next probe waits for a silence again."""
        self._next_probe = self._clock() + self._probe_backoff_s

    def probe_due(self) -> bool:
        """Whether the rank has been silent long enough for :meth:`probe`."""
        if self._idle_probe_s is None or self.replay is None:
            return False
        return self._clock() >= self._next_probe

    def on_message(self, seq: int, payload: bytes) -> None:
        """A live message: apply it in order, repairing what precedes it first."""
        if self._suspect:
            self._check_same_publisher()
        if self.expected is not None and seq < self.expected:
            if self._duplicates.pop(seq, None) == payload:
                return  # already applied from a replay
            self.counters["restarts"] += 1
            logger.warning(
                "KV events rank %d: seq went back from %d to %d: publisher restarted",
                self.rank,
                self.expected,
                seq,
            )
            self._rejoin()
        self._duplicates.clear()
        if self.expected is None:
            self.expected = seq
            if seq > 0:  # batches 0 .. seq - 1 were missed
                self.counters["gaps"] += 1
                self._repair(0, seq)
        elif seq > self.expected:
            self.counters["gaps"] += 1
            logger.info(
                "KV events rank %d: gap, expected seq %d, got %d; repairing",
                self.rank,
                self.expected,
                seq,
            )
            self._repair(self.expected, seq)
        if seq >= self.expected:  # else the repair applied it from the replay
            self._apply(seq, payload)
        self.joined = True

    def probe(self) -> None:
        """Ask the replay socket for batches from the expected seq after a silence."""
        assert self.replay is not None and self._idle_probe_s is not None
        self.counters["probes"] += 1
        if self._suspect:
            self._check_same_publisher()
        start = self.expected or 0
        timeout_s = min(self.replay.timeout_s, _PROBE_TIMEOUT_S)
        replayed = self.replay.request(start, timeout_s=timeout_s, quiet=True)
        if replayed is None:  # engine down or not up yet: back off
            self._probe_backoff_s = min(max(2 * self._probe_backoff_s, 1.0), _MAX_PROBE_BACKOFF_S)
        else:
            self._probe_backoff_s = self._idle_probe_s
        self._next_probe = self._clock() + self._probe_backoff_s
        newer = sorted(seq for seq in (replayed or {}) if seq >= start)
        if not newer or replayed is None:
            return
        self.counters["gaps"] += 1
        if newer[0] == start:
            self.counters["repaired"] += 1
        else:
            logger.warning(
                "KV events rank %d: batches from %d are gone from the replay buffer "
                "(it starts at %d); resynchronising",
                self.rank,
                start,
                newer[0],
            )
            self._resync()
        self._apply_replayed(replayed, newer[0], live=newer[0] - 1)
        self.joined = True

    # ----------------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------------

    def _rejoin(self) -> None:
        """The publisher restarted: forget the rank's cache and join the new stream afresh."""
        self._resync()
        self.expected = None
        self.joined = False

    def _check_same_publisher(self) -> None:
        """After a reconnect: compare the publisher's batch ``expected - 1`` with the payload
        last applied; on a mismatch the publisher restarted (resync, then join afresh)."""
        self._suspect = False
        if self.expected is None or self.expected == 0 or self.replay is None:
            return
        last = self.expected - 1
        replayed = self.replay.request(last)
        if replayed is None:
            return  # cannot tell; the seq rules still apply
        if replayed.get(last) == self._last_payload:
            # Same publisher: what it sent while we were away is in the same answer.
            if self.expected in replayed:
                self.counters["repaired"] += 1
                self._apply_replayed(replayed, self.expected, live=last)
            return
        self.counters["restarts"] += 1
        logger.warning(
            "KV events rank %d: batch %d differs after reconnecting: publisher restarted",
            self.rank,
            last,
        )
        self._rejoin()
        self._last_payload = None
        self._duplicates.clear()

    def _repair(self, start: int, end: int) -> None:
        """Fill batches ``start .. end - 1`` (``end``: the live batch in hand) from the replay
        socket; resync when they cannot all be had.

        The replay returns every buffered batch from ``start`` on, also those after ``end``
        that the SUB socket will deliver again: they are applied at once (one replay covers
        every gap up to the publisher's head) and their live copies are skipped.
        """
        replayed = None
        for _ in range(self._replay_attempts if self.replay is not None else 0):
            # A resync drops everything believed cached: worth a retry on a busy machine.
            assert self.replay is not None
            replayed = self.replay.request(start)
            if replayed is not None:
                break
        replayed = replayed or {}
        run_start = end
        while run_start > start and run_start - 1 in replayed:
            run_start -= 1
        if run_start == start:
            self.counters["repaired"] += 1
        else:
            logger.warning(
                "KV events rank %d: batches %d..%d could not be replayed; resynchronising",
                self.rank,
                start,
                run_start - 1,
            )
            self._resync()
        # After a resync, what the replay returned up to the live batch is still a true
        # (partial) history, so it is applied too.
        self._apply_replayed(replayed, run_start, live=end)

    def _apply_replayed(self, replayed: dict[int, bytes], start: int, *, live: int) -> None:
        """Apply the contiguous run of replayed batches from ``start``; remember those after
        ``live`` (the newest seq the SUB socket delivered) to skip their live copies."""
        seq = start
        while seq in replayed:
            self.counters["replayed"] += 1
            self._apply(seq, replayed[seq])
            if seq > live:
                self._duplicates[seq] = replayed[seq]
            seq += 1

    def _apply(self, seq: int, payload: bytes) -> None:
        self._last_payload = payload
        self._deliver(seq, payload)
        # Only now: a reader of ``expected`` (stats) may take it as "applied up to here".
        self.expected = seq + 1
