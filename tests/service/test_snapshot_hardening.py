"""The snapshot file as hostile input and as a crash-safe write, in
process: validated on load (a bad file is set aside, counted, and the service starts empty),
atomic and fsynced writes, temporary files cleaned, a symlinked path followed, the whole pilot
state in it (conversations too: checkpoint or final), and plans that never wait for a save.
The kill and restart checks against a real server are in ``test_snapshot.py``."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from service_testing import blocks_of, saved_requests

from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.service import snapshot as snapshot_module
from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.service_config import ServiceConfig
from contextpilot_integrations.service.snapshot import write_snapshot
from contextpilot_integrations.service.tenants import TenantKeys

TENANTS = {"alice": TenantKeys(("alice-key",)), "bob": TenantKeys(("bob-key",))}


def _service(path: Path, **settings: object) -> IndexService:
    return IndexService(ServiceConfig(snapshot_path=path, **settings))  # type: ignore[arg-type]


def _saved(path: Path, count: int = 3, **settings: object) -> dict:  # type: ignore[type-arg]
    """A good snapshot file of ``count`` requests; returns its JSON."""
    service = _service(path, **settings)
    service.start()
    for i in range(count):
        service.plan(PlanRequest(f"q{i}", blocks_of(i), f"r{i}", Scope("c")))
    service.stop()
    return json.loads(path.read_text())


def _corrupt(document: dict, how: str) -> str:  # type: ignore[type-arg]
    index = document["partitions"][0]["pilot"]["index"]
    if how == "requests is not a list":
        index["requests"] = {"rid": "r0"}
    elif how == "negative token counts":
        index["requests"][0]["tokens"][0] = -999_999_999_999
    elif how == "a block id out of range":
        index["requests"][0]["blocks"][0] = str(2**64)
    elif how == "saved_at is a string":
        document["saved_at"] = "yesterday"
    elif how == "partitions is not a list":
        document["partitions"] = "all"
    elif how == "a pilot that is a list":
        document["partitions"][0]["pilot"] = []
    elif how == "conversations of the wrong type":
        document["partitions"][0]["pilot"]["conversations"]["conversations"] = [{"tenant": 5}]
    elif how == "another isolation mode":
        document["isolation"] = "partitioned"
    elif how == "an unknown version":
        document["version"] = 99
    elif how == "nested 200,000 deep":
        return "[" * 200_000 + "]" * 200_000
    elif how == "not JSON":
        return '{"format": "contextpilot-service-snapshot", "version": 2,'
    return json.dumps(document)


@pytest.mark.parametrize(
    "how",
    [
        "requests is not a list",
        "negative token counts",
        "a block id out of range",
        "saved_at is a string",
        "partitions is not a list",
        "a pilot that is a list",
        "conversations of the wrong type",
        "another isolation mode",
        "an unknown version",
        "nested 200,000 deep",
        "not JSON",
    ],
)
def test_a_bad_snapshot_is_set_aside_counted_and_the_service_starts_empty(
    tmp_path: Path, how: str
) -> None:
    path = tmp_path / "index.json"
    path.write_text(_corrupt(_saved(path), how))
    service = _service(path)  # never raises: no crash loop
    stats = service.stats()
    assert stats["requests"] == 0 and stats["conversations"]["conversations"] == 0
    assert stats["sync"]["failures"] == {"snapshot": 1}
    assert stats["service"]["snapshot"]["set_aside"] == 1
    assert stats["conversations"]["amnesic"] is True  # it may have missed turns
    aside = [p.name for p in tmp_path.iterdir() if ".unreadable-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("index.json.unreadable-20")
    assert not path.exists()
    # Plans are served, and the next start finds no bad file.
    assert service.plan(PlanRequest("q", ["a block"])).order == [0]
    assert _service(path).stats()["sync"]["failures"] == {}


def test_two_bad_files_in_one_second_are_both_kept(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    for content in ("{bad one", "{bad two"):
        path.write_text(content)
        _service(path)
    kept = sorted(p.read_text() for p in tmp_path.iterdir() if ".unreadable-" in p.name)
    assert kept == ["{bad one", "{bad two"]


def test_the_write_is_atomic_and_fsynced_file_and_directory(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "index.json"
    path.write_text("the previous snapshot")
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append("directory" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    write_snapshot(path, {"format": "x", "items": list(range(50_000))})
    assert synced == ["file", "directory"]
    assert json.loads(path.read_text())["items"][-1] == 49_999

    def failing_pause() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):  # a save that fails half way
        write_snapshot(path, {"items": [[i, str(i)] for i in range(200_000)]}, pause=failing_pause)
    assert json.loads(path.read_text())["items"][-1] == 49_999  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]  # no temporary file left


def test_the_chunked_encoding_is_the_json_of_the_document(tmp_path: Path) -> None:
    document = {
        "a": [{"rid": f"r{i}", "blocks": [str(i), "é"], "tokens": [i, 2]} for i in range(30_000)],
        "b": {"nested": [[i, [[True, str(i), "[Doc 1]", None]]] for i in range(20_000)]},
        "c": [[]] * 3,
        "d": [list(range(70_000))],
        "e": 1.5,
    }
    write_snapshot(tmp_path / "x.json", document, release=False)
    assert json.loads((tmp_path / "x.json").read_text()) == json.loads(json.dumps(document))
    write_snapshot(tmp_path / "y.json", document, release=True)
    assert document == {}  # emptied in slices once written
    assert (tmp_path / "y.json").read_bytes() == (tmp_path / "x.json").read_bytes()


def test_temporary_files_of_a_killed_save_are_removed_at_start(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    _saved(path)
    leftover = tmp_path / ".index.json.k1ll3d.tmp"
    leftover.write_bytes(b'{"format": "contextpilot-service-snapshot", "vers')
    unrelated = tmp_path / ".other.json.abc.tmp"
    unrelated.write_text("not ours")
    service = _service(path)
    assert not leftover.exists() and unrelated.exists()
    assert service.stats()["requests"] == 3


def test_a_symlinked_snapshot_path_is_followed_and_kept(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / "index.json"
    link = tmp_path / "index.json"
    link.symlink_to(target)  # dangling until the first save
    assert _service(link).stats()["sync"]["failures"] == {}
    _saved(link)
    assert link.is_symlink() and link.resolve() == target
    assert len(saved_requests(target)) == 3
    assert _service(link).stats()["requests"] == 3
    target.write_text("{broken")
    service = _service(link)  # set aside: the target is moved, the link stays
    assert link.is_symlink() and service.stats()["sync"]["failures"] == {"snapshot": 1}
    moved = [p.name for p in (tmp_path / "data").iterdir() if not p.name.startswith(".")]
    assert [name.split("-")[0] for name in moved] == ["index.json.unreadable"]


def test_plans_go_on_while_a_save_is_encoding(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    service = _service(tmp_path / "index.json", max_requests=50_000)
    pilot = service.pilot_of()
    for i in range(20_000):
        pilot.index.insert(f"bulk-{i}", [i * 7 + 1, i * 7 + 2, i * 7 + 3], [100, 100, 100])
    service.plan(PlanRequest("turn 1", blocks_of(1), scope=Scope("c")))
    encoding, release = threading.Event(), threading.Event()

    def held_pause() -> None:  # the save stops half way through its encoding
        encoding.set()
        release.wait(30)

    monkeypatch.setattr(snapshot_module, "yield_to_planners", held_pause)
    saver = threading.Thread(target=service.save_snapshot)
    saver.start()
    try:
        assert encoding.wait(30)
        started = time.perf_counter()
        # No lock of the index, the conversation store or the service is held meanwhile.
        plan = service.plan(PlanRequest("turn 2", blocks_of(1), scope=Scope("c")))
        service.plan_batch([PlanRequest("b", blocks_of(2)), PlanRequest("c", blocks_of(3))])
        service.evict("bulk-5")
        service.stats()
        assert time.perf_counter() - started < 5.0
        assert plan.scope.turn == 2 and plan.hints
    finally:
        release.set()
        saver.join(60)
    assert len(saved_requests(tmp_path / "index.json")) >= 20_000


def test_checkpoints_keep_turn_numbers_and_the_final_save_keeps_everything(
    tmp_path: Path,
) -> None:
    path = tmp_path / "index.json"
    first = _service(path)
    first.start()
    texts = blocks_of(1)
    assert first.plan(PlanRequest("t1", texts, scope=Scope("c"))).scope.turn == 1
    assert first.save_snapshot()  # a checkpoint: planning goes on
    assert json.loads(path.read_text())["final"] is False
    assert first.plan(PlanRequest("t2", texts, scope=Scope("c"))).scope.turn == 2
    first.stop()  # the final save
    assert json.loads(path.read_text())["final"] is True
    again = _service(path)
    resumed = again.plan(PlanRequest("t3", texts, scope=Scope("c")))
    assert resumed.scope.turn == 3 and all(p.status == "replaced" for p in resumed.placements)
    assert "of turn 1" in resumed.hints[0]
    # Killed after a checkpoint (no final save): the store keeps the numbers, not the records.
    again.start()
    again.save_snapshot()
    killed = _service(path)  # again never stopped: its in-use marker is still there
    after = killed.plan(PlanRequest("t?", texts, scope=Scope("c")))
    assert after.scope.turn is None and not after.hints  # amnesic: no number, no hint
    explicit = killed.plan(PlanRequest("t5", texts, scope=Scope("c", turn=5)))
    assert explicit.scope.turn == 5 and not explicit.hints  # nothing from before is pointed to


def test_a_final_snapshot_of_a_run_that_did_not_stop_is_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    _saved(path)  # a clean run: final
    crashed = _service(path)  # restored, planning, never stopped (killed)
    crashed.plan(PlanRequest("later", blocks_of(9), scope=Scope("c")))
    restored = _service(path)  # the file still says final, the marker says otherwise
    assert restored.stats()["conversations"]["amnesic"] is True
    plan = restored.plan(PlanRequest("next", blocks_of(0), scope=Scope("c")))
    assert plan.scope.turn is None and not plan.hints


def test_every_tenant_is_in_the_snapshot_and_comes_back_to_its_own(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    first = _service(path, tenants=TENANTS)
    first.start()
    for tenant in ("alice", "bob"):
        first.plan(PlanRequest("q", blocks_of(len(tenant)), "r", Scope("c")), caller=tenant)
    first.stop()
    document = json.loads(path.read_text())
    assert document["isolation"] == "partitioned"
    assert [p["tenant"] for p in document["partitions"]] == ["alice", "bob"]
    again = _service(path, tenants=TENANTS)
    assert again.stats(caller="alice")["requests"] == again.stats(caller="bob")["requests"] == 1
    assert again.evict("r", caller="alice") is True and again.evict("r", caller="alice") is False
    assert again.evict("r", caller="bob") is True
    # A tenant no longer configured is dropped; a new one starts empty (and not amnesic).
    fewer = _service(path, tenants={"alice": TENANTS["alice"], "carol": TenantKeys(("c",))})
    assert fewer.stats(caller="alice")["requests"] == 1
    assert fewer.stats(caller="carol")["conversations"]["amnesic"] is False


def test_a_rotated_key_keeps_the_restored_rids_routed(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    first = _service(path, tenants=TENANTS)
    old = first.plan(PlanRequest("q", blocks_of(1), "r"), caller="alice").rid
    first.start()
    first.stop()
    rotated = {"alice": TenantKeys(("a-new-alice-key",)), "bob": TENANTS["bob"]}
    again = _service(path, tenants=rotated, cache_sync={"kind": "capacity", "capacity_tokens": 10})
    assert old in again.pilot_of("alice").index
    assert again._engine_evicted(old) is True  # the engine's eviction reaches alice's index
    assert again.record_usage(old, 10, 0, caller="alice") is False  # evicted


def test_a_version_1_snapshot_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    index = {"version": 1, "requests": [{"rid": "old", "blocks": ["1", "2"], "tokens": [5, 5]}]}
    path.write_text(
        json.dumps(
            {
                "format": "contextpilot-service-snapshot",
                "version": 1,
                "saved_at": time.time(),
                "cache_model": "none",
                "index": index,
            }
        )
    )
    service = _service(path)
    assert "old" in service.pilot_of().index
    assert service.stats()["conversations"]["amnesic"] is True  # no conversations were kept
    assert _service(tmp_path / "other.json", tenants=TENANTS).stats(caller="bob")["requests"] == 0
