"""The shared index behind the HTTP service: one ContextPilot, its engine sync, its snapshot.

:class:`IndexService` holds what the HTTP layer (:mod:`.app`) serves, and is usable on its
own: a :class:`~contextpilot_integrations.core.pilot.ContextPilot` (index, conversation store),
the cache-state source that reports the engine's evictions
(:mod:`contextpilot_integrations.sync`: KV events, capacity model or TTL model, all calling
:meth:`IndexService.evict` through ``on_evict``), the metrics, and the snapshot file.

The sync path never breaks a request (DESIGN.md invariant 5): a failure to record a sent
request with the cache-state source, an unreachable engine, a resync that cannot complete or a
snapshot that cannot be read or written is counted (``contextpilot_sync_failures_total``), logged
once at warning level (later ones at debug), and the plan is returned all the same.

Snapshot and resync (``ServiceConfig.snapshot_path``): :meth:`IndexService.start` restores the
index from the file; :meth:`IndexService.stop` (and a periodic timer, if set) saves it. The
restored requests were indexed by an earlier process, so what the engine still caches is
re-established with the engine:

- KV events: the subscriber joins the engine's stream by replaying its buffered events
  (:class:`~contextpilot_integrations.sync.subscriber.KVEventSubscriber`: on the first live
  batch, or an idle probe of the replay socket), which re-attributes cached blocks to the
  restored rids by their echoed ``session_id``; once every rank has joined, each restored rid
  the mirror does not hold is evicted. Until then the restored index is kept
  (``resync_pending`` in the stats).
- capacity model: the restored requests are recorded again, least recently used first, so the
  model's token budget holds them (evicting the oldest when it does not).
- TTL model: when the service was down for ``ttl_s`` or longer, every restored request is
  evicted; otherwise they are recorded again (their lifetime restarts: optimistic by at most
  the downtime).

Thread-safety: every method may be called from any thread. Planning calls into the pilot
concurrently (its index and conversation store take their own locks); an explicit rid is
reserved for the duration of its call so that two concurrent calls cannot plan the same rid
(the pilot records a conversation turn before it indexes the rid).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contextpilot_integrations import __version__
from contextpilot_integrations.core.context_index import ContextIndex
from contextpilot_integrations.core.conversation import TurnVisibility
from contextpilot_integrations.core.pilot import BatchPlan, ContextPilot, Plan
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.service.metrics import ServiceMetrics
from contextpilot_integrations.service.snapshot import (
    ServiceSnapshot,
    load_snapshot,
    save_snapshot,
)
from contextpilot_integrations.sync.cache_state import CacheStateSource, SentRequest
from contextpilot_integrations.sync.capacity_model import CapacityModel
from contextpilot_integrations.sync.configuration import (
    CacheSyncConfig,
    build_cache_state_source,
)
from contextpilot_integrations.sync.kv_event_source import KVEventCacheState
from contextpilot_integrations.sync.ttl_model import TTLModel

logger = logging.getLogger(__name__)


class RequestConflictError(ValueError):
    """A rid that is already indexed, or that a concurrent call is planning (HTTP 409)."""


@dataclass
class ServiceConfig:
    """Settings of one index service.

    Attributes:
        cache_sync: the cache-state source, as for
            :meth:`~contextpilot_integrations.sync.configuration.CacheSyncConfig.from_mapping`
            (``{"kind": "kv-events", "endpoint": ...}``, ``{"kind": "capacity", ...}``,
            ``{"kind": "ttl", ...}``); None: no engine feedback (the index's own LRU bound).
        snapshot_path: file to restore on start and save on stop; None: no snapshot.
        snapshot_interval_s: also save every this many seconds (None: only on stop).
        max_requests: LRU bound of the context index.
        layout: the prompt layout (None: the default :class:`PromptLayout`).
        api_key: shared secret every request but ``/health`` must present as
            ``Authorization: Bearer <key>``; None: no authentication.
        engine_grace_s: how long the KV-event publisher may stay unconnected before the
            engine counts as unreachable (and the resync after a restore may wait before
            that counts as a failure; it goes on waiting).
        inline_plan_bytes: a single plan whose request body is at most this many bytes is
            parsed, planned and encoded on the event loop (a thread hop would cost more than
            the plan); larger ones, and every batch, in a worker thread.
        max_body_bytes: largest request body accepted (413 above).
        max_batch_threads: batch builds running at once (others wait their turn).
    """

    cache_sync: Mapping[str, Any] | CacheSyncConfig | None = None
    snapshot_path: str | Path | None = None
    snapshot_interval_s: float | None = None
    max_requests: int = 100_000
    layout: PromptLayout | None = None
    api_key: str | None = None
    engine_grace_s: float = 5.0
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
        if not self.engine_grace_s > 0:
            raise ValueError(f"engine_grace_s must be positive, got {self.engine_grace_s!r}")
        for name in ("inline_plan_bytes", "max_body_bytes", "max_batch_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "inline_plan_bytes" else 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.cache_sync is not None and not isinstance(self.cache_sync, CacheSyncConfig):
            self.cache_sync = CacheSyncConfig.from_mapping(self.cache_sync)


class IndexService:
    """One shared context index with its engine sync, metrics and snapshot.

    Args:
        config: the settings.

    Raises:
        ValueError: an invalid cache-sync configuration (the message names the field).
    """

    def __init__(self, config: ServiceConfig | None = None) -> None:
        self.config = config or ServiceConfig()
        self.layout = self.config.layout or PromptLayout()
        self.metrics = ServiceMetrics(self.stats)
        self.pilot = self._new_pilot(None)
        sync = self.config.cache_sync
        assert sync is None or isinstance(sync, CacheSyncConfig)
        self.cache_model = sync.kind if sync is not None else "none"
        self.cache_source: CacheStateSource | None = None
        if sync is not None:
            self.cache_source = build_cache_state_source(sync, self._evict_from_sync)
        self._planning: set[str] = set()
        self._planning_lock = threading.Lock()
        self._warned: set[str] = set()
        self._state_lock = threading.Lock()
        self._failures: dict[str, int] = {}
        self._usage = {"reports": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self._restored: set[str] = set()
        self._resync_pending = False
        self._downtime_s = 0.0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False

    # ----------------------------------------------------------------------------------------
    # Public API: planning
    # ----------------------------------------------------------------------------------------

    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        conversation_id: str | None = None,
        tenant: str = "",
        turn: int | None = None,
        visibility: TurnVisibility | None = None,
    ) -> Plan:
        """``ContextPilot.plan``, then the request is recorded with the cache-state source.

        Raises:
            TypeError / ValueError: as ``ContextPilot.plan``.
            RequestConflictError: ``rid`` is already indexed or being planned by a
                concurrent call.
        """
        with self._reserved([rid] if rid is not None else []):
            plan = self.pilot.plan(
                query,
                blocks,
                rid=rid,
                conversation_id=conversation_id,
                tenant=tenant,
                turn=turn,
                visibility=visibility,
            )
        self.metrics.plans.labels("single").inc()
        self._record_sent([plan])
        return plan

    def plan_batch(
        self,
        queries: Sequence[str],
        blocks: Sequence[Sequence[str]],
        *,
        rids: Sequence[str] | None = None,
        conversation_ids: Sequence[str | None] | None = None,
        tenants: Sequence[str] | None = None,
        turns: Sequence[int | None] | None = None,
        visibilities: Sequence[TurnVisibility | None] | None = None,
    ) -> BatchPlan:
        """``ContextPilot.plan_batch``, then each request is recorded with the source.

        Raises:
            TypeError / ValueError: as ``ContextPilot.plan_batch``.
            RequestConflictError: a rid is already indexed or being planned by a concurrent
                call.
        """
        with self._reserved(rids or []):
            batch = self.pilot.plan_batch(
                queries,
                blocks,
                rids=rids,
                conversation_ids=conversation_ids,
                tenants=tenants,
                turns=turns,
                visibilities=visibilities,
            )
        self.metrics.plans.labels("batch").inc(len(batch.plans))
        self._record_sent(batch.plans)
        return batch

    # ----------------------------------------------------------------------------------------
    # Public API: index and conversation operations
    # ----------------------------------------------------------------------------------------

    def evict(self, rid: str) -> bool:
        """Drop ``rid`` from the index (asked by the app); False if it was not indexed."""
        evicted = self.pilot.evict(rid)
        if evicted:
            self.metrics.evictions.labels("api").inc()
        forget = getattr(self.cache_source, "forget", None)
        if forget is not None:
            self._guard("forget", forget, rid)
        return evicted

    def forget_conversation(self, tenant: str, conversation_id: str) -> bool:
        """Drop a conversation's de-duplication records; False if it was not held.

        Raises:
            TypeError / ValueError: a bad ``tenant`` or ``conversation_id``.
        """
        return self.pilot.deduplicator.store.forget(tenant, conversation_id)

    def record_usage(self, rid: str, prompt_tokens: int, cached_tokens: int) -> bool:
        """Add the engine's ``usage`` figures of one request to the statistics; a cache hit
        (``cached_tokens > 0``) marks the request as just used in the index and in the
        cache-state source (LRU and TTL refresh).

        Returns:
            whether ``rid`` is indexed.

        Raises:
            ValueError: negative figures, or ``cached_tokens > prompt_tokens``.
        """
        if prompt_tokens < 0 or cached_tokens < 0 or cached_tokens > prompt_tokens:
            raise ValueError(
                f"need 0 <= cached_tokens <= prompt_tokens, got cached_tokens={cached_tokens}, "
                f"prompt_tokens={prompt_tokens}"
            )
        with self._state_lock:
            self._usage["reports"] += 1
            self._usage["prompt_tokens"] += prompt_tokens
            self._usage["cached_tokens"] += cached_tokens
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.cached_tokens.inc(cached_tokens)
        indexed = rid in self.pilot.index
        if cached_tokens > 0:
            self.pilot.index.touch(rid)
            touch = getattr(self.cache_source, "touch", None)
            if touch is not None:
                self._guard("touch", touch, rid)
        return indexed

    def stats(self) -> dict[str, Any]:
        """The index statistics (the keys of ``ContextPilot.stats()``) at the top level, and
        sections ``index`` (the same), ``conversations``, ``sync``, ``usage`` and
        ``service``."""
        index = self.pilot.stats()
        with self._state_lock:
            usage: dict[str, float] = dict(self._usage)
            failures = dict(self._failures)
        usage["hit_ratio"] = (
            usage["cached_tokens"] / usage["prompt_tokens"] if usage["prompt_tokens"] else 0.0
        )
        sync: dict[str, Any] = {
            "cache_model": self.cache_model,
            "engine_connected": self.engine_connected,
            "resync_pending": self._resync_pending,
            "failures": failures,
        }
        if self.cache_source is not None:
            sync["source"] = self.cache_source.stats()
        return {
            **index,
            "index": index,
            "conversations": self.pilot.deduplicator.store.stats(),
            "sync": sync,
            "usage": usage,
            "service": {"version": __version__},
        }

    @property
    def engine_connected(self) -> bool | None:
        """Whether the KV-event subscriber is connected to every rank's publisher (the
        subscriber's ZMQ socket monitor); None without an event stream."""
        if not isinstance(self.cache_source, KVEventCacheState):
            return None
        return all(self.cache_source.subscriber.stats()["connected"])

    @property
    def resync_pending(self) -> bool:
        """True while restored requests still wait for the engine's state."""
        return self._resync_pending

    # ----------------------------------------------------------------------------------------
    # Public API: lifecycle
    # ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Restore the snapshot, start the cache-state source, resync, start the timers.

        Raises:
            zmq.ZMQError: the KV-event endpoint is malformed (a configuration error; an
                engine that is merely down is not an error).
        """
        if self._started:
            return
        self._stop.clear()
        restored = self._restore()
        if self.cache_source is not None:
            self.cache_source.start()
        if isinstance(self.cache_source, KVEventCacheState):
            self._spawn("engine-link-watch", self._watch_engine_link)
        if restored:
            self._resync(restored)
        if self.config.snapshot_path is not None and self.config.snapshot_interval_s:
            self._spawn("snapshot-timer", self._save_periodically)
        self._started = True

    def stop(self) -> None:
        """Stop the timers and the cache-state source, then save the snapshot (idempotent)."""
        if not self._started:
            return
        self._stop.set()
        for thread in self._threads:
            thread.join(5.0)
        self._threads.clear()
        if self.cache_source is not None:
            self._guard("stop", self.cache_source.stop)
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
            self._sync_failure("snapshot", f"cannot save snapshot {str(path)!r}: {exc}")
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

    def _new_pilot(self, index: ContextIndex | None) -> ContextPilot:
        return ContextPilot(
            layout=self.layout,
            index=index,
            max_requests=self.config.max_requests,
        )

    @contextlib.contextmanager
    def _reserved(self, rids: Iterable[str]) -> Iterator[None]:
        wanted = [rid for rid in rids if isinstance(rid, str)]
        with self._planning_lock:
            busy = [rid for rid in wanted if rid in self._planning]
            if busy:
                raise RequestConflictError(
                    f"rid {busy[0]!r} is being planned by a concurrent request"
                )
            indexed = [rid for rid in wanted if rid in self.pilot.index]
            if indexed:
                raise RequestConflictError(f"rid {indexed[0]!r} is already indexed")
            self._planning.update(wanted)
        try:
            yield
        finally:
            with self._planning_lock:
                self._planning.difference_update(wanted)

    def _record_sent(self, plans: Sequence[Plan]) -> None:
        if self.cache_source is None:
            return
        for plan in plans:
            if plan.blocks:
                self._guard("record", self.cache_source.record, SentRequest.from_plan(plan))

    def _evict_from_sync(self, rid: str) -> None:
        if self.pilot.evict(rid):
            self.metrics.evictions.labels(self.cache_model).inc()

    def _guard(self, kind: str, call: Any, *args: Any) -> Any:
        """Run a sync-path call; a failure is counted and logged, never raised."""
        try:
            return call(*args)
        except Exception as exc:
            self._sync_failure(kind, f"{type(exc).__name__}: {exc}")
            return None

    def _sync_failure(self, kind: str, detail: str) -> None:
        self.metrics.sync_failures.labels(kind).inc()
        with self._state_lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1
            first = kind not in self._warned
            self._warned.add(kind)
        level = logging.WARNING if first else logging.DEBUG
        logger.log(level, "sync path failure (%s): %s; plans are still served", kind, detail)

    def _watch_engine_link(self) -> None:
        """Count an outage of the KV-event publisher (not connected for ``engine_grace_s``,
        from start or from a disconnection) once, and warn about the first one."""
        grace = self.config.engine_grace_s
        down_since: float | None = time.monotonic()
        reported = False
        while not self._stop.wait(0.1):
            connected = self.engine_connected
            now = time.monotonic()
            if connected:
                if reported:
                    logger.info("KV-event publisher connected again")
                down_since, reported = None, False
            elif down_since is None:
                down_since = now
            elif not reported and now - down_since >= grace:
                reported = True
                endpoints = ", ".join(self._kv_events().subscriber.endpoints)
                self._sync_failure(
                    "engine_unreachable",
                    f"KV-event publisher {endpoints} not connected for {grace} s",
                )

    def _kv_events(self) -> KVEventCacheState:
        assert isinstance(self.cache_source, KVEventCacheState)
        return self.cache_source

    def _spawn(self, name: str, target: Any) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    # ---------------------------------------------------------------------- snapshot, resync
    def _restore(self) -> list[dict[str, Any]]:
        """Load the snapshot into a new pilot; returns the restored entries (LRU first)."""
        path = self.config.snapshot_path
        if path is None:
            return []
        try:
            snapshot = load_snapshot(path)
            if snapshot is None:
                logger.info("no snapshot at %s: starting with an empty index", path)
                return []
            index = ContextIndex.restore(snapshot.index, max_requests=self.config.max_requests)
        except (OSError, ValueError) as exc:
            self._sync_failure("snapshot", f"cannot restore {str(path)!r}: {exc}")
            self._set_aside(Path(path))
            return []
        self.pilot = self._new_pilot(index)
        entries = [e for e in snapshot.index.get("requests", []) if e.get("rid") in index]
        logger.info("restored %d requests from snapshot %s", len(entries), path)
        self._downtime_s = max(0.0, time.time() - snapshot.saved_at)
        return entries

    @staticmethod
    def _set_aside(path: Path) -> None:
        """Keep an unreadable snapshot for inspection; the next save must not overwrite it."""
        if path.exists():
            aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
            with contextlib.suppress(OSError):
                path.rename(aside)
                logger.info("moved the unreadable snapshot to %s", aside)

    def _resync(self, restored: list[dict[str, Any]]) -> None:
        source = self.cache_source
        rids = [entry["rid"] for entry in restored]
        if isinstance(source, KVEventCacheState):
            self._restored = set(rids)
            self._resync_pending = True
            self._spawn("kv-events-resync", self._resync_with_events)
        elif isinstance(source, CapacityModel):
            for entry in restored:
                blocks = tuple(zip((int(b) for b in entry["blocks"]), entry["tokens"]))
                self._guard("resync", source.record, SentRequest(entry["rid"], blocks))
        elif isinstance(source, TTLModel):
            if self._downtime_s >= source.ttl_s:
                for rid in rids:
                    if self.pilot.evict(rid):
                        self.metrics.evictions.labels("resync").inc()
                logger.info(
                    "service was down %.0f s >= ttl %.0f s: evicted %d restored requests",
                    self._downtime_s,
                    source.ttl_s,
                    len(rids),
                )
            else:
                for entry in restored:
                    blocks = tuple(zip((int(b) for b in entry["blocks"]), entry["tokens"]))
                    self._guard("resync", source.record, SentRequest(entry["rid"], blocks))

    def _resync_with_events(self) -> None:
        """Wait until the subscriber has joined every rank's stream (its first batch and the
        replay of what preceded it applied: the mirror reflects the engine), then evict the
        restored rids the mirror does not hold."""
        source = self._kv_events()
        deadline = time.monotonic() + self.config.engine_grace_s
        reported = False
        while not all(source.subscriber.stats()["joined"]):
            if self._stop.wait(0.05):
                return
            if not reported and time.monotonic() > deadline:
                reported = True
                self._sync_failure(
                    "resync_timeout",
                    f"the KV-event stream not joined within {self.config.engine_grace_s} s of "
                    f"the restore; {len(self._restored)} restored requests are kept until it is",
                )
        stale = sorted(self._restored - source.mirror.cached_requests())
        evicted = sum(1 for rid in stale if self.pilot.evict(rid))
        self.metrics.evictions.labels("resync").inc(evicted)
        logger.info(
            "resync with the engine: %d restored requests still cached, %d evicted",
            len(self._restored) - len(stale),
            evicted,
        )
        self._restored = set()
        self._resync_pending = False

    def _save_periodically(self) -> None:
        interval = self.config.snapshot_interval_s
        assert interval is not None
        while not self._stop.wait(interval):
            self.save_snapshot()
