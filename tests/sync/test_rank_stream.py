"""RankStream without sockets: the sequence rules against a stand-in replay socket and a clock
(the subscriber tests run the same rules over ZMQ)."""

from __future__ import annotations

import pytest

from contextpilot_integrations.sync.rank_stream import RankStream


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Replay:
    """The publisher's replay buffer: ``request(start)`` returns ``{seq: payload}`` from
    ``start`` on; None while ``down``."""

    timeout_s = 2.0

    def __init__(self, buffer: dict[int, bytes]) -> None:
        self.buffer = buffer
        self.down = False
        self.requests: list[int] = []

    def request(self, start: int, *, timeout_s=None, quiet=False) -> dict[int, bytes] | None:
        self.requests.append(start)
        if self.down:
            return None
        return {seq: payload for seq, payload in self.buffer.items() if seq >= start}


class Receiver:
    def __init__(self, replay: Replay | None, idle_probe_s: float | None = None) -> None:
        self.applied: list[int] = []
        self.expected_while_applying: list[int | None] = []
        self.resyncs = 0
        self.clock = Clock()
        self.stream = RankStream(
            0,
            deliver=self.deliver,
            resync=self.resync,
            replay_attempts=2,
            idle_probe_s=idle_probe_s,
            clock=self.clock,
        )
        self.stream.replay = replay  # type: ignore[assignment]
        self.stream.started()

    def deliver(self, seq: int, payload: bytes) -> None:
        self.applied.append(seq)
        self.expected_while_applying.append(self.stream.expected)

    def resync(self) -> None:
        self.resyncs += 1


def payloads(*seqs: int) -> dict[int, bytes]:
    return {seq: b"batch %d" % seq for seq in seqs}


def test_in_order_messages_are_delivered_once() -> None:
    receiver = Receiver(Replay({}))
    for seq in range(3):
        receiver.stream.on_message(seq, b"batch %d" % seq)
    assert receiver.applied == [0, 1, 2] and receiver.stream.expected == 3
    assert receiver.stream.joined and receiver.resyncs == 0
    # ``expected`` moves past a batch only once it is applied: a reader of the subscriber's
    # ``expected_seq`` that sees the last seq can count on the mirror holding its events.
    assert receiver.expected_while_applying == [0, 1, 2]


def test_joining_late_replays_from_zero_and_skips_the_live_copies() -> None:
    replay = Replay(payloads(0, 1, 2, 3, 4))
    receiver = Receiver(replay)
    receiver.stream.on_message(2, b"batch 2")  # 0 and 1 were published before we subscribed
    assert receiver.applied == [0, 1, 2, 3, 4] and replay.requests == [0]
    for seq in (3, 4):  # the live copies of what the replay already applied
        receiver.stream.on_message(seq, b"batch %d" % seq)
    assert receiver.applied == [0, 1, 2, 3, 4] and receiver.resyncs == 0
    assert receiver.stream.counters["repaired"] == 1


def test_a_gap_the_replay_cannot_fill_resyncs_then_applies_the_tail() -> None:
    replay = Replay(payloads(0, 4, 5))  # 1..3 gone from the buffer
    receiver = Receiver(replay)
    receiver.stream.on_message(0, b"batch 0")
    receiver.stream.on_message(5, b"batch 5")
    assert receiver.resyncs == 1 and receiver.applied == [0, 4, 5]
    replay.down = True
    receiver.stream.on_message(8, b"batch 8")  # no answer at all: held after every attempt
    assert replay.requests == [1, 6, 6] and receiver.resyncs == 1 and receiver.applied[-1] == 5
    receiver.clock.now += 1.0  # nothing followed it within hold_s: confirmed, resync
    receiver.stream.tick()
    assert replay.requests == [1, 6, 6] and receiver.resyncs == 2 and receiver.applied[-1] == 8


def test_a_sequence_that_goes_back_is_a_restart() -> None:
    replay = Replay(payloads(0, 1, 2))
    receiver = Receiver(replay)
    for seq in range(3):
        receiver.stream.on_message(seq, b"batch %d" % seq)
    replay.buffer = {0: b"new engine 0"}
    receiver.stream.on_message(0, b"new engine 0")
    assert receiver.resyncs == 1 and receiver.stream.counters["restarts"] == 1
    assert receiver.applied == [0, 1, 2, 0] and receiver.stream.expected == 1


def test_a_reconnect_to_a_new_publisher_past_the_old_seq_is_a_restart() -> None:
    replay = Replay(payloads(0, 1))
    receiver = Receiver(replay)
    receiver.stream.on_message(0, b"batch 0")
    receiver.stream.on_message(1, b"batch 1")
    receiver.stream.connected()
    replay.buffer = {0: b"other 0", 1: b"other 1", 2: b"other 2", 3: b"other 3"}
    receiver.stream.on_message(3, b"other 3")  # seq alone would read this as a gap
    assert receiver.stream.counters["restarts"] == 1 and receiver.resyncs == 1
    assert receiver.applied == [0, 1, 0, 1, 2, 3]


def test_idle_probes_find_a_lost_last_message_and_back_off_while_down() -> None:
    replay = Replay(payloads(0, 1))
    receiver = Receiver(replay, idle_probe_s=1.0)
    receiver.stream.on_message(0, b"batch 0")
    receiver.stream.heard()
    assert not receiver.stream.probe_due()
    receiver.clock.now += 1.0
    assert receiver.stream.probe_due()
    receiver.stream.probe()  # batch 1 was lost on the way and nothing followed it
    assert receiver.applied == [0, 1] and receiver.resyncs == 0
    replay.down = True
    waits = []
    for _ in range(7):
        receiver.clock.now += 60
        receiver.stream.probe()
        before = receiver.clock.now
        while not receiver.stream.probe_due():
            receiver.clock.now += 0.5
        waits.append(receiver.clock.now - before)
    assert waits == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert not Receiver(None, idle_probe_s=1.0).stream.probe_due()  # no replay: no probes


def in_order(receiver: Receiver, *seqs: int) -> None:
    for seq in seqs:
        receiver.stream.on_message(seq, b"batch %d" % seq)


@pytest.mark.parametrize("replay_up", [True, False], ids=["replay", "no-replay"])
def test_one_garbage_frame_with_seq_2_64_minus_1_causes_no_resync(replay_up: bool) -> None:
    # One such frame must not cause a resync (two resyncs would evict everything).
    replay = Replay(payloads(*range(6)))
    receiver = Receiver(replay if replay_up else None)
    in_order(receiver, 0, 1, 2)
    receiver.stream.on_message(2**64 - 1, b"\xc1garbage")
    in_order(receiver, 3, 4, 5)
    assert receiver.resyncs == 0 and receiver.applied == [0, 1, 2, 3, 4, 5]
    assert receiver.stream.counters["bad_sequence"] == 1
    assert receiver.stream.counters["restarts"] == receiver.stream.counters["gaps"] == 0


def test_a_far_jump_the_publisher_never_sent_is_refused_by_the_replay() -> None:
    replay = Replay(payloads(*range(4)))
    receiver = Receiver(replay)
    in_order(receiver, 0, 1)
    for seq in (10**12, 7, 2**55):  # far, near, and just below the plausible limit
        receiver.stream.on_message(seq, b"stray")
    receiver.stream.on_message(3, b"other payload")  # a seq it sent, with another payload
    in_order(receiver, 2, 3)
    assert receiver.resyncs == 0 and receiver.applied == [0, 1, 2, 3]
    assert receiver.stream.counters["bad_sequence"] == 4


def test_without_replay_a_jump_is_held_until_the_next_message_decides() -> None:
    receiver = Receiver(None)
    in_order(receiver, 0, 1)
    receiver.stream.on_message(10**9, b"stray")  # held: nothing can confirm it yet
    assert receiver.applied == [0, 1] and receiver.resyncs == 0
    in_order(receiver, 2)  # the old stream goes on: the held frame was a stray
    assert receiver.applied == [0, 1, 2] and receiver.stream.counters["bad_sequence"] == 1
    receiver.stream.on_message(5, b"batch 5")  # a real gap (3, 4 lost): held ...
    in_order(receiver, 6)  # ... and confirmed by the next message continuing from it
    assert receiver.resyncs == 1 and receiver.applied == [0, 1, 2, 5, 6]
    assert receiver.stream.counters["gaps"] == 1


def test_a_step_back_is_a_restart_only_when_confirmed() -> None:
    replay = Replay(payloads(*range(5)))
    receiver = Receiver(replay)
    in_order(receiver, 0, 1, 2, 3)
    receiver.stream.on_message(1, b"stray")  # the same publisher still holds batch 3
    receiver.stream.on_message(2, b"batch 2")  # a late copy of an applied batch: dropped
    in_order(receiver, 4)
    assert receiver.resyncs == 0 and receiver.applied == [0, 1, 2, 3, 4]
    assert receiver.stream.counters["bad_sequence"] == 1
    # Without replay the next message decides: it continues the old stream here ...
    receiver = Receiver(None)
    in_order(receiver, 0, 1, 2, 3)
    receiver.stream.on_message(0, b"stray")
    in_order(receiver, 4)
    assert receiver.resyncs == 0 and receiver.stream.counters["bad_sequence"] == 1
    # ... and the new one (a restarted publisher counting from 0) there.
    receiver.stream.on_message(0, b"new 0")
    receiver.stream.on_message(1, b"new 1")
    assert receiver.stream.counters["restarts"] == 1 and receiver.resyncs >= 1
    assert receiver.applied[-2:] == [0, 1] and receiver.stream.expected == 2


def test_the_first_message_is_checked_against_the_replay() -> None:
    replay = Replay(payloads(0, 1, 2))
    receiver = Receiver(replay)
    receiver.stream.on_message(2**40, b"stray")  # a stray first frame: the rank stays unjoined
    assert receiver.applied == [] and not receiver.stream.joined
    receiver.stream.on_message(2, b"batch 2")
    assert receiver.applied == [0, 1, 2] and receiver.stream.joined and receiver.resyncs == 0


def test_an_empty_replay_buffer_joins_the_rank() -> None:
    # A publisher that has published nothing has nothing to mirror (engine_link waits on this).
    receiver = Receiver(Replay({}), idle_probe_s=1.0)
    receiver.clock.now += 1.0
    receiver.stream.tick()
    assert receiver.stream.joined and receiver.stream.expected is None
    receiver.stream.on_message(0, b"batch 0")
    assert receiver.applied == [0]


def test_a_stray_frame_that_took_the_next_seq_does_not_fake_a_restart() -> None:
    replay = Replay(payloads(0, 1, 2, 3))
    receiver = Receiver(replay)
    in_order(receiver, 0, 1)
    receiver.stream.on_message(2, b"stray")  # in line: it cannot be told from the real one
    in_order(receiver, 2, 3)  # the publisher's own batch 2 follows: applied, no restart
    assert receiver.applied == [0, 1, 2, 2, 3] and receiver.resyncs == 0
    assert receiver.stream.counters["restarts"] == 0
