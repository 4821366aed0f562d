"""One data-parallel rank's KV-event stream kept continuous: sequence numbers, gap repair from
the replay socket, restart detection and resync.

Each published message carries a sequence number counting from 0 per publisher process. Per
rank (:meth:`RankStream.on_message`):

- first message (or first after a restart) with seq > 0: the batches before it are fetched
  from the replay socket from 0; when that fails the rank is resynchronised;
- seq > expected: a gap, once confirmed (below): the missing range is replayed and applied
  before the live batch (``repaired``); one replay returns everything buffered from there, so
  the later live copies (same seq, same payload) are skipped. Replay absent, timed out or short
  of the range: resync (forget what the rank is believed to cache), then apply the contiguous
  tail it returned;
- seq < expected (not the live copy of a replayed batch): the publisher restarted, once
  confirmed: resync, then the first-message rule;
- after the SUB socket reconnects: the replay is asked for batch ``expected - 1``; the same
  publisher returns the payload last applied, anything else is a restart;
- idle for ``idle_probe_s``: the replay is asked for anything from ``expected`` (a lost *last*
  message, batches missed by joining late); probes back off to 30 s while it does not answer;
  an empty buffer counts as joined.

A stray frame must not cause a resync: a seq of :data:`MAX_PLAUSIBLE_SEQ` or more is refused; a
frame out of line is held until the replay confirms it (the publisher holds that seq with that
payload) or, without an answer, until the next message continues from it or ``hold_s`` passes;
one never confirmed is dropped (``bad_sequence``). A stray with exactly the expected seq cannot
be told apart and is applied.

The :class:`~contextpilot_integrations.sync.subscriber.KVEventSubscriber` owns the sockets and
the thread. Public API: :class:`RankStream`, :data:`MAX_PLAUSIBLE_SEQ`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from contextpilot_integrations.sync.replay_client import ReplayClient

__all__ = ["MAX_PLAUSIBLE_SEQ", "RankStream"]

logger = logging.getLogger(__name__)

MAX_PLAUSIBLE_SEQ = 1 << 56
"""Sequence numbers from here on (2^56) are refused: a publisher counting a million batches a
second would need 2,284 years to reach it; 2^64 - 1, the replay end marker's sequence frame, is
one such."""

_MAX_PROBE_BACKOFF_S = 30.0
_RECONNECT_PROBE_DELAY_S = 0.2
_PROBE_TIMEOUT_S = 0.5
_HOLD_S = 1.0


class RankStream:
    """The sequence state of one rank's stream and the rules that keep it continuous.

    Args:
        rank: the data-parallel rank.
        deliver: ``deliver(seq, payload)`` applies one batch (decode it, hand it on); called in
            sequence order, each seq once.
        resync: ``resync()``: the stream lost continuity; forget what the rank caches.
        replay_attempts: replay requests made for one gap before resynchronising.
        idle_probe_s: silence after which the replay socket is probed; None: never.
        hold_s: how long an unconfirmed frame waits for the next message before it counts as
            confirmed (see the module docstring).
        clock: monotonic seconds, for the probe and hold schedules.

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
        hold_s: float = _HOLD_S,
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
        self.counters = {
            "replayed": 0,
            "gaps": 0,
            "repaired": 0,
            "probes": 0,
            "restarts": 0,
            "bad_sequence": 0,
        }
        self._deliver = deliver
        self._resync = resync
        self._replay_attempts = replay_attempts
        self._idle_probe_s = idle_probe_s
        self._hold_s = hold_s
        self._clock = clock
        # An out-of-line frame waiting for confirmation: (seq, payload, confirmed at).
        self._held: tuple[int, bytes, float] | None = None
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
        """A live message: apply it in order, repairing what precedes it first (see the module
        docstring for the rules)."""
        if seq >= MAX_PLAUSIBLE_SEQ:
            self._reject(seq, "implausible sequence number")
            return
        if self._suspect:
            self._check_same_publisher()
        if self._held is not None:
            self._resolve_held(seq)
        if self.expected is None:
            self._join(seq, payload)
        elif seq == self.expected:
            self._duplicates.clear()
            self._apply(seq, payload)
        elif seq > self.expected:
            self._gap(seq, payload)
        elif self._duplicates.pop(seq, None) != payload:  # else applied from a replay already
            self._step_back(seq, payload)

    def tick(self) -> None:
        """The rank's socket had nothing to read: confirm a held frame whose wait is over, else
        probe when due."""
        if self._held is not None:
            if self._clock() >= self._held[2]:
                self._resolve_held(None)
            return
        if self.probe_due():
            self.probe()

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
        if replayed is None:
            return
        newer = sorted(seq for seq in replayed if seq >= start)
        if not newer:
            if not replayed and self.expected is None:
                self.joined = True  # the publisher has published nothing: nothing to mirror
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
        self._held = None

    def _join(self, seq: int, payload: bytes) -> None:
        """The first message (since the start or a restart)."""
        if seq > 0:  # batches 0 .. seq - 1 were missed
            answer = self._replay_from(0)
            if answer is not None and not _published(answer, seq, payload):
                self._reject(seq, "not in the publisher's replay buffer")
                return
            self.counters["gaps"] += 1
            self._repair(0, seq, answer)
        if self.expected is None:
            self.expected = seq
        if seq >= self.expected:  # else the repair applied it
            self._apply(seq, payload)
        self.joined = True

    def _gap(self, seq: int, payload: bytes) -> None:
        assert self.expected is not None
        answer = self._replay_from(self.expected)
        if answer is None:
            self._hold(seq, payload)
            return
        if not _published(answer, seq, payload):
            self._reject(seq, "not in the publisher's replay buffer")
            return
        self._fill_gap(seq, payload, answer)

    def _fill_gap(self, seq: int, payload: bytes, answer: dict[int, bytes] | None) -> None:
        assert self.expected is not None
        self.counters["gaps"] += 1
        logger.info(
            "KV events rank %d: gap, expected seq %d, got %d; repairing",
            self.rank,
            self.expected,
            seq,
        )
        self._duplicates.clear()
        self._repair(self.expected, seq, answer)
        if seq >= self.expected:  # else the repair applied it from the replay
            self._apply(seq, payload)
        self.joined = True

    def _step_back(self, seq: int, payload: bytes) -> None:
        """``seq < expected``, not the live copy of a replayed batch: a restart once confirmed."""
        assert self.expected is not None
        answer = self.replay.request(seq) if self.replay is not None else None
        if answer is None:
            self._hold(seq, payload)
            return
        last = self.expected - 1
        if answer.get(seq) != payload:
            self._reject(seq, "a step back the publisher does not confirm")
        elif last not in answer:  # it sent this, and has not reached our position: restarted
            self._restarted(seq, payload)
        elif answer[last] == self._last_payload:
            pass  # the same publisher: a late copy of a batch applied already
        elif seq == last:
            # What was applied as ``last`` was a stray that took the publisher's seq; this is
            # the publisher's own batch (the stray decoded to nothing or was refused).
            self._apply(seq, payload)
        else:
            self._reject(seq, "a step back the publisher does not confirm")

    def _restarted(self, seq: int, payload: bytes) -> None:
        self.counters["restarts"] += 1
        logger.warning(
            "KV events rank %d: seq went back from %s to %d: publisher restarted",
            self.rank,
            self.expected,
            seq,
        )
        self._rejoin()
        self._duplicates.clear()
        self._join(seq, payload)

    def _hold(self, seq: int, payload: bytes) -> None:
        """Keep an out-of-line frame until the next message or ``hold_s`` decides on it."""
        self._held = (seq, payload, self._clock() + self._hold_s)

    def _resolve_held(self, next_seq: int | None) -> None:
        """Confirm the held frame (``next_seq``: the message that followed it; None: the wait
        is over) or drop it when the next message continues from ``expected`` instead."""
        assert self._held is not None and self.expected is not None
        seq, payload, _ = self._held
        self._held = None
        expected = self.expected
        if next_seq is not None and abs(next_seq - (seq + 1)) >= abs(next_seq - expected):
            self._reject(seq, "the stream went on without it")
        elif seq > expected:
            self._fill_gap(seq, payload, None)  # no answer from the replay: resync
        else:
            self._restarted(seq, payload)

    def _reject(self, seq: int, why: str) -> None:
        self.counters["bad_sequence"] += 1
        # The first few at warning level, the rest at debug: a bad peer must not flood logs.
        level = logging.WARNING if self.counters["bad_sequence"] <= 10 else logging.DEBUG
        logger.log(
            level,
            "KV events rank %d: dropping a frame with seq %d (expected %s): %s",
            self.rank,
            seq,
            self.expected,
            why,
        )

    def _replay_from(self, start: int) -> dict[int, bytes] | None:
        """The replay socket's batches from ``start`` on (None: no socket, or no answer after
        ``replay_attempts`` tries: a resync drops everything believed cached, worth a retry on
        a busy machine)."""
        if self.replay is None:
            return None
        for _ in range(self._replay_attempts):
            answer = self.replay.request(start)
            if answer is not None:
                return answer
        return None

    def _check_same_publisher(self) -> None:
        """After a reconnect: compare the publisher's batch ``expected - 1`` with the payload
        last applied; on a mismatch the publisher restarted (resync, then join afresh). A frame
        held for confirmation is dropped: the replay answer speaks for the publisher now."""
        self._suspect = False
        self._held = None
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

    def _repair(self, start: int, end: int, answer: dict[int, bytes] | None) -> None:
        """Fill batches ``start .. end - 1`` (``end``: the live batch in hand) from the replay
        socket's ``answer`` (None: no answer); resync when they cannot all be had.

        The replay returns every buffered batch from ``start`` on, also those after ``end``
        that the SUB socket will deliver again: they are applied at once (one replay covers
        every gap up to the publisher's head) and their live copies are skipped.
        """
        replayed = answer or {}
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


def _published(answer: dict[int, bytes], seq: int, payload: bytes) -> bool:
    """Whether a replay ``answer`` (batches from some start <= ``seq``) shows that the publisher
    sent ``payload`` as ``seq``: it holds it, or its buffer has already moved past ``seq``."""
    if seq in answer:
        return answer[seq] == payload
    return bool(answer) and min(answer) > seq
