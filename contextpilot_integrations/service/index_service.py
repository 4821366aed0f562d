"""The shared index behind the HTTP service: its tenants' pilots, one engine link, the snapshot.

:class:`IndexService` holds what the HTTP layer (:mod:`.app`) serves, and is usable on its
own: one :class:`~contextpilot_integrations.core.pilot.ContextPilot` per tenant when the
service has tenant keys (the default ``"partitioned"`` isolation, :mod:`.tenants`), else one
for everyone; one :class:`~contextpilot_integrations.sync.engine_link.EngineLink` that follows
the engine for all of them (``ServiceConfig.cache_sync``) and routes each eviction to the pilot
of the rid's tenant; the metrics; the snapshot file (:mod:`.persistence`).

Tenants (docs/DESIGN.md, "Tenants from credentials"): every call takes ``caller``, the tenant
of the request's API key (``None`` without keys). A request whose ``scope.tenant`` names
another tenant is refused (:class:`~.tenants.TenantMismatchError`); rids are resolved within
the caller's tenant, so no call of one tenant reaches another tenant's requests or
conversations.

Failures of the sync path and of the snapshot file are absorbed, counted
(``stats()["sync"]["failures"]``, ``contextpilot_sync_failures_total``) and logged once; plans
are served all the same (docs/DESIGN.md, "Never break a request"). Restored requests were
indexed by another process, so :meth:`IndexService.start` asks the engine link to resync with
what the engine still caches (``resync_pending`` on ``/health`` meanwhile). The boot id
(:attr:`IndexService.boot_id`, random per service made) goes with every answer, so a client
tells a restarted service (:mod:`contextpilot_integrations.client.conversations`).

Thread-safe: every method may be called from any thread. :meth:`stop` is bounded
(``shutdown_timeout_s``): a call stuck in the engine link or a lock does not keep the service
from saving and stopping.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from contextpilot_integrations import __version__
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import BatchPlan, Plan
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import PlanRequest, check_batch
from contextpilot_integrations.core.window.planning_window import PlanningWindow
from contextpilot_integrations.service.in_flight import PlansInFlight
from contextpilot_integrations.service.metrics import ServiceMetrics
from contextpilot_integrations.service.partitions import Partition, Partitions, sum_stats
from contextpilot_integrations.service.persistence import Restored, ServiceSnapshots
from contextpilot_integrations.service.service_config import ServiceConfig
from contextpilot_integrations.service.tenants import TenantMismatchError
from contextpilot_integrations.sync.configuration import CacheSyncConfig
from contextpilot_integrations.sync.engine_link import EngineLink

__all__ = ["IndexService", "ServiceClosingError"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

FORGET_WAIT_S = 5.0
"""Beyond the planning window, the longest a forget waits for the plans of its conversation
that arrived before it (seconds; :mod:`.in_flight`)."""


class ServiceClosingError(RuntimeError):
    """The service is stopping: it plans and forgets nothing more (HTTP 503)."""


class IndexService:
    """The tenants' context indexes with one engine link, metrics and a snapshot.

    Made, it holds the restored pilots (``snapshot_path``); :meth:`start` starts the engine
    link, resyncs the restored requests with the engine and starts the snapshot timer;
    :meth:`stop` stops planning, the timer and the link and saves the final snapshot. It plans
    before :meth:`start` as well.

    Args:
        config: the settings.

    Attributes:
        boot_id: 16 random hex digits, new for every service made (module docstring).
        in_flight: the plans in flight, which a forget of their conversation waits for (the
            HTTP layer takes each plan's ticket as its request arrives; :mod:`.in_flight`).

    Raises:
        ValueError: an invalid configuration (the message names the field).
    """

    def __init__(self, config: ServiceConfig | None = None) -> None:
        self.config = config or ServiceConfig()
        self.boot_id = secrets.token_hex(8)
        self.tenancy = self.config.tenancy
        self.metrics = ServiceMetrics(self._service_stats)
        self.in_flight = PlansInFlight(self.config.window_ms / 1000.0 + FORGET_WAIT_S)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0  # plans and forgets in flight
        self._closing = False
        self._failures: dict[str, int] = {}  # only without an engine link
        self._warned: set[str] = set()
        self._timer_stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._started = False
        sync = self.config.cache_sync
        assert sync is None or isinstance(sync, CacheSyncConfig)
        self.engine = EngineLink(sync).bind(self._engine_evicted) if sync else None
        self._restored: Restored | None = None
        self._snapshots: ServiceSnapshots | None = None
        path = self.config.snapshot_path
        if path is None:
            self._partitions = self._new_partitions()
        else:
            self._snapshots = ServiceSnapshots(path, self._failure)
            self._partitions, self._restored = self._snapshots.restore(self._new_partitions)
        # One planning window per distinct pilot (a shared index shares its window).
        self._windows: dict[ContextPilot, PlanningWindow] = {}
        if self.config.window_ms > 0:
            for _, _, pilot in self._partitions.sections():
                self._windows[pilot] = PlanningWindow(
                    pilot, window_ms=self.config.window_ms, max_batch=self.config.window_max_batch
                )

    # ----------------------------------------------------------------------------------------
    # Public API: planning
    # ----------------------------------------------------------------------------------------

    @property
    def layout(self) -> PromptLayout:
        """The layout plans are rendered with (the same for every tenant)."""
        return self._partitions.sections()[0][2].layout

    def pilot_of(self, caller: str | None = None) -> ContextPilot:
        """The pilot that plans ``caller``'s requests (shared by all but when partitioned).

        Raises:
            TenantMismatchError: ``caller`` is not a tenant of this service (or None on a
                service with keys).
        """
        return self._partitions.of(caller).pilot

    def planner_of(self, caller: str | None = None) -> ContextPilot | PlanningWindow:
        """What plans ``caller``'s single requests: the planning window in front of its pilot
        (``window_ms`` > 0), else the pilot (errors as :meth:`pilot_of`)."""
        pilot = self._partitions.of(caller).pilot
        return self._windows.get(pilot, pilot)

    def plan(
        self, request: PlanRequest, *, caller: str | None = None, ticket: int | None = None
    ) -> Plan:
        """``ContextPilot.plan`` of one request of ``caller`` (the tenant of its API key;
        None on a service without keys); ``ticket``: the request's :attr:`in_flight` ticket,
        taken as it arrived (``None``: one is taken now).

        Returns:
            The plan; its ``rid`` is the engine-facing rid (the tenant's tag, a dot, the
            request's rid or a new one) and its ``cache_salt`` the tenant's.

        Raises:
            TypeError / ValueError: as ``ContextPilot.plan``.
            RidConflictError: the rid is already indexed or being planned (in the tenant's
                namespace).
            TenantMismatchError: ``request.scope.tenant`` is another tenant's.
            ServiceClosingError: the service is stopping.
        """
        tenant = self._partitions.of(caller)
        request = tenant.admit(request)
        planner = self.planner_of(caller)
        with self.in_flight.planning(_conversations([request]), ticket), self._planning():
            plan = planner.plan(request.query, request.blocks, rid=request.rid, scope=request.scope)
        self.metrics.plans.labels("single").inc()
        return plan

    def plan_batch(
        self,
        requests: Sequence[PlanRequest],
        *,
        caller: str | None = None,
        ticket: int | None = None,
    ) -> BatchPlan:
        """``ContextPilot.plan_batch`` of ``caller``'s requests (``ticket`` and errors as
        :meth:`plan`; the batch's own as ``check_batch``)."""
        tenant = self._partitions.of(caller)
        batch = [
            tenant.admit(request, f"requests[{i}].")
            for i, request in enumerate(check_batch(requests))
        ]
        with self.in_flight.planning(_conversations(batch), ticket), self._planning():
            plans = tenant.pilot.plan_batch(batch)
        self.metrics.plans.labels("batch").inc(len(plans.plans))
        return plans

    # ----------------------------------------------------------------------------------------
    # Public API: index and conversation operations
    # ----------------------------------------------------------------------------------------

    def evict(self, rid: str, *, caller: str | None = None) -> bool:
        """Drop ``caller``'s ``rid`` from the index (asked by the app; counted as an ``api``
        eviction); False if the tenant has no such rid.

        Raises:
            TypeError / ValueError: a rid that is not a str of at most 512 characters.
        """
        tenant = self._partitions.of(caller)
        evicted = tenant.pilot.evict(tenant.engine_rid(rid))
        if evicted:
            with self._lock:
                tenant.api_evictions += 1
        return evicted

    def forget_conversation(
        self, tenant: str, conversation_id: str, *, caller: str | None = None
    ) -> bool:
        """Drop a conversation's de-duplication records; False if it was not held. Its turn
        numbers are kept (a tombstone), so numbering goes on after it. It first waits for the
        plans of the conversation that arrived before it (bounded, :mod:`.in_flight`), so
        none records a turn after it: a client that gave up on a plan forgets the
        conversation, and its next plan must not hint at that turn (docs/DESIGN.md, "Sure
        hints").

        Args:
            tenant: the conversation's tenant as the request names it (``""``: the caller's;
                another tenant's name is refused).
            conversation_id: the conversation.
            caller: the tenant of the request's API key (None without keys).

        Raises:
            TypeError / ValueError: a bad ``tenant`` or ``conversation_id``.
            TenantMismatchError: ``tenant`` is another tenant's.
            ServiceClosingError: the service is stopping.
        """
        owner = self._partitions.of(caller)
        if owner.name is not None:
            if tenant and tenant != owner.name:
                raise TenantMismatchError(
                    f"tenant {tenant!r:.80} is not the tenant of this API key "
                    f"({owner.name!r:.80}); leave it empty (the key decides)"
                )
            tenant = owner.name
        with self._planning():
            self.in_flight.wait_before_forget((tenant, conversation_id))
            return owner.pilot.deduplicator.store.forget(tenant, conversation_id)

    def record_usage(
        self,
        rid: str,
        prompt_tokens: int,
        cached_tokens: int,
        *,
        cache_write_tokens: int | None = None,
        caller: str | None = None,
    ) -> bool:
        """``ContextPilot.record_usage`` of ``caller``'s ``rid``: the engine's ``usage`` of one
        sent request; a hit marks the request as just used (index LRU, capacity and TTL
        models).

        Returns:
            Whether the tenant's ``rid`` is indexed.

        Raises:
            TypeError / ValueError: as ``ContextPilot.record_usage``.
        """
        tenant = self._partitions.of(caller)
        return tenant.pilot.record_usage(
            tenant.engine_rid(rid), prompt_tokens, cached_tokens, cache_write_tokens
        )

    def stats(self, *, caller: str | None = None) -> dict[str, Any]:
        """``caller``'s pilot's ``ContextPilot.stats()`` (the index's figures at the top level,
        ``index``, ``conversations``, ``usage``: the tenant's own when partitioned, the shared
        index's otherwise), with ``sync`` (the one engine link's: ``cache_model``,
        ``engine_connected``, ``resync_pending``, ``failures``, ``evictions``, ``source``;
        without one ``cache_model="none"`` and the service's own ``failures``) and ``service``
        (``version``, ``isolation``, the tenant's ``evictions`` asked for: ``{"api": n}``,
        ``snapshot`` figures, and with a planning window its ``window`` figures). ``sync`` and
        ``service.snapshot`` are service-wide counts; ``totals`` is :meth:`usage`'s, the
        caller's own."""
        tenant = self._partitions.of(caller)
        stats = self._pilot_stats(tenant.pilot)
        stats["totals"] = self._usage_of(tenant)
        with self._lock:
            evictions = (
                tenant.api_evictions
                if self.tenancy.partitioned or tenant.name is None
                else sum(p.api_evictions for p in self._partitions)
            )
        stats["sync"] = self._sync_stats()
        stats["service"] = self._service_section({"api": evictions})
        window = self._windows.get(tenant.pilot)
        if window is not None:
            stats["service"]["window"] = window.stats()
        return stats

    def usage(self, *, caller: str | None = None) -> dict[str, Any]:
        """``caller``'s running totals (``ContextPilot.totals`` of its tenant: ``plans``,
        ``tokens_removed``, ``blocks_replaced``, ``sub_blocks_replaced``, ``usage_reports``,
        ``prompt_tokens``, ``cached_tokens`` and ``conversations``:
        ``{tenant: {conversation_id: figures}}``), with ``tenant``: the caller's own
        conversations only, in every isolation mode (a shared index keeps them per tenant
        too). Without keys (``tenant`` ``None``) every conversation of the one pilot, whose
        tenants are labels of the body.

        Raises:
            TenantMismatchError: ``caller`` is not a tenant of this service.
        """
        return self._usage_of(self._partitions.of(caller))

    @property
    def cache_model(self) -> str:
        """The engine link's kind (``kv-events``, ``capacity``, ``ttl``), or ``none``."""
        return self.engine.kind if self.engine is not None else "none"

    @property
    def engine_connected(self) -> bool | None:
        """Whether the KV-event subscriber is connected to every rank's publisher; None
        without an event stream."""
        return self.engine.engine_connected if self.engine is not None else None

    @property
    def resync_pending(self) -> bool:
        """True while restored requests still wait for the engine's state."""
        return self.engine.resync_pending if self.engine is not None else False

    # ----------------------------------------------------------------------------------------
    # Public API: lifecycle
    # ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """(Re)start the engine link, resync the restored requests with the engine (once),
        start the snapshot timer. Idempotent.

        Raises:
            zmq.ZMQError: a malformed KV-event endpoint (an engine that is merely down is not
                an error: the subscriber connects when it comes up).
        """
        if self._started:
            return
        with self._lock:
            self._closing = False
        if self.engine is not None:
            self.engine.start()
            if self._restored is not None and self._restored[0]:
                self.engine.resync(*self._restored)
        self._restored = None
        if self.config.snapshot_path is not None and self.config.snapshot_interval_s:
            self._timer_stop.clear()
            self._timer = threading.Thread(
                target=self._save_periodically, name="snapshot-timer", daemon=True
            )
            self._timer.start()
        self._started = True

    def stop(self) -> None:
        """Stop planning, the snapshot timer and the engine link, then save the final
        snapshot; idempotent after a :meth:`start`.

        Bounded by ``shutdown_timeout_s`` in all: plans still in flight when it runs out make
        the save a checkpoint (they may record turns after it); a step that does not finish in
        time (a stuck engine link, a lock held for ever) is left behind, logged.
        """
        if not self._started:
            return
        # The budget: half for the plans in flight, a quarter for the timer and the engine
        # link, the rest (at least a quarter) for the save.
        budget = self.config.shutdown_timeout_s
        started = time.monotonic()
        with self._lock:
            self._closing = True
            while self._active and time.monotonic() < started + budget / 2:
                self._idle.wait(max(0.0, started + budget / 2 - time.monotonic()))
            drained = self._active == 0
        if not drained:
            logger.warning("stopping with plans still running: the snapshot is a checkpoint")
        link_deadline = time.monotonic() + budget / 4
        self._timer_stop.set()
        if self._timer is not None:
            self._timer.join(max(0.0, link_deadline - time.monotonic()))
            self._timer = None
        if self.engine is not None:
            _within(link_deadline, self.engine.stop, "stopping the engine link")
        if self._snapshots is not None:
            saved = _within(
                started + budget, lambda: self.save_snapshot(final=drained), "saving the snapshot"
            )
            if saved and drained:
                self._snapshots.stopped_cleanly()
        self._started = False

    def save_snapshot(self, *, final: bool = False) -> bool:
        """Save every pilot's state to ``snapshot_path`` now; False when none is set or saving
        failed (counted, logged). Calls that arrive while a save runs share the next one.

        Args:
            final: planning has stopped (at shutdown): the restored conversation stores will
                miss no turn. Otherwise the save is a checkpoint.
        """
        if self._snapshots is None:
            return False
        return self._snapshots.save(self._partitions, cache_model=self.cache_model, final=final)

    # ----------------------------------------------------------------------------------------
    # Internals: tenants and calls
    # ----------------------------------------------------------------------------------------

    @contextmanager
    def _planning(self) -> Iterator[None]:
        """A call that records conversation state (a plan, a forget): refused once stopping,
        so the final snapshot misses none; counted while in flight."""
        with self._lock:
            if self._closing:
                raise ServiceClosingError("the index service is stopping")
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    self._idle.notify_all()

    def _engine_evicted(self, rid: str) -> bool:
        """The engine link's ``on_evict``: drop ``rid`` from its tenant's index."""
        pilot = self._partitions.route(rid)
        return pilot.index.evict(rid) if pilot is not None else False

    # ----------------------------------------------------------------------------------------
    # Internals: statistics
    # ----------------------------------------------------------------------------------------

    @staticmethod
    def _pilot_stats(pilot: ContextPilot) -> dict[str, Any]:
        stats = pilot.stats()
        stats.pop("sync", None)
        return stats

    @staticmethod
    def _usage_of(partition: Partition) -> dict[str, Any]:
        """:meth:`usage` of ``partition`` (its tenant's totals; every tenant's without
        keys, the per-tenant section left out)."""
        if partition.name is None:
            totals = partition.pilot.totals()
            totals.pop("tenants", None)
        else:
            totals = partition.pilot.totals(partition.name)
        return {"tenant": partition.name, **totals}

    def _sync_stats(self) -> dict[str, Any]:
        if self.engine is not None:
            return self.engine.stats()
        with self._lock:
            failures = dict(self._failures)
        return {
            "cache_model": "none",
            "engine_connected": None,
            "resync_pending": False,
            "failures": failures,
            "evictions": {},
        }

    def _service_section(self, evictions: dict[str, int]) -> dict[str, Any]:
        snapshot = self._snapshots.figures() if self._snapshots is not None else {}
        return {
            "version": __version__,
            "isolation": self.tenancy.mode,
            "evictions": evictions,
            "snapshot": snapshot,
        }

    def _service_stats(self) -> dict[str, Any]:
        """Every pilot's figures added up (the metrics' source: service-wide counts; the
        totals without their per-tenant and per-conversation sections)."""
        parts = [self._pilot_stats(p) for _, _, p in self._partitions.sections()]
        for part in parts:
            part["totals"] = {
                k: v for k, v in part["totals"].items() if k not in ("tenants", "conversations")
            }
        stats = sum_stats(parts)
        with self._lock:
            evictions = sum(p.api_evictions for p in self._partitions)
        stats["sync"] = self._sync_stats()
        stats["service"] = self._service_section({"api": evictions})
        return stats

    # ----------------------------------------------------------------------------------------
    # Internals: failures, pilots
    # ----------------------------------------------------------------------------------------

    def _failure(self, kind: str, detail: str) -> None:
        """A failure the service absorbs: counted by the engine link (or here without one),
        logged once at warning level."""
        if self.engine is not None:
            self.engine.failure(kind, detail)
            return
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1
            first = kind not in self._warned
            self._warned.add(kind)
        level = logging.WARNING if first else logging.DEBUG
        logger.log(level, "sync path failure (%s): %s; plans are still served", kind, detail)

    def _new_partitions(self) -> Partitions:
        """Empty pilots: one per tenant when partitioned, else one for all; each records,
        touches and forgets through the service's one engine link (the service binds, starts
        and stops it)."""

        def pilot(tenant: str | None) -> ContextPilot:
            salt = self.tenancy.cache_salt(tenant) if tenant is not None else None
            return ContextPilot(
                layout=self.config.layout,
                max_requests=self.config.max_requests,
                cache_salt=salt,
                engine=self.engine,
                # A shared pilot keeps every tenant's totals (the usage endpoint's figures).
                stats_tenants=max(1024, len(self.tenancy.tenants)),
            )

        return Partitions(self.tenancy, pilot)

    def _save_periodically(self) -> None:
        interval = self.config.snapshot_interval_s
        assert interval is not None
        while not self._timer_stop.wait(interval):
            self.save_snapshot(final=False)


def _conversations(requests: Sequence[PlanRequest]) -> list[tuple[str, str]]:
    """The conversations (store keys) whose turns ``requests`` record."""
    return [key for request in requests if (key := request.scope.conversation) is not None]


def _within(deadline: float, call: Callable[[], T], what: str) -> T | None:
    """``call()`` on a helper thread, waited for until ``deadline``; None when it did not
    finish in time (it is left running, logged) or raised (logged)."""
    result: list[T] = []

    def run() -> None:
        try:
            result.append(call())
        except Exception:
            logger.exception("%s failed", what)

    helper = threading.Thread(target=run, name=what, daemon=True)
    helper.start()
    helper.join(max(0.0, deadline - time.monotonic()))
    if helper.is_alive():
        logger.warning("%s did not finish within the shutdown timeout; going on", what)
        return None
    return result[0] if result else None
