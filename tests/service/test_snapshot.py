"""Kill and restart with a snapshot: the index comes back, and each cache model re-establishes
what the engine still holds."""

from __future__ import annotations

import json
import signal
import time

import pytest
from service_testing import blocks_of, wait_for

from contextpilot_integrations.service.client import ContextPilotClient


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
    assert saved["format"] == "contextpilot-service-snapshot"
    assert [entry["rid"] for entry in saved["index"]["requests"]] == rids  # LRU order

    second = server_factory("--snapshot", str(snapshot))
    stats = _stats(second.base_url)
    assert stats["requests"] == 10 and stats["sync"]["resync_pending"] is False
    with ContextPilotClient(second.base_url, fallback=False) as client:
        # The restored index still knows the shared prefix of the earlier requests.
        again = client.plan("again", blocks_of(99))
        assert again.matched_prefix_blocks == 4
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
    wait_for(
        lambda: (
            snapshot.exists() and len(json.loads(snapshot.read_text())["index"]["requests"]) == 6
        )
    )
    first.stop(signal.SIGKILL)
    second = server_factory("--snapshot", str(snapshot))
    assert _stats(second.base_url)["requests"] == 6


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
    assert len(json.loads(snapshot.read_text())["index"]["requests"]) == 2
    assert "cannot restore" in server.log() and server.log().count("WARNING") == 1


def test_capacity_model_restore_keeps_what_the_budget_holds(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    snapshot = tmp_path / "index.json"
    first = server_factory("--snapshot", str(snapshot))
    _plan(first.base_url, 10)
    first.stop(signal.SIGTERM)
    # The budget holds exactly the last 3 requests, shared prefixes counted once (as a radix
    # cache holds them).
    entries = json.loads(snapshot.read_text())["index"]["requests"]
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
