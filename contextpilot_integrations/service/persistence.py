"""What the index service keeps across restarts: every pilot's state in its snapshot file.

:class:`ServiceSnapshots` restores the tenants' pilots from the file (:mod:`.snapshot` reads
and checks it) and saves them:

- a **checkpoint** (the periodic timer, ``POST /v1/snapshot``) is taken while planning goes
  on, so a conversation store restored from it is amnesic: it keeps each conversation's turn
  numbers, points to none of its records (the core's store, docs/DESIGN.md, "Sure hints");
- the **final** save (``IndexService.stop``, planning stopped) restores whole;
- an in-use marker (``.<name>.in-use`` beside the file) exists while a service runs on it:
  found at start, the last run did not stop cleanly, so even a final snapshot is restored as
  a checkpoint (turns were planned after it). With no file but the marker, history is lost too;
- a file that cannot be restored is set aside (``<name>.unreadable-<time>``), counted, and the
  service starts empty with amnesic stores: never a crash loop. Temporary files of a killed
  save are removed first.

Saves do not stall plans: the state is copied under the core's locks only briefly, then built,
encoded and freed in small pieces with the cyclic garbage collector paused and a short GIL
switch interval (process-wide, restored after: :func:`plans_first`); calls that arrive while a
save runs share the next one (a tenant calling ``/v1/snapshot`` in a loop costs two saves at
most at a time).
"""

from __future__ import annotations

import gc
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.service.partitions import Partitions
from contextpilot_integrations.service.snapshot import (
    SERVICE_SNAPSHOT_VERSION,
    SNAPSHOT_FORMAT,
    read_snapshot,
    remove_temporary_files,
    resolved,
    set_aside,
    write_snapshot,
)
from contextpilot_integrations.sync.engine_link import RestoredRequest

__all__ = ["Restored", "ServiceSnapshots", "plans_first"]

logger = logging.getLogger(__name__)

Restored = tuple[list[RestoredRequest], float]
"""The restored requests still indexed (least recently used first) and how long the saving
service has been gone (seconds): ``EngineLink.resync``'s arguments."""

_SAVE_SWITCH_INTERVAL_S = 0.0005


class ServiceSnapshots:
    """The snapshot file of one service.

    Args:
        path: the snapshot file (a symlink is followed).
        failure: ``failure(kind, detail)``, counts and logs a failure the service absorbs.
    """

    def __init__(self, path: str | Path, failure: Callable[[str, str], None]) -> None:
        self.path = path
        self._failure = failure
        self._marker = _in_use_marker(path)
        self._lock = threading.Lock()  # one save at a time
        self._figures_lock = threading.Lock()
        self._figures = {"saves": 0, "save_failures": 0, "set_aside": 0}
        self._last_started = -math.inf
        self._last_ok = False

    def figures(self) -> dict[str, int]:
        """``saves``, ``save_failures`` and ``set_aside`` (unreadable files moved) so far."""
        with self._figures_lock:
            return dict(self._figures)

    # ------------------------------------------------------------------ Public API: restore
    def restore(self, fresh: Callable[[], Partitions]) -> tuple[Partitions, Restored | None]:
        """The partitions the file holds (empty ones from ``fresh`` for what it lacks) and what
        to resync with the engine; empty amnesic partitions when it cannot be restored (the
        file set aside, the failure counted). Marks the file in use."""
        remove_temporary_files(self.path)
        unclean = self._marker.exists()
        partitions, restored = fresh(), None
        try:
            document = read_snapshot(self.path)
            if document is None:
                logger.info("no snapshot at %s: starting empty", self.path)
                if unclean:  # the last run planned, but never saved
                    partitions.lose_history()
            else:
                partitions, restored = self._restored(document, fresh(), unclean=unclean)
        except Exception as exc:  # any fault of the file: never a crash loop
            aside = set_aside(self.path)
            with self._figures_lock:
                self._figures["set_aside"] += 1
            partitions, restored = fresh(), None
            partitions.lose_history()
            where = f" (moved to {str(aside)!r})" if aside is not None else ""
            self._failure("snapshot", f"cannot restore {str(self.path)!r}{where}: {exc}")
        try:
            self._marker.parent.mkdir(parents=True, exist_ok=True)
            self._marker.touch()
        except OSError as exc:
            self._failure("snapshot", f"cannot create {str(self._marker)!r}: {exc}")
        return partitions, restored

    # ------------------------------------------------------------------ Public API: save
    def save(self, partitions: Partitions, *, cache_model: str, final: bool) -> bool:
        """Save every pilot's state now; False when it failed (counted, logged: a checkpoint
        as a sync failure, the final save always at error level, with the path). A checkpoint
        asked for while a save runs shares the next one.

        Args:
            partitions: what to save.
            cache_model: the engine link's kind (for the operator).
            final: planning has stopped: the restored stores will miss no turn.
        """
        asked = time.monotonic()
        with self._lock:
            if not final and self._last_started >= asked:
                return self._last_ok  # a save that began after the call covers it
            self._last_started = time.monotonic()
            self._last_ok = self._write(partitions, cache_model, final)
            return self._last_ok

    def stopped_cleanly(self) -> None:
        """The final save succeeded and nothing is planned any more: drop the in-use marker."""
        self._marker.unlink(missing_ok=True)

    # ------------------------------------------------------------------ internals
    def _restored(
        self, document: dict[str, Any], partitions: Partitions, *, unclean: bool
    ) -> tuple[Partitions, Restored]:
        mode = partitions.tenancy.mode
        single = mode in ("open", "single")
        sections: list[tuple[ContextPilot, Any]] = []
        if document["version"] == 1:
            if not single:
                raise ValueError("a version 1 snapshot (one index) cannot be split among tenants")
            pilot = partitions.sections()[0][2]
            pilot.index.load(document["index"])
            pilot.deduplicator.store.mark_history_lost()  # its conversations were not saved
            sections.append((pilot, document["index"]))
        else:
            saved_mode = document["isolation"]
            if saved_mode != mode and not (single and saved_mode in ("open", "single")):
                raise ValueError(
                    f"it was saved with isolation {saved_mode!r:.40}, this service runs {mode!r}"
                )
            for section in document["partitions"]:
                state = section["pilot"]
                checkpoint = unclean or not document["final"]
                if partitions.tenancy.partitioned:
                    partition = partitions.get(section["tenant"])
                    if partition is None:
                        logger.warning(
                            "snapshot: tenant %r is no longer configured; its state is dropped",
                            section["tenant"],
                        )
                        continue
                    partitions.add_rid_tags(partition, section["rid_tags"])
                    pilot = partition.pilot
                elif section["tenant"] is not None:
                    raise ValueError("an unpartitioned snapshot has a tenant's partition")
                else:
                    pilot = partitions.sections()[0][2]
                pilot.restore(state, checkpoint=checkpoint)
                sections.append((pilot, state["index"]))
        requests = _restored_requests(sections)
        kind = "final snapshot" if document.get("final") and not unclean else "checkpoint"
        logger.info(
            "restored %d requests from %s %s%s",
            len(requests),
            kind,
            self.path,
            " (the last run did not stop cleanly)" if unclean else "",
        )
        return partitions, (requests, max(0.0, time.time() - document["saved_at"]))

    def _write(self, partitions: Partitions, cache_model: str, final: bool) -> bool:
        started = time.perf_counter()
        try:
            with plans_first():
                sections: list[dict[str, Any]] = [
                    {"tenant": tenant, "rid_tags": list(tags), "pilot": pilot.snapshot(final=final)}
                    for tenant, tags, pilot in partitions.sections()
                ]
                requests = sum(len(s["pilot"]["index"]["requests"]) for s in sections)
                document = {
                    "format": SNAPSHOT_FORMAT,
                    "version": SERVICE_SNAPSHOT_VERSION,
                    "saved_at": time.time(),
                    "cache_model": cache_model,
                    "final": final,
                    "isolation": partitions.tenancy.mode,
                    "partitions": sections,
                }
                size = write_snapshot(self.path, document, release=True)
        except (OSError, TypeError, ValueError) as exc:
            with self._figures_lock:
                self._figures["save_failures"] += 1
            if final:
                # Nothing retries after it, and the failure counter (which logs only the first
                # of its kind, say of a full disk's checkpoints) is read by no one any more.
                logger.error(
                    "cannot save the final snapshot %s: %s; the next start restores the last "
                    "snapshot saved there, if any",
                    self.path,
                    exc,
                )
            else:
                self._failure("snapshot", f"cannot save snapshot {str(self.path)!r}: {exc}")
            return False
        with self._figures_lock:
            self._figures["saves"] += 1
        logger.info(
            "saved %s %s: %d requests, %d bytes in %.2f s",
            "final snapshot" if final else "checkpoint",
            self.path,
            requests,
            size,
            time.perf_counter() - started,
        )
        return True


@contextmanager
def plans_first() -> Iterator[None]:
    """While a snapshot is built and written: no cyclic garbage collection, and a short GIL
    switch interval (both process-wide, restored after).

    The copy of a large state is millions of new containers; they survive the young
    generations and trigger full collections that walk the whole heap while holding the GIL
    (130 to 800 ms with 100,000 indexed requests: every plan meanwhile waits). Reference
    counting still frees what plans drop; cycles made meanwhile wait for the next collection.
    The saver's own Python work (the core formatting its state) is interrupted every half
    millisecond rather than every 5 ms when a plan's thread wants the GIL.
    """
    paused = gc.isenabled()
    if paused:
        gc.disable()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, _SAVE_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        if paused:
            gc.enable()


def _in_use_marker(path: str | Path) -> Path:
    target = resolved(path)
    return target.with_name(f".{target.name}.in-use")


def _restored_requests(sections: list[tuple[ContextPilot, Any]]) -> list[RestoredRequest]:
    """The restored requests still indexed, least recently used first: each pilot's in its own
    LRU order, the pilots' interleaved by their relative position (no order across tenants is
    known)."""
    ranked: list[tuple[float, int, RestoredRequest]] = []
    for number, (pilot, index) in enumerate(sections):
        entries = [e for e in index.get("requests", []) if e["rid"] in pilot.index]
        for position, entry in enumerate(entries):
            blocks = tuple(zip((int(b) for b in entry["blocks"]), entry["tokens"]))
            ranked.append(((position + 1) / len(entries), number, (entry["rid"], blocks)))
    ranked.sort(key=lambda item: (item[0], item[1]))
    return [request for _, _, request in ranked]
