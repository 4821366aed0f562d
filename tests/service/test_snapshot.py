"""Kill and restart with a snapshot: the index comes back, and each cache model re-establishes
what the engine still holds."""

from __future__ import annotations

import json
import signal
import time

import pytest
from service_testing import blocks_of, check_hints, saved_requests, wait_for

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.core.request import Scope
from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.service_config import ServiceConfig


def _plan(base_url: str, count: int, prefix: str = "s") -> list[str]:
    with ContextPilotClient(base_url, fallback=False) as client:
        return [client.plan(f"q{i}", blocks_of(i), rid=f"{prefix}{i}").rid for i in range(count)]


def _stats(base_url: str) -> dict:  # type: ignore[type-arg]
    with ContextPilotClient(base_url, fallback=False) as client:
        return client.stats()


def test_sigterm_saves_and_a_restart_restores_the_index(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    snapshot = tmp_path / "index.json"
    first = server_factory("--snapshot", str(snapshot))
    rids = _plan(first.base_url, 10)
    # uvicorn re-raises the signal after its graceful shutdown (the snapshot is saved by then)
    assert first.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    saved = json.loads(snapshot.read_text())
    assert saved["format"] == "contextpilot-service-snapshot" and saved["final"] is True
    assert [entry["rid"] for entry in saved_requests(snapshot)] == rids  # LRU order

    second = server_factory("--snapshot", str(snapshot))
    stats = _stats(second.base_url)
    assert stats["requests"] == 10 and stats["sync"]["resync_pending"] is False
    with ContextPilotClient(second.base_url, fallback=False) as client:
        # The restored index still knows the prefixes of the earlier requests.
        again = client.plan("again", blocks_of(3))
        assert again.matched_prefix_blocks == len(blocks_of(3))
        assert client.evict("s3") is True
        with pytest.raises(ValueError, match="already indexed"):  # restored rids are live
            client.plan("q", ["x"], rid="s4")
    second.stop(signal.SIGTERM)
    third = server_factory("--snapshot", str(snapshot))
    assert _stats(third.base_url)["requests"] == 10  # 10 restored + 1 new - 1 evicted


def test_a_hard_kill_keeps_the_last_periodic_snapshot(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    snapshot = tmp_path / "index.json"
    first = server_factory("--snapshot", str(snapshot), "--snapshot-interval", "0.2")
    _plan(first.base_url, 6)
    wait_for(lambda: snapshot.exists() and len(saved_requests(snapshot)) == 6)
    first.stop(signal.SIGKILL)
    second = server_factory("--snapshot", str(snapshot))
    assert _stats(second.base_url)["requests"] == 6


def test_a_final_save_that_fails_on_sigterm_is_logged_as_an_error(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "state"
    folder.mkdir()
    snapshot = folder / "index.json"
    server = server_factory("--snapshot", str(snapshot), "--snapshot-interval", "0.1")
    _plan(server.base_url, 3)
    wait_for(lambda: snapshot.exists(), what="a first checkpoint")
    # The folder goes (as a full disk would fail every write): checkpoints fail first, and
    # the sync failure counter logs only the first of them.
    folder.rename(tmp_path / "state.gone")
    folder.write_text("not a folder any more")
    wait_for(lambda: "cannot save snapshot" in server.log(), what="a failed checkpoint")
    time.sleep(0.3)
    server.stop(signal.SIGTERM)
    errors = [line for line in server.log().splitlines() if " ERROR " in line]
    assert any(
        "cannot save the final snapshot" in line and str(snapshot) in line for line in errors
    ), server.log()[-3000:]


def test_an_unreadable_snapshot_is_set_aside_and_counted(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    snapshot = tmp_path / "index.json"
    snapshot.write_text("{not json")
    server = server_factory("--snapshot", str(snapshot))
    stats = _stats(server.base_url)
    assert stats["requests"] == 0
    assert stats["sync"]["failures"] == {"snapshot": 1}
    assert [p.name.startswith("index.json.unreadable-") for p in tmp_path.iterdir()].count(
        True
    ) == 1
    _plan(server.base_url, 2)
    server.stop(signal.SIGTERM)
    assert len(saved_requests(snapshot)) == 2
    assert "cannot restore" in server.log() and server.log().count("WARNING") == 1


def test_capacity_model_restore_keeps_what_the_budget_holds(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    snapshot = tmp_path / "index.json"
    first = server_factory("--snapshot", str(snapshot))
    _plan(first.base_url, 10)
    first.stop(signal.SIGTERM)
    # The budget holds exactly the last 3 requests, shared prefixes counted once (as a radix
    # cache holds them).
    entries = saved_requests(snapshot)
    held: dict[tuple[str, ...], int] = {}
    for entry in entries[-3:]:
        for depth, tokens in enumerate(entry["tokens"]):
            held[tuple(entry["blocks"][: depth + 1])] = tokens
    budget = sum(held.values())
    second = server_factory(
        "--snapshot", str(snapshot), "--cache-model", "capacity", "--capacity-tokens", str(budget)
    )
    stats = _stats(second.base_url)
    assert stats["requests"] == 3
    assert stats["sync"]["source"]["requests"] == 3
    with ContextPilotClient(second.base_url, fallback=False) as client:
        assert [client.evict(f"s{i}") for i in (6, 7, 8, 9)] == [False, True, True, True]


def test_ttl_model_restore_evicts_what_expired_while_down(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    snapshot = tmp_path / "index.json"
    ttl = ("--cache-model", "ttl", "--ttl-seconds", "1", "--min-cached-tokens", "0")
    first = server_factory("--snapshot", str(snapshot), *ttl)
    _plan(first.base_url, 3)
    first.stop(signal.SIGTERM)
    time.sleep(1.2)
    second = server_factory("--snapshot", str(snapshot), *ttl)
    assert _stats(second.base_url)["requests"] == 0
    second.stop(signal.SIGTERM)

    long_ttl = ("--cache-model", "ttl", "--ttl-seconds", "600", "--min-cached-tokens", "0")
    third = server_factory("--snapshot", str(snapshot), *long_ttl)
    _plan(third.base_url, 3, prefix="t")
    third.stop(signal.SIGTERM)
    fourth = server_factory("--snapshot", str(snapshot), *long_ttl)
    stats = _stats(fourth.base_url)
    assert stats["requests"] == 3 and stats["sync"]["source"]["requests"] == 3


def _bulk_snapshot(path, count: int) -> None:  # type: ignore[no-untyped-def]
    """A snapshot file of ``count`` indexed requests, written by the service itself."""
    service = IndexService(ServiceConfig(snapshot_path=path, max_requests=count + 1000))
    pilot = service.pilot_of()
    for i in range(count):
        pilot.index.insert(f"bulk-{i}", [3 * i + 1, 3 * i + 2, 3 * i + 3], [100, 100, 100])
    service.start()
    service.stop()


def test_a_kill_during_a_save_leaves_a_readable_snapshot(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    snapshot = tmp_path / "index.json"
    count = 30_000
    _bulk_snapshot(snapshot, count)
    for attempt in range(2):
        server = server_factory(
            "--snapshot", str(snapshot), "--snapshot-interval", "0.05",
            "--max-requests", str(count + 1000),
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob(".index.json.*.tmp")):  # a save is being written
            assert time.monotonic() < deadline, "no save seen"
            time.sleep(0.001)
        server.stop(signal.SIGKILL)
        leftovers = list(tmp_path.glob(".index.json.*.tmp"))
        assert leftovers, attempt  # killed in the middle of the write
        assert len(saved_requests(snapshot)) == count  # the previous snapshot, whole
        again = server_factory("--snapshot", str(snapshot), "--max-requests", str(count + 1000))
        assert not any(path.exists() for path in leftovers)  # cleaned at start
        assert _stats(again.base_url)["requests"] == count
        again.stop(signal.SIGTERM)


def test_a_restart_mid_conversation_gives_no_wrong_hint(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    snapshot = tmp_path / "index.json"
    shown = [f"passage {i}: " + "words " * 40 for i in range(6)]
    received: dict[int, object] = {}

    def turn(url: str, query: str, picks: list[int], number: int | None = None):  # type: ignore[no-untyped-def]
        with ContextPilotClient(url, fallback=False) as client:
            plan = client.plan(query, [shown[i] for i in picks], scope=Scope("chat", turn=number))
        check_hints(plan, received)  # type: ignore[arg-type]
        if plan.scope.turn is not None:
            assert plan.scope.turn not in received  # a number is never given twice
            received[plan.scope.turn] = plan
        return plan

    first = server_factory("--snapshot", str(snapshot), "--snapshot-interval", "0.1")
    turn(first.base_url, "one", [0, 1])
    assert turn(first.base_url, "two", [0, 2]).hints  # [Doc 1] of turn 1
    wait_for(lambda: _conversation_turns(snapshot) == [1, 2], what="a checkpoint with turn 2")
    turn(first.base_url, "three", [1, 3])  # planned after the last checkpoint: lost
    first.stop(signal.SIGKILL)

    second = server_factory("--snapshot", str(snapshot))  # restored from the checkpoint
    unsure = turn(second.base_url, "four", [0, 1, 3])
    assert unsure.scope.turn is None and not unsure.hints  # amnesic: no number, no hint
    resumed = turn(second.base_url, "five", [0, 4], number=5)  # the app's own number
    assert not resumed.hints  # nothing from before the restart is pointed to
    assert turn(second.base_url, "six", [4, 5]).scope.turn == 6  # numbered on from the app's
    second.stop(signal.SIGTERM)  # final: the store comes back whole

    third = server_factory("--snapshot", str(snapshot))
    after = turn(third.base_url, "seven", [4, 5, 0])
    assert after.scope.turn == 7 and len(after.hints) == 3  # turns 5 and 6 are pointed to


def _conversation_turns(path) -> list[int]:  # type: ignore[no-untyped-def]
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    conversations = document["partitions"][0]["pilot"]["conversations"]["conversations"]
    return [turn for entry in conversations for turn, _ in entry["turns"]]
