"""The shared index behind the HTTP service: one ContextPilot, its engine link, its snapshot.

:class:`IndexService` holds what the HTTP layer (:mod:`.app`) serves, and is usable on its
own: a :class:`~contextpilot_integrations.core.pilot.ContextPilot` (index, conversation store)
that follows the engine through its
:class:`~contextpilot_integrations.sync.engine_link.EngineLink` (``pilot.engine``: KV events,
capacity model or TTL model, built from ``ServiceConfig.cache_sync``), the metrics, and the
snapshot file.

The sync path never breaks a request (DESIGN.md invariant 5): the engine link absorbs, counts
and logs once every failure of recording, touching, an unreachable engine or a resync that
cannot complete; a snapshot that cannot be read or written is counted the same way (through the
engine link, or by the service when it has none: ``stats()["sync"]["failures"]``,
``contextpilot_sync_failures_total``), and plans are served all the same.

Snapshot and resync (``ServiceConfig.snapshot_path``): the service restores the index from the
file when it is made, and saves it on :meth:`IndexService.stop` (and on a periodic timer, if
set). The restored requests were indexed by an earlier process, so :meth:`IndexService.start`
asks the engine link to re-establish what the engine still caches
(:meth:`EngineLink.resync <contextpilot_integrations.sync.engine_link.EngineLink.resync>`:
KV events replay the engine's stream and evict the restored rids it no longer holds; the
capacity model records them again, least recently used first; the TTL model evicts them all
when the service was down for ``ttl_s`` or longer).

Thread-safety: every method may be called from any thread. Planning calls into the pilot
concurrently (its index and conversation store take their own locks; it reserves an explicit
rid for the duration of its call, so two concurrent calls never plan the same rid).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contextpilot_integrations import __version__
from contextpilot_integrations.core.context_index import ContextIndex
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import BatchPlan, Plan
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import PlanRequest
from contextpilot_integrations.service.metrics import ServiceMetrics
from contextpilot_integrations.service.snapshot import (
    ServiceSnapshot,
    load_snapshot,
    save_snapshot,
)
from contextpilot_integrations.sync.configuration import CacheSyncConfig
from contextpilot_integrations.sync.engine_link import RestoredRequest

logger = logging.getLogger(__name__)


@dataclass
class ServiceConfig:
    """Settings of one index service.

    Attributes:
        cache_sync: the engine link, as
            :meth:`~contextpilot_integrations.sync.configuration.CacheSyncConfig.from_mapping`
            takes it (``{"kind": "kv-events", "endpoint": ..., "engine_grace_s": 5.0}``,
            ``{"kind": "capacity", ...}``, ``{"kind": "ttl", ...}``); the same mapping
            ``ContextPilot(cache_sync=...)`` takes. None: no engine feedback (the index's own
            LRU bound).
        snapshot_path: file to restore on start and save on stop; None: no snapshot.
        snapshot_interval_s: also save every this many seconds (None: only on stop).
        max_requests: LRU bound of the context index.
        layout: the prompt layout (None: the default :class:`PromptLayout`).
        api_key: shared secret every request but ``/health`` must present as
            ``Authorization: Bearer <key>``; None: no authentication.
        inline_plan_bytes: a single plan whose request body is at most this many bytes is
            parsed, planned and encoded on the event loop (a thread hop would cost more than
            the plan); larger ones, and every batch, in a worker thread.
        max_body_bytes: largest request body accepted (413 above).
        max_batch_threads: batch builds running at once (others wait their turn).

    Raises:
        ValueError: a setting out of range or an invalid ``cache_sync`` (names the field).
    """

    cache_sync: Mapping[str, Any] | CacheSyncConfig | None = None
    snapshot_path: str | Path | None = None
    snapshot_interval_s: float | None = None
    max_requests: int = 100_000
    layout: PromptLayout | None = None
    api_key: str | None = None
    inline_plan_bytes: int = 65_536
    max_body_bytes: int = 64 * 1024 * 1024
    max_batch_threads: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.max_requests, int) or self.max_requests < 1:
            raise ValueError(f"max_requests must be a positive int, got {self.max_requests!r}")
        if self.snapshot_interval_s is not None and not self.snapshot_interval_s > 0:
            raise ValueError(
                f"snapshot_interval_s must be positive or None, got {self.snapshot_interval_s!r}"
            )
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty str or None, got ''")
        for name in ("inline_plan_bytes", "max_body_bytes", "max_batch_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "inline_plan_bytes" else 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.cache_sync is not None and not isinstance(self.cache_sync, CacheSyncConfig):
            self.cache_sync = CacheSyncConfig.from_mapping(self.cache_sync)


@dataclass(frozen=True)
class _Restored:
    """What the snapshot gave back: the requests still indexed (LRU first) and how long the
    saving service has been gone."""

    requests: list[RestoredRequest]
    downtime_s: float


class IndexService:
    """One shared context index with its engine link, metrics and snapshot.

    Made, it holds the restored index (``snapshot_path``) and a pilot whose engine link is
    already started (``ContextPilot(cache_sync=...)``); :meth:`start` resyncs the restored
    requests with the engine and starts the snapshot timer, :meth:`stop` stops both and the
    engine link and saves the snapshot. It plans before :meth:`start` as well.

    Args:
        config: the settings.

    Raises:
        ValueError: an invalid cache-sync configuration (the message names the field).
        zmq.ZMQError: a malformed KV-event endpoint (an engine that is merely down is not an
            error: the subscriber connects when it comes up).
    """

    def __init__(self, config: ServiceConfig | None = None) -> None:
        self.config = config or ServiceConfig()
        self.metrics = ServiceMetrics(self.stats)
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}  # only without an engine link
        self._warned: set[str] = set()
        self._api_evictions = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False
        index, self._restored, problem = self._restore()
        sync = self.config.cache_sync
        assert sync is None or isinstance(sync, CacheSyncConfig)
        self.pilot = ContextPilot(
            layout=self.config.layout,
            index=index,
            max_requests=self.config.max_requests,
            cache_sync=sync,
        )
        if problem is not None:
            self._failure("snapshot", problem)

    # ----------------------------------------------------------------------------------------
    # Public API: planning
    # ----------------------------------------------------------------------------------------

    @property
    def layout(self) -> PromptLayout:
        """The layout plans are rendered with."""
        return self.pilot.layout

    def plan(self, request: PlanRequest) -> Plan:
        """``ContextPilot.plan`` of one request (recorded with the engine link by the pilot).

        Raises:
            TypeError / ValueError: as ``ContextPilot.plan``.
            RidConflictError: ``request.rid`` is already indexed or being planned.
        """
        plan = self.pilot.plan(request.query, request.blocks, rid=request.rid, scope=request.scope)
        self.metrics.plans.labels("single").inc()
        return plan

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """``ContextPilot.plan_batch`` (recorded with the engine link by the pilot).

        Raises:
            TypeError / ValueError: as ``ContextPilot.plan_batch``.
            RidConflictError: a rid is already indexed or being planned.
        """
        batch = self.pilot.plan_batch(requests)
        self.metrics.plans.labels("batch").inc(len(batch.plans))
        return batch

    # ----------------------------------------------------------------------------------------
    # Public API: index and conversation operations
    # ----------------------------------------------------------------------------------------

    def evict(self, rid: str) -> bool:
        """Drop ``rid`` from the index (asked by the app; counted as an ``api`` eviction);
        False if it was not indexed."""
        evicted = self.pilot.evict(rid)
        if evicted:
            with self._lock:
                self._api_evictions += 1
        return evicted

    def forget_conversation(self, tenant: str, conversation_id: str) -> bool:
        """Drop a conversation's de-duplication records; False if it was not held.

        Raises:
            TypeError / ValueError: a bad ``tenant`` or ``conversation_id``.
        """
        return self.pilot.deduplicator.store.forget(tenant, conversation_id)

    def record_usage(self, rid: str, prompt_tokens: int, cached_tokens: int) -> bool:
        """``ContextPilot.record_usage``: the engine's ``usage`` of one sent request; a hit
        marks the request as just used (index LRU, capacity and TTL models).

        Returns:
            Whether ``rid`` is indexed.

        Raises:
            TypeError / ValueError: as ``ContextPilot.record_usage``.
        """
        return self.pilot.record_usage(rid, prompt_tokens, cached_tokens)

    def stats(self) -> dict[str, Any]:
        """``ContextPilot.stats()`` (the index's figures at the top level, ``index``,
        ``conversations``, ``usage``), with ``sync`` always present (the engine link's stats:
        ``cache_model``, ``engine_connected``, ``resync_pending``, ``failures``,
        ``evictions``, ``source``; without one ``cache_model="none"`` and the service's own
        ``failures``) and ``service`` (``version``, ``evictions`` it was asked for:
        ``{"api": n}``)."""
        stats = self.pilot.stats()
        with self._lock:
            api_evictions = self._api_evictions
            failures = dict(self._failures)
        if "sync" not in stats:
            stats["sync"] = {
                "cache_model": "none",
                "engine_connected": None,
                "resync_pending": False,
                "failures": failures,
                "evictions": {},
            }
        stats["service"] = {"version": __version__, "evictions": {"api": api_evictions}}
        return stats

    @property
    def cache_model(self) -> str:
        """The engine link's kind (``kv-events``, ``capacity``, ``ttl``), or ``none``."""
        engine = self.pilot.engine
        return engine.kind if engine is not None else "none"

    @property
    def engine_connected(self) -> bool | None:
        """Whether the KV-event subscriber is connected to every rank's publisher; None
        without an event stream."""
        engine = self.pilot.engine
        return engine.engine_connected if engine is not None else None

    @property
    def resync_pending(self) -> bool:
        """True while restored requests still wait for the engine's state."""
        engine = self.pilot.engine
        return engine.resync_pending if engine is not None else False

    # ----------------------------------------------------------------------------------------
    # Public API: lifecycle
    # ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """(Re)start the engine link, resync the restored requests with the engine (once),
        start the snapshot timer. Idempotent.

        Raises:
            zmq.ZMQError: as :class:`IndexService`.
        """
        if self._started:
            return
        self._stop.clear()
        engine = self.pilot.engine
        if engine is not None:
            engine.start()
            if self._restored is not None and self._restored.requests:
                engine.resync(self._restored.requests, self._restored.downtime_s)
        self._restored = None
        if self.config.snapshot_path is not None and self.config.snapshot_interval_s:
            thread = threading.Thread(
                target=self._save_periodically, name="snapshot-timer", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        self._started = True

    def stop(self) -> None:
        """Stop the snapshot timer and the engine link, then save the snapshot (idempotent
        after a :meth:`start`)."""
        if not self._started:
            return
        self._stop.set()
        for thread in self._threads:
            thread.join(5.0)
        self._threads.clear()
        self.pilot.close()
        self.save_snapshot()
        self._started = False

    def save_snapshot(self) -> bool:
        """Save the index to ``snapshot_path`` now; False when none is set or saving failed
        (counted, logged)."""
        path = self.config.snapshot_path
        if path is None:
            return False
        snapshot = ServiceSnapshot(time.time(), self.cache_model, self.pilot.index.snapshot())
        try:
            size = save_snapshot(path, snapshot)
        except OSError as exc:
            self._failure("snapshot", f"cannot save snapshot {str(path)!r}: {exc}")
            return False
        logger.info(
            "saved snapshot %s: %d requests, %d bytes",
            path,
            len(snapshot.index.get("requests", [])),
            size,
        )
        return True

    # ----------------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------------

    def _failure(self, kind: str, detail: str) -> None:
        """A failure the service absorbs: counted by the engine link (or here without one),
        logged once at warning level."""
        engine = self.pilot.engine
        if engine is not None:
            engine.failure(kind, detail)
            return
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1
            first = kind not in self._warned
            self._warned.add(kind)
        level = logging.WARNING if first else logging.DEBUG
        logger.log(level, "sync path failure (%s): %s; plans are still served", kind, detail)

    def _restore(self) -> tuple[ContextIndex | None, _Restored | None, str | None]:
        """The index of the snapshot file, what it restored, and why it could not (the
        unreadable file is set aside)."""
        path = self.config.snapshot_path
        if path is None:
            return None, None, None
        try:
            snapshot = load_snapshot(path)
            if snapshot is None:
                logger.info("no snapshot at %s: starting with an empty index", path)
                return None, None, None
            index = ContextIndex.restore(snapshot.index, max_requests=self.config.max_requests)
        except (OSError, ValueError) as exc:
            _set_aside(Path(path))
            return None, None, f"cannot restore {str(path)!r}: {exc}"
        requests: list[RestoredRequest] = [
            (entry["rid"], tuple(zip((int(b) for b in entry["blocks"]), entry["tokens"])))
            for entry in snapshot.index.get("requests", [])
            if entry.get("rid") in index
        ]
        logger.info("restored %d requests from snapshot %s", len(requests), path)
        return index, _Restored(requests, max(0.0, time.time() - snapshot.saved_at)), None

    def _save_periodically(self) -> None:
        interval = self.config.snapshot_interval_s
        assert interval is not None
        while not self._stop.wait(interval):
            self.save_snapshot()


def _set_aside(path: Path) -> None:
    """Keep an unreadable snapshot for inspection; the next save must not overwrite it."""
    if path.exists():
        aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
        with contextlib.suppress(OSError):
            path.rename(aside)
            logger.info("moved the unreadable snapshot to %s", aside)
