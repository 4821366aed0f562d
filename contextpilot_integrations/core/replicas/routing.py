"""A planner over several engine replicas: the replica is chosen together with the order.

Gateways in front of N replicas (SMG's ``cache_aware``, llm-d, Dynamo) route the prompt as it is
given; a pilot over one index assumes one engine, so a request aligned to a prefix cached on
replica A and sent to B misses while the index believes a hit. :class:`ReplicaRouter` keeps one
:class:`~.pilot.ContextPilot` per replica, its own index and its own engine link fed by that
replica's KV events (:mod:`.replica_fleet`), and plans each request on the replica whose index
holds the longest aligned prefix of it, within the bounded-imbalance rule over the replicas'
loads; a batch is partitioned across the replicas and the parts' schedules interleaved
(:mod:`.replica_planning`). Each plan names its replica and how to reach it: ``routing_key``
(``"gateway"`` mode: a gateway header, ``engine_fields.engine_headers``) or ``base_url``
(``"direct"`` mode). Conversations de-duplicate alike wherever they go: the replicas' pilots
share one conversation store.

The router meets the planner contract (:mod:`.planner_protocol`), so every face takes it as it
takes a pilot. From the engines it learns where a gateway put each routing key (a request that
landed elsewhere than planned is moved to that replica's index) and which replica went down (its
requests evicted, routing goes on with the others): :mod:`.replica_fleet`.

Replicas are added and removed at run time (:meth:`ReplicaRouter.add_replica`,
:meth:`~ReplicaRouter.remove_replica`). Thread-safe; the per-request work is bounded by the
request's size times the number of replicas (docs/DESIGN.md, "Hot path").
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from contextpilot_integrations.core.blocks import ApproxTokenCounter, TokenCounter
from contextpilot_integrations.core.conversations.dedup import Deduplicator
from contextpilot_integrations.core.engine_link_protocol import EngineLinkProtocol
from contextpilot_integrations.core.index.context_index import ContextIndex
from contextpilot_integrations.core.ordering.ordering_config import OrderingConfig
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import BatchPlan, Plan
from contextpilot_integrations.core.planner_protocol import ThreadedAsyncTwins
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.replicas.replica_fleet import LinkFactory, ReplicaFleet
from contextpilot_integrations.core.replicas.replica_load import LoadBoard
from contextpilot_integrations.core.replicas.replica_planning import ReplicaChoice, ReplicaPlanning
from contextpilot_integrations.core.replicas.route_keys import RouteKeys
from contextpilot_integrations.core.replicas.routing_config import (
    LoadKind,
    ReplicaSpec,
    RouterConfig,
    RoutingMode,
)
from contextpilot_integrations.core.request import NO_SCOPE, PlanRequest, Scope
from contextpilot_integrations.core.usage import UsageCounter

__all__ = ["ReplicaRouter"]


class ReplicaRouter(ThreadedAsyncTwins):
    """Plans requests over several engine replicas (module docstring).

    Args:
        replicas: :class:`~.routing_config.ReplicaSpec` or their mappings
            (``{"name", "base_url", "cache_sync"}``); at least one, names unique. A replica with
            ``cache_sync`` gets its own engine link, ``link_factory(cache_sync)``, started here.
        link_factory: builds a replica's engine link from its ``cache_sync``
            (:data:`~.replica_fleet.LinkFactory`): ``EngineLink`` from
            ``contextpilot_integrations.sync.engine_link`` (the ``sync`` extra); needed only
            when a replica has ``cache_sync``.
        mode, load, max_imbalance, load_window, in_flight_timeout_s, key_prefix: the routing
            rule (:class:`~.routing_config.RouterConfig`).
        layout, token_counter: shared by every replica's pilot.
        deduplicator: the conversation store's de-duplicator, shared by the replicas; default
            a new one with the layout's labels and the token counter.
        max_requests: the LRU bound of each replica's index.
        max_routes: requests whose route is remembered (for usage, re-mapping, routing keys).
        max_conversations: conversations whose last replica is remembered.
        cache_salt: every plan's ``cache_salt`` (one tenant's router).
        clock: seconds, for the in-flight load (tests inject one).
        ordering, annotate: every replica pilot's (:class:`~.pilot.ContextPilot`).

    Raises:
        TypeError / ValueError: a bad replica or setting (the message names it).
    """

    def __init__(
        self,
        replicas: Sequence[ReplicaSpec | Mapping[str, Any]],
        *,
        mode: RoutingMode = "gateway",
        load: LoadKind = "recent-tokens",
        max_imbalance: float = 1.25,
        load_window: int = 1024,
        in_flight_timeout_s: float = 120.0,
        key_prefix: str | None = None,
        layout: PromptLayout | None = None,
        token_counter: TokenCounter | None = None,
        deduplicator: Deduplicator | None = None,
        max_requests: int | None = 100_000,
        max_routes: int = 200_000,
        max_conversations: int = 100_000,
        cache_salt: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        link_factory: LinkFactory | None = None,
        ordering: OrderingConfig | None = None,
        annotate: bool = True,
    ) -> None:
        self.config = RouterConfig(
            tuple(replicas),  # type: ignore[arg-type]  # mappings are converted there
            mode=mode,
            load=load,
            max_imbalance=max_imbalance,
            load_window=load_window,
            in_flight_timeout_s=in_flight_timeout_s,
            key_prefix=key_prefix,
        )
        self._layout = layout or PromptLayout()
        self.token_counter = token_counter or ApproxTokenCounter()
        self.deduplicator = deduplicator or Deduplicator(
            token_counter=self.token_counter, label_template=self._layout.label_template
        )
        self.cache_salt = cache_salt
        self._ordering = ordering
        self._annotate = annotate
        self._usage = UsageCounter()
        self._fleet = ReplicaFleet(
            self._new_pilot,
            link_factory,
            loads=LoadBoard(load, window=load_window, timeout_s=in_flight_timeout_s, clock=clock),
            keys=RouteKeys(mode, key_prefix),
            max_requests=max_requests,
            max_routes=max_routes,
        )
        self._planning = ReplicaPlanning(
            self._fleet,
            self.token_counter,
            direct=self.config.mode == "direct",
            max_imbalance=self.config.max_imbalance,
            max_conversations=max_conversations,
        )
        try:
            for spec in self.config.replicas:
                self._fleet.add(spec)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | RouterConfig, **kwargs: Any) -> ReplicaRouter:
        """A router from :class:`~.routing_config.RouterConfig` or its mapping (``replicas``
        and the routing rule); ``kwargs``: the other arguments of the constructor."""
        if not isinstance(config, RouterConfig):
            config = RouterConfig.from_mapping(config)
        rule = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return cls(rule.pop("replicas"), **{**rule, **kwargs})

    @property
    def layout(self) -> PromptLayout:
        """The layout plans are rendered with (every replica's)."""
        return self._layout

    @property
    def replicas(self) -> list[str]:
        """The replicas' names, in routing order (ties go to the first)."""
        with self._fleet.lock:
            return list(self._fleet.replicas)

    # ------------------------------------------------------------------ Public API: planning
    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        """Pick the replica for one request and plan it there (:mod:`.replica_planning`).

        Returns:
            The replica pilot's :class:`~.plan.Plan` with ``replica`` and ``routing_key`` or
            ``base_url`` set.

        Raises:
            TypeError / ValueError: a bad argument (as :meth:`ContextPilot.plan`).
            RidConflictError: ``rid`` is indexed on a replica or being planned.
        """
        return self._planning.plan(PlanRequest(query, blocks, rid, scope or NO_SCOPE))

    def route(
        self, rid: str, *, scope: Scope | None = None, prompt_tokens: int = 1
    ) -> ReplicaChoice:
        """Pick the replica for a call with no blocks to plan (an agent's messages): its
        conversation's last replica, credited with its history, within the bounded-imbalance
        rule; else the least loaded (:meth:`.ReplicaPlanning.route`). ``prompt_tokens``: the
        call's size (its load, and the history credited to its conversation's replica next
        time). Its usage (:meth:`record_usage`) or :meth:`complete` ends it.

        Raises:
            RidConflictError: ``rid`` is indexed on a replica or being planned.
        """
        return self._planning.route(rid, scope or NO_SCOPE, prompt_tokens)

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """Partition a batch across the replicas and plan each part on its replica
        (:meth:`.ReplicaPlanning.plan_batch`).

        Returns:
            :class:`~.plan.BatchPlan`, plans in input order.

        Raises:
            TypeError / ValueError: as :func:`~.request.check_batch`.
            RidConflictError: a rid is indexed on a replica or being planned.
        """
        return self._planning.plan_batch(requests)

    def forget_conversation(self, conversation_id: str, tenant: str = "") -> bool:
        """Drop a conversation's de-duplication records (its turn numbers go on: a later turn
        is never numbered as one already given); False if unknown. No later plan hints at
        what its earlier turns showed."""
        return self.deduplicator.store.forget(tenant, conversation_id)

    # ------------------------------------------------------------------ Public API: the engines
    def evict(self, rid: str) -> bool:
        """Drop ``rid`` from the index of the replica it was routed to (every replica's when
        its route is forgotten); False if none held it."""
        return self._fleet.evict(rid)

    def withdraw(self, rid: str) -> bool:
        """``rid`` was never served (its engine refused it): dropped from its replica's index
        as :meth:`evict` does, and from the load as if never routed, so one refused call (a
        prompt too long for the engine, say) does not weigh on its replica's share; False if
        no index held it."""
        return self._fleet.evict(rid, withdrawn=True)

    def record_usage(
        self,
        rid: str,
        prompt_tokens: int,
        cached_tokens: int,
        cache_write_tokens: int | None = None,
    ) -> bool:
        """The engine's usage of a sent request (``engine_fields.CacheUsageTracker`` calls
        it): counted for the fleet and for the replica it went to (``stats()["replicas"]``),
        passed to that replica's pilot (:meth:`ContextPilot.record_usage`), and the request is
        no longer in flight. Returns whether that replica indexes ``rid``.

        Raises:
            TypeError / ValueError: as :meth:`ContextPilot.record_usage`.
        """
        self._usage.add(prompt_tokens, cached_tokens, cache_write_tokens)
        return self._fleet.record_usage(rid, prompt_tokens, cached_tokens, cache_write_tokens)

    def candidates(self) -> list[str]:
        """The replicas routed to now: those up, in order (all of them when none is)."""
        return self._fleet.candidates()

    def complete(self, rid: str) -> None:
        """``rid``'s call ended without a usage report: no longer in flight (the in-flight
        loads)."""
        self._fleet.complete(rid)

    def landed(self, rid: str, replica: str) -> None:
        """``rid`` was sent to ``replica`` instead of where it was planned (the caller could
        not reach that one): its route, load and index entry move there."""
        self._fleet.landed(replica, rid)

    def set_health(self, replica: str, up: bool) -> None:
        """Mark ``replica`` down (a caller could not reach it: its requests are evicted and
        routing goes on with the others) or up again."""
        self._fleet.set_health(replica, up)

    def set_kv_capacity(self, replica: str, capacity_tokens: int) -> None:
        """``replica``'s KV cache holds ``capacity_tokens`` tokens, learnt once the router was
        built (the proxy asks the engine): from the next plan on, its index drops what the
        cache can no longer hold (docs/DESIGN.md, "Replicas and routing").

        Raises:
            ValueError: ``capacity_tokens`` is not an int > 0.
        """
        self._fleet.set_kv_capacity(replica, capacity_tokens)

    def routing_key(self, rid: str) -> str | None:
        """The routing key ``rid`` was planned with (the gateway header's value), or None."""
        with self._fleet.lock:
            route = self._fleet.routes.peek(rid)
            return route.key if route is not None else None

    def replica_of(self, rid: str) -> str | None:
        """The replica ``rid`` went to (as its engine events tell, once they came), or None."""
        with self._fleet.lock:
            route = self._fleet.routes.peek(rid)
            return route.replica if route is not None else None

    # ------------------------------------------------------------------ Public API: replicas
    def add_replica(self, replica: ReplicaSpec | Mapping[str, Any]) -> None:
        """Start routing to one more replica (its engine link starts here).

        Raises:
            TypeError / ValueError: a bad replica, or its name is taken.
        """
        self._fleet.add(replica)

    def remove_replica(self, name: str) -> None:
        """Stop routing to ``name``: its link stops, its index is dropped, its keys forgotten.

        Raises:
            KeyError: no such replica.
            ValueError: it is the last one.
        """
        self._fleet.remove(name)

    def stats(self) -> dict[str, Any]:
        """``replicas`` (name -> ``up``, ``base_url``, ``routed_requests`` and
        ``routed_prompt_tokens`` so far, ``load`` now, ``down_evictions``, the routing key
        (``key``, ``confirmed``, ``aliases``), ``index`` and ``usage`` of its pilot (its
        engine-reported ``hit_ratio``), ``sync`` of its link or None), ``routing`` (``mode``,
        ``load``, ``max_imbalance``, ``remapped`` requests, ``remapped_keys``, ``balance``:
        max/min of routed requests and prompt tokens over the replicas that are up, None while
        one has none), ``usage`` (the fleet's) and ``conversations``."""
        fleet = self._fleet.stats()
        return {
            "replicas": fleet["replicas"],
            "routing": {
                "mode": self.config.mode,
                "load": self.config.load,
                "max_imbalance": self.config.max_imbalance,
                "remapped": fleet["remapped"],
                "remapped_keys": fleet["remapped_keys"],
                "balance": fleet["balance"],
            },
            "usage": self._usage.stats(),
            "conversations": self.deduplicator.store.stats(),
        }

    def close(self) -> None:
        """Stop every replica's engine link (idempotent); the indexes stay usable."""
        self._fleet.close()

    def __enter__(self) -> ReplicaRouter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _new_pilot(self, index: ContextIndex, link: EngineLinkProtocol | None) -> ContextPilot:
        """A replica's pilot over ``index`` (its engine link ``link``, bound by the fleet),
        with the router's layout, counter, conversation store, salt and ordering."""
        return ContextPilot(
            layout=self._layout,
            token_counter=self.token_counter,
            index=index,
            deduplicator=self.deduplicator,
            cache_salt=self.cache_salt,
            engine=link,
            ordering=self._ordering,
            annotate=self._annotate,
        )
