"""The engine link: one cache-state source, what was sent, evictions, and failures absorbed.

The pilot (``ContextPilot(engine=EngineLink({...}))``), the router's replicas
(``ReplicaRouter(..., link_factory=EngineLink)``), the index service and the benchmark follow
the engine through an :class:`EngineLink` built from one configuration mapping
(:class:`~contextpilot_integrations.sync.configuration.CacheSyncConfig`):

- ``{"kind": "kv-events", "endpoint": ..., "replay_endpoint": ...}``: the engine's own KV-cache
  events (SGLang, vLLM), attributed to request ids by the echoed ``session_id`` or by token
  matching (:class:`~contextpilot_integrations.sync.kv_event_source.KVEventSource`);
- ``{"kind": "capacity", "capacity_tokens": N}``: a token budget with LRU, for engines that
  publish nothing;
- ``{"kind": "ttl", "provider": "openai" | "anthropic" | ...}``: a time-to-live, for hosted APIs.

Every source ends in ``on_evict(rid)``, bound by the link's owner (:meth:`EngineLink.bind`).
With several engine replicas there is one link per replica
(:class:`~contextpilot_integrations.core.replicas.routing.ReplicaRouter`), each evicting from
its own replica's index; ``on_session(rid)`` says that a request reached this link's engine
(its rid echoed on a stored block), and ``on_health(up)`` that the engine's KV-event publisher
has been unreachable for ``engine_grace_s`` (``False``) or is connected again (``True``).

The link records each planned request (:meth:`EngineLink.record`), passes cache hits on
(:meth:`~EngineLink.touch`), and re-establishes what the engine still holds after a restore
(:meth:`~EngineLink.resync`). The sync path never breaks a request (docs/DESIGN.md, "Never
break a request"): a source or an ``on_evict`` that raises, an unreachable engine, a resync
that cannot complete is counted (``stats()["failures"]``, by kind), logged once per kind at
warning level (later ones at debug), and never raised to the caller."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from contextpilot_integrations.sync.cache_state_source import CacheStateSource, SentRequest
from contextpilot_integrations.sync.configuration import CacheSyncConfig, build_cache_state_source
from contextpilot_integrations.sync.kv_event_source import KVEventSource
from contextpilot_integrations.sync.ttl_model import TTLModel

if TYPE_CHECKING:
    from contextpilot_integrations.core.plan import Plan

__all__ = ["EngineLink", "RestoredRequest"]

logger = logging.getLogger(__name__)

RestoredRequest = tuple[str, Sequence[tuple[int, int]]]
"""A request restored from a snapshot: ``(rid, ((block_id, tokens), ...))`` in prompt order."""


class EngineLink:
    """Follows one engine's prefix cache and reports its evictions (implements
    :class:`~contextpilot_integrations.core.engine_link_protocol.EngineLinkProtocol`).

    Args:
        config: the cache-state source, as :meth:`CacheSyncConfig.from_mapping` takes it.

    The owner routes the engine's news with :meth:`bind` (a pilot given an unbound link binds
    it to its own index); an unbound link evicts nothing.

    Raises:
        ValueError: an invalid configuration (the message names the field).

    Thread-safe. ``on_evict`` runs on the source's thread (the KV-event subscriber, the TTL
    timer, the resync waiter) or on the caller's (the capacity model).
    """

    def __init__(self, config: Mapping[str, Any] | CacheSyncConfig) -> None:
        self.config = (
            config if isinstance(config, CacheSyncConfig) else CacheSyncConfig.from_mapping(config)
        )
        self.config.validate()
        self.kind: str = self.config.kind
        self._on_evict: Callable[[str], bool] | None = None
        self._on_session: Callable[[str], object] | None = None
        self._on_health: Callable[[bool], object] | None = None
        self.source: CacheStateSource = build_cache_state_source(
            self.config, self._evicted, on_session=self._session
        )
        self._lock = threading.Lock()
        self._lifecycle = threading.Lock()
        self._failures: dict[str, int] = {}
        self._evictions: dict[str, int] = {}
        self._warned: set[str] = set()
        self._restored: set[str] = set()
        self._resync_waiting = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False

    # ------------------------------------------------------------------ Public API: owner
    def bind(
        self,
        on_evict: Callable[[str], bool],
        *,
        on_session: Callable[[str], object] | None = None,
        on_health: Callable[[bool], object] | None = None,
    ) -> EngineLink:
        """Route the engine's news to the link's owner (once, before :meth:`start`); returns
        self.

        Args:
            on_evict: ``on_evict(rid) -> bool``, called when the engine dropped ``rid``'s
                prefix (e.g. ``ContextIndex.evict``); True when the rid was indexed (only
                those count as evictions). An exception is counted as a failure of kind
                ``evict``.
            on_session: ``on_session(rid)``, called on the subscriber's thread with each rid
                the engine echoed as ``session_id`` on a stored block (KV events only).
            on_health: ``on_health(up)``, called on the link's watch thread with False once the
                KV-event publisher has been unconnected for ``engine_grace_s`` (when the outage
                is counted), and with True when it connects again after that. An exception is
                counted as a failure of kind ``health``.

        Raises:
            ValueError: the link is bound already (it has an owner).
        """
        with self._lock:
            if self._on_evict is not None:
                raise ValueError("engine link is bound already: one owner binds its callbacks")
            self._on_evict = on_evict
            self._on_session = on_session
            self._on_health = on_health
        return self

    @property
    def bound(self) -> bool:
        """Whether :meth:`bind` was called."""
        return self._on_evict is not None

    # ------------------------------------------------------------------ Public API: lifecycle
    def start(self) -> EngineLink:
        """Start the source (the subscriber thread, the TTL timer) and, for KV events, the
        watch that counts an unreachable publisher (and a resync still waiting from before a
        :meth:`stop`). Idempotent; returns self.

        Raises:
            zmq.ZMQError: a malformed KV-event endpoint (an engine that is merely down is not
                an error: the subscriber connects when it comes up).
        """
        with self._lifecycle:
            if self._started:
                return self
            self._stop.clear()
            self.source.start()
            if isinstance(self.source, KVEventSource):
                self._spawn("engine-link-watch", self._watch_publisher)
            self._started = True
            self._wait_for_events_if_restored()
        return self

    def stop(self) -> None:
        """Stop the source and the link's threads (idempotent). Restored requests still
        waiting for the engine's state keep waiting: a later :meth:`start` goes on."""
        with self._lifecycle:
            if not self._started:
                return
            self._stop.set()
            for thread in self._threads:
                thread.join(5.0)
            self._threads.clear()
            with self._lock:
                self._resync_waiting = False
            self._guard("stop", self.source.stop)
            self._started = False

    def __enter__(self) -> EngineLink:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ Public API: requests
    def record(self, plans: Iterable[Plan]) -> None:
        """The plans' requests were sent to the engine (their shown blocks, in prompt order);
        a plan that shows no block is not recorded."""
        for plan in plans:
            if plan.blocks:
                self._guard("record", self.source.record, SentRequest.from_plan(plan))

    def register_tokens(
        self,
        rid: str,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Give the prompt's token ids (engine tokenizer) of a sent request, for attribution of
        KV events by token matching (engines that do not echo ``session_id``), in the cache
        namespace of its ``cache_salt`` and LoRA adapter; nothing to do for the other
        sources."""
        if isinstance(self.source, KVEventSource):
            register = functools.partial(
                self.source.mirror.register_request, cache_salt=cache_salt, lora_name=lora_name
            )
            self._guard("record", register, rid, token_ids)

    def touch(self, rid: str) -> None:
        """The engine served ``rid`` from its cache (refreshes an LRU or TTL model)."""
        self._guard("touch", self.source.touch, rid)

    def forget(self, rid: str) -> None:
        """Stop following ``rid`` without an eviction callback (the index dropped it)."""
        self._guard("forget", self.source.forget, rid)

    def reset(self) -> list[str]:
        """Forget what the engine is believed to cache (its replica went down): a KV-event
        mirror drops every block, evicting each attributed request through ``on_evict``; the
        other sources keep their model. Returns the rids the mirror held."""
        if not isinstance(self.source, KVEventSource):
            return []
        return list(self._guard("reset", self.source.mirror.resync) or [])

    def resync(self, restored: Sequence[RestoredRequest], downtime_s: float) -> None:
        """Re-establish what the engine still caches of requests restored from a snapshot.

        Args:
            restored: the restored requests, least recently used first.
            downtime_s: seconds between the snapshot and now.

        - KV events: wait (on a thread, while the link runs) until the subscriber has joined
          every rank's stream (its replay re-attributes cached blocks to the restored rids by
          their echoed ``session_id``), then evict the restored rids the mirror does not hold
          (cause ``resync``); until then :attr:`resync_pending` is True. A rank that has not
          joined ``engine_grace_s`` after the restore (a data-parallel rank that never
          publishes, a quiet engine without a replay socket, an engine that is down) does not
          hold the resync up for good: it finishes then, conservatively, over the ranks that
          did join: every restored rid that no joined rank holds is evicted (less believed
          reuse, never wrong reuse), and a failure of kind ``resync_timeout`` is counted.
        - capacity model: record them again, least recently used first (the budget evicts the
          oldest when they do not fit).
        - TTL model: after ``downtime_s >= ttl_s`` every one has expired and is evicted (cause
          ``resync``); otherwise they are recorded again (optimistic by at most the downtime).
        """
        source = self.source
        if isinstance(source, KVEventSource):
            with self._lock:
                self._restored.update(rid for rid, _ in restored)
            with self._lifecycle:
                if self._started:
                    self._wait_for_events_if_restored()
            return
        if isinstance(source, TTLModel) and downtime_s >= source.ttl_s:
            evicted = sum(1 for rid, _ in restored if self._evicted(rid, cause="resync"))
            logger.info(
                "down %.0f s >= ttl %.0f s: evicted %d restored requests",
                downtime_s,
                source.ttl_s,
                evicted,
            )
            return
        for rid, blocks in restored:
            self._guard("resync", source.record, SentRequest(rid, tuple(blocks)))

    # ------------------------------------------------------------------ Public API: state
    @property
    def engine_connected(self) -> bool | None:
        """Whether the KV-event subscriber is connected to every rank; None without events."""
        if not isinstance(self.source, KVEventSource):
            return None
        return all(self.source.subscriber.stats()["connected"])

    @property
    def resync_pending(self) -> bool:
        """True while restored requests still wait for the engine's state (KV events)."""
        with self._lock:
            return bool(self._restored)

    def stats(self) -> dict[str, Any]:
        """``cache_model`` (the kind), ``engine_connected``, ``resync_pending``, ``failures``
        (kind -> count), ``evictions`` (cause -> rids evicted that were indexed: the kind, or
        ``resync``) and the source's own counters (``source``; empty if they cannot be read)."""
        source = self._guard("stats", self.source.stats) or {}
        with self._lock:
            failures = dict(self._failures)
            evictions = dict(self._evictions)
            pending = bool(self._restored)
        return {
            "cache_model": self.kind,
            "engine_connected": self.engine_connected,
            "resync_pending": pending,
            "failures": failures,
            "evictions": evictions,
            "source": source,
        }

    def failure(self, kind: str, detail: str) -> None:
        """Count a failure of the sync path and log it (the first of each kind at warning
        level); for failures the owner absorbs (e.g. a snapshot that cannot be saved)."""
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1
            first = kind not in self._warned
            self._warned.add(kind)
        level = logging.WARNING if first else logging.DEBUG
        logger.log(level, "sync path failure (%s): %s; plans are still served", kind, detail)

    # ------------------------------------------------------------------ internals
    def _evicted(self, rid: str, *, cause: str | None = None) -> bool:
        """``on_evict(rid)``, counted by cause when the rid was indexed; never raises."""
        on_evict = self._on_evict
        if on_evict is None:
            return False
        try:
            evicted = bool(on_evict(rid))
        except Exception as exc:
            self.failure("evict", f"on_evict({rid!r}) raised {type(exc).__name__}: {exc}")
            return False
        if evicted:
            cause = cause or self.kind
            with self._lock:
                self._evictions[cause] = self._evictions.get(cause, 0) + 1
        return evicted

    def _session(self, rid: str) -> None:
        # The source counts what this raises (``session_callback_errors``).
        on_session = self._on_session
        if on_session is not None:
            on_session(rid)

    def _health(self, up: bool) -> None:
        on_health = self._on_health
        if on_health is not None:
            self._guard("health", on_health, up)

    def _guard(self, kind: str, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except Exception as exc:
            self.failure(kind, f"{type(exc).__name__}: {exc}")
            return None

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _wait_for_events_if_restored(self) -> None:
        """Start the resync waiter unless one runs or nothing waits (lifecycle lock held)."""
        with self._lock:
            if not self._restored or self._resync_waiting:
                return
            self._resync_waiting = True
        self._spawn("kv-events-resync", self._resync_with_events)

    def _watch_publisher(self) -> None:
        """Count an outage of the KV-event publisher (not connected for ``engine_grace_s``,
        from start or from a disconnection) once per outage. A connection between two looks
        (the subscriber's ``connects`` counter moved) ends an outage too."""
        assert isinstance(self.source, KVEventSource)
        subscriber = self.source.subscriber
        grace = self.config.engine_grace_s
        down_since: float | None = time.monotonic()
        reported = False
        connects = subscriber.stats()["connects"]
        while not self._stop.wait(0.1):
            now = time.monotonic()
            stats = subscriber.stats()
            connected = all(stats["connected"])
            reconnected, connects = stats["connects"] != connects, stats["connects"]
            if connected or reconnected:
                if reported:
                    logger.info("KV-event publisher connected again")
                    self._health(True)
                down_since, reported = (None if connected else now), False
            elif down_since is None:
                down_since = now
            elif not reported and now - down_since >= grace:
                reported = True
                self.failure(
                    "engine_unreachable",
                    f"KV-event publisher {', '.join(subscriber.endpoints)} not connected "
                    f"for {grace} s",
                )
                self._health(False)

    def _resync_with_events(self) -> None:
        source = self.source
        assert isinstance(source, KVEventSource)
        grace = self.config.engine_grace_s
        deadline = time.monotonic() + grace
        joined = source.subscriber.stats()["joined"]
        while not all(joined) and time.monotonic() < deadline:
            if self._stop.wait(0.05):
                return  # stopped: the restored rids wait for the next start
            joined = source.subscriber.stats()["joined"]
        cached = source.mirror.cached_requests()
        with self._lock:
            restored, self._restored = self._restored, set()
            self._resync_waiting = False
        stale = sorted(restored - cached)
        evicted = sum(1 for rid in stale if self._evicted(rid, cause="resync"))
        if not all(joined):
            missing = [rank for rank, done in enumerate(joined) if not done]
            self.failure(
                "resync_timeout",
                f"KV-event rank(s) {missing} not joined within {grace} s of the restore; "
                f"resync finished without them: {len(stale)} restored requests that no "
                "joined rank holds are evicted",
            )
        logger.info(
            "resync with the engine: %d restored requests still cached, %d evicted",
            len(restored) - len(stale),
            evicted,
        )
