"""RankStream without sockets: the sequence rules against a stand-in replay socket and a clock
(the subscriber tests run the same rules over ZMQ)."""

from __future__ import annotations

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
    receiver.stream.on_message(8, b"batch 8")  # no answer at all: every attempt, then resync
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
