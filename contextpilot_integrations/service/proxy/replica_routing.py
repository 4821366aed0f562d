"""The replica router hosted in the proxy: every app process that calls the proxy shares one
view of the fleet (docs/DESIGN.md, "The proxy", "Replicas and routing").

:class:`ReplicaRouting` holds, for a proxy with a fleet (:class:`~.fleet_config.FleetConfig`):

- one :class:`~contextpilot_integrations.core.replicas.routing.ReplicaRouter` per tenant that
  owns an index (one per tenant when the service is partitioned, one for all otherwise), each
  with the tenant's ``cache_salt``: tenants never share index state unless they share the
  engine's cache (docs/DESIGN.md, "Isolation");
- one :class:`~contextpilot_integrations.sync.engine_link.EngineLink` per replica with
  ``cache_sync``, shared by the routers: each router gets a tenant's view of it
  (:class:`_TenantLinkView`), and the link gives each eviction and each echoed rid to the router
  of the rid's tenant (the rid's tag, as the service routes its one link's evictions), and each
  change of the replica's health to every router;
- in the ``"direct"`` mode one pooled upstream client per replica base URL (a gateway is the
  proxy's one upstream).

Per call: :meth:`ReplicaRouting.route` (a call without documents: its conversation's replica,
else the least loaded) or the tenant's router planning the call's documents (the replica
holding their longest cached prefix) chooses the replica. With ``window_ms`` > 0 a tenant's
document calls go through a
:class:`~contextpilot_integrations.core.window.planning_window.PlanningWindow` in front of its
router (:meth:`ReplicaRouting.planner_of`): calls arriving together are partitioned, ordered
and scheduled as one batch (``ReplicaRouter.plan_batch``) and each is handed its plan in the
batch's schedule order, which :attr:`ReplicaRouting.order` (a
:class:`~.replica_order.ReplicaOrder`) keeps up to the upstream: per replica, a call with
documents goes out once the previous one started its answer, at most the fleet's
``max_in_flight`` at once. The proxy forwards there (direct) or
to the gateway with the routing key header (gateway); :meth:`ReplicaRouting.reroute` routes
around a replica that refused the connection (it is left out for ``retry_down_s``, its
requests evicted) and :meth:`ReplicaRouting.ended` ends the call's in-flight load.

Counters on the service's registry (replica names only, never tenants or rids):
``contextpilot_proxy_replica_routed_total{replica}`` (calls sent there; a call routed around a
replica counts at each) and ``contextpilot_proxy_replica_unreachable_total{replica}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import Counter

from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.replicas.replica_planning import ReplicaChoice
from contextpilot_integrations.core.replicas.routing import ReplicaRouter
from contextpilot_integrations.core.request import Scope
from contextpilot_integrations.core.window.planning_window import PlanningWindow
from contextpilot_integrations.llm_call.engine_fields import ROUTING_HEADER, Usage
from contextpilot_integrations.service.proxy.fleet_config import FleetConfig
from contextpilot_integrations.service.proxy.gateway_workers import (
    SMG_ROUTING_KEY_HEADER,
    TARGET_WORKER_HEADER,
    GatewayWorkers,
)
from contextpilot_integrations.service.proxy.kv_capacity import learn_kv_capacity
from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
from contextpilot_integrations.service.proxy.replica_order import STUCK_S, ReplicaOrder
from contextpilot_integrations.service.proxy.upstream import Upstream
from contextpilot_integrations.service.tenants import Tenancy
from contextpilot_integrations.sync.engine_link import EngineLink

__all__ = ["REPLICA_HEADER", "ReplicaRouting"]

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-contextpilot-replica"
"""The answer header naming the replica a call was sent to (planned for, behind a gateway)."""


class _SharedLink:
    """One replica's engine link, shared by every tenant's router (module docstring)."""

    def __init__(self, name: str, cache_sync: Mapping[str, Any], tenancy: Tenancy) -> None:
        self.name = name
        self.link = EngineLink(cache_sync)
        self._tenancy = tenancy
        self._views: dict[str | None, _TenantLinkView] = {}
        self._by_tag: dict[str, _TenantLinkView] = {}
        self.up = True
        """What the link last said of the replica's KV-event publisher."""
        self.link.bind(self._evicted, on_session=self._session, on_health=self._health)

    def view(self, tenant: str | None) -> _TenantLinkView:
        """The link as ``tenant``'s router sees it (``None``: the one router of all)."""
        view = _TenantLinkView(self.link)
        self._views[tenant] = view
        if tenant is not None and self._tenancy.partitioned:
            self._by_tag[self._tenancy.rid_tag(tenant)] = view
        return view

    def _view_of(self, rid: str) -> _TenantLinkView | None:
        if not self._by_tag:
            return next(iter(self._views.values()), None)
        return self._by_tag.get(rid.partition(".")[0])

    def _evicted(self, rid: str) -> bool:
        view = self._view_of(rid)
        return view.evicted(rid) if view is not None else False

    def _session(self, rid: str) -> None:
        view = self._view_of(rid)
        if view is not None:
            view.session(rid)

    def _health(self, up: bool) -> None:
        self.up = up
        for view in list(self._views.values()):
            view.health(up)


class _TenantLinkView:
    """A tenant router's view of a shared link (``EngineLinkProtocol``): it binds the router's
    callbacks here, records, touches and forgets through the shared link, and never starts or
    stops it (:class:`ReplicaRouting` does)."""

    def __init__(self, link: EngineLink) -> None:
        self._link = link
        self._on_evict: Callable[[str], bool] | None = None
        self._on_session: Callable[[str], object] | None = None
        self._on_health: Callable[[bool], object] | None = None

    @property
    def bound(self) -> bool:
        return self._on_evict is not None

    @property
    def kind(self) -> str:
        return self._link.kind

    def bind(
        self,
        on_evict: Callable[[str], bool],
        *,
        on_session: Callable[[str], object] | None = None,
        on_health: Callable[[bool], object] | None = None,
    ) -> _TenantLinkView:
        if self._on_evict is not None:
            raise ValueError("engine link is bound already: one owner binds its callbacks")
        self._on_evict, self._on_session, self._on_health = on_evict, on_session, on_health
        return self

    def evicted(self, rid: str) -> bool:
        return self._on_evict(rid) if self._on_evict is not None else False

    def session(self, rid: str) -> None:
        if self._on_session is not None:
            self._on_session(rid)

    def health(self, up: bool) -> None:
        if self._on_health is not None:
            self._on_health(up)

    def start(self) -> _TenantLinkView:
        return self

    def stop(self) -> None:
        return None

    def record(self, plans: Iterable[Plan]) -> None:
        self._link.record(plans)

    def touch(self, rid: str) -> None:
        self._link.touch(rid)

    def forget(self, rid: str) -> None:
        self._link.forget(rid)

    def reset(self) -> list[str]:
        return self._link.reset()

    def stats(self) -> dict[str, Any]:
        return self._link.stats()


_GATEWAY_CONTROLS = frozenset({ROUTING_HEADER, SMG_ROUTING_KEY_HEADER, TARGET_WORKER_HEADER})
"""Request headers (lower-case) by which the proxy steers a call behind a gateway."""


class ReplicaRouting:
    """The proxy's replica routers, shared links and upstreams (module docstring).

    Args:
        config: the proxy's settings; ``config.fleet`` must be set.
        tenancy: the service's tenants (which of them own an index, rid tags, salts).
        registry: the service's Prometheus registry.
        layout: the prompt layout the routers' pilots render documents with.
        max_requests: the LRU bound of each replica index.
        window_ms: the planning window in front of each router for calls with documents
            (milliseconds; 0: each planned alone as it comes).
        window_max_batch: most calls one such window gathers.
        clock: seconds (the time a replica is left out after it refused a connection).

    Raises:
        ValueError: ``config`` has no fleet, or a replica's ``cache_sync`` is invalid.
    """

    def __init__(
        self,
        config: ProxyConfig,
        tenancy: Tenancy,
        registry: Any,
        *,
        layout: PromptLayout | None = None,
        max_requests: int = 100_000,
        window_ms: float = 0.0,
        window_max_batch: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.fleet is None:
            raise ValueError("ReplicaRouting needs a proxy config with a fleet")
        self.fleet: FleetConfig = config.fleet
        self._tenancy = tenancy
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until: dict[str, float] = {}
        specs = self.fleet.router.replicas
        self._links = {
            spec.name: _SharedLink(spec.name, spec.cache_sync, tenancy)
            for spec in specs
            if spec.cache_sync is not None
        }
        self._routers: dict[str | None, ReplicaRouter] = {}
        if tenancy.partitioned:
            owners: list[str | None] = list(tenancy.tenants)
        else:
            owners = [None]
        for owner in owners:
            salt = tenancy.cache_salt(owner) if owner is not None else None
            self._routers[owner] = ReplicaRouter.from_config(
                self.fleet.router,
                link_factory=self._link_factory(owner),
                layout=layout,
                max_requests=max_requests,
                cache_salt=salt,
            )
        # A call that has not started its answer in half the upstream's read timeout holds
        # nobody behind it at the door: with the door's own bound alone, a timeout shorter
        # than it would end each call first, and the calls behind would go one timeout apart.
        timeout = config.read_timeout_s
        self.order = ReplicaOrder(
            ordered=self.fleet.ordered,
            max_in_flight=self.fleet.max_in_flight,
            stuck_s=min(STUCK_S, timeout / 2) if timeout is not None else STUCK_S,
        )
        """The door of the calls with documents to each replica (their order, in flight)."""
        self.workers = GatewayWorkers(specs, enabled=self.fleet.target_workers)
        """The replicas as the gateway's workers: where its answers say a call went, and the
        worker index a call is sent to (the fleet's ``target_workers``)."""
        self.learnt_kv_capacity: dict[str, int | None] | None = None
        """Each replica whose KV capacity was asked of its engine, with what it said (None:
        not known), once :meth:`learn_kv_capacity` ended; None before."""
        self._windows: dict[str | None, PlanningWindow] = {}
        if window_ms > 0:
            for owner, router in self._routers.items():
                self._windows[owner] = PlanningWindow(
                    router,
                    window_ms=window_ms,
                    max_batch=window_max_batch,
                    on_handed=self._handed,
                    hold=self._backlogged,
                    max_hold_ms=self.fleet.window_hold_ms,
                )
        self._upstreams: dict[str, Upstream] = {}
        if self.fleet.direct:
            for spec in specs:
                assert spec.base_url is not None  # checked by FleetConfig
                self._upstreams[spec.name] = Upstream(
                    dataclasses.replace(config, upstream_url=spec.base_url, fleet=None)
                )
        self.routed = Counter(
            "contextpilot_proxy_replica_routed",
            "Proxied calls sent to each replica (one routed around a replica counts at each).",
            ["replica"],
            registry=registry,
        )
        self.unreachable = Counter(
            "contextpilot_proxy_replica_unreachable",
            "Connections to each replica refused or timed out (the call routed around it).",
            ["replica"],
            registry=registry,
        )

    # ------------------------------------------------------------------ Public API: per call
    def router_of(self, tenant: str | None) -> ReplicaRouter:
        """The router of ``tenant``'s calls (the shared one unless partitioned); replicas left
        out long enough are routed to again first.

        Raises:
            KeyError: an unknown tenant.
        """
        self._bring_back()
        return self._routers[tenant if self._tenancy.partitioned else None]

    def planner_of(self, tenant: str | None) -> ReplicaRouter | PlanningWindow:
        """What plans ``tenant``'s calls with documents: the planning window in front of its
        router (``window_ms`` > 0), else the router (:meth:`router_of`).

        Raises:
            KeyError: an unknown tenant.
        """
        router = self.router_of(tenant)
        owner = tenant if self._tenancy.partitioned else None
        return self._windows.get(owner, router)

    def route(
        self, tenant: str | None, rid: str, scope: Scope, prompt_tokens: int
    ) -> ReplicaChoice:
        """The replica of a call without documents (``ReplicaRouter.route``)."""
        return self.router_of(tenant).route(rid, scope=scope, prompt_tokens=prompt_tokens)

    def upstream_of(self, choice: ReplicaChoice | None, gateway: Upstream) -> Upstream:
        """Where a call goes: its replica's upstream (direct), else ``gateway``."""
        if choice is not None and self.fleet.direct:
            return self._upstreams[choice.replica]
        return gateway

    def without_gateway_controls(self, given: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The client's headers ``given`` less, behind a gateway, the ones by which the proxy
        steers it (the routing key, SMG's key and target worker): a client's own would send
        its call to another worker than planned, and a targeted call that lands elsewhere
        turns targeting off for every tenant."""
        if self.fleet.direct:
            return given
        return [item for item in given if item[0] not in _GATEWAY_CONTROLS]

    def request_headers(self, choice: ReplicaChoice | None) -> list[tuple[str, str]]:
        """The headers the call adds upstream behind a gateway: the routing key, and with
        ``target_workers`` the same key in SMG's own header (what ``consistent_hashing`` sticks
        by once targeting is off) and the target header of its replica's worker while
        targeting is on."""
        if choice is None or self.fleet.direct:
            return []
        out = self.workers.headers(choice.replica)
        if choice.routing_key is not None:
            out.append((ROUTING_HEADER, choice.routing_key))
            if self.workers.enabled:  # SMG under consistent_hashing hashes this one
                out.append((SMG_ROUTING_KEY_HEADER, choice.routing_key))
        return out

    def answered(
        self, choice: ReplicaChoice, sent: list[tuple[str, str]], headers: Mapping[str, str]
    ) -> str | None:
        """The replica the gateway's answer (its ``headers``) says the call planned for
        ``choice`` with the headers ``sent`` reached (None: it does not say, or direct). A
        targeted call that reached another replica turns targeting off."""
        if self.fleet.direct:
            return None
        targeted = any(name == TARGET_WORKER_HEADER for name, _ in sent)
        return self.workers.check(choice.replica, targeted, headers)

    def landed(self, tenant: str | None, rid: str, replica: str) -> None:
        """The gateway's answer says the call ``rid`` reached ``replica``: its router learns
        where its key went and moves it there if it was planned elsewhere. Blocking."""
        self.router_of(tenant).landed(rid, replica)

    def pass_through_choice(self) -> ReplicaChoice | None:
        """The replica a passed-through request goes to (direct: the first one up; behind a
        gateway: None, the gateway)."""
        if not self.fleet.direct:
            return None
        name = self.router_of(next(iter(self._routers))).candidates()[0]
        return ReplicaChoice(name, None, self._upstreams[name].config.upstream_url)

    def sent(self, choice: ReplicaChoice | None) -> None:
        """Count a call sent to ``choice``'s replica."""
        if choice is not None:
            self.routed.labels(choice.replica).inc()

    def reroute(
        self, tenant: str | None, rid: str | None, tried: set[str], failed: str
    ) -> ReplicaChoice | None:
        """Replica ``failed`` refused the call ``rid`` (``None``: a passed-through request): it
        is left out for ``retry_down_s`` (its requests evicted, every tenant's router routes
        around it) and the call moves to the first replica up it has not tried; None when
        none is left (or behind a gateway, which routes around its workers itself). Blocking.
        """
        self.unreachable.labels(failed).inc()
        tried.add(failed)
        if not self.fleet.direct:
            return None
        router = self.router_of(tenant)
        left = [name for name in router.candidates() if name not in tried]
        if rid is not None and left:
            router.landed(rid, left[0])
        with self._lock:
            self._down_until[failed] = self._clock() + self.fleet.retry_down_s
        for each in self._routers.values():
            each.set_health(failed, False)
        logger.warning(
            "replica %r refused a connection: routed around for %.0f s",
            failed,
            self.fleet.retry_down_s,
        )
        if not left:
            return None
        name = left[0]
        self.routed.labels(name).inc()
        return ReplicaChoice(name, None, self._upstreams[name].config.upstream_url)

    def record_usage(self, tenant: str | None, rid: str, usage: Usage) -> None:
        """The call's usage into its router: counted for its replica, no longer in flight."""
        self.router_of(tenant).record_usage(
            rid, usage.prompt_tokens, usage.cached_tokens, usage.cache_write_tokens
        )

    def refused(self, tenant: str | None, rid: str) -> None:
        """The upstream refused the call ``rid`` (a 4xx answer: nothing was prefilled): it is
        taken out of its replica's index and load as if never routed
        (``ReplicaRouter.withdraw``). Blocking."""
        self.router_of(tenant).withdraw(rid)

    def ended(self, tenant: str | None, rid: str) -> None:
        """The call's answer ended (usage read or not): no longer in flight."""
        self.router_of(tenant).complete(rid)

    def replicas_up(self) -> list[str]:
        """The replicas taken as up now (``GET /health``): neither refused a connection within
        ``retry_down_s`` nor reported down by their KV-event link. Takes only this object's
        own short lock."""
        now = self._clock()
        with self._lock:
            refused = {name for name, until in self._down_until.items() if until > now}
        return [
            spec.name
            for spec in self.fleet.router.replicas
            if spec.name not in refused
            and (spec.name not in self._links or self._links[spec.name].up)
        ]

    async def learn_kv_capacity(self) -> dict[str, int | None]:
        """Ask each replica whose ``kv_capacity_tokens`` is ``"auto"`` (the fleet's
        ``learn_kv_capacity``) its engine's KV capacity (:mod:`.kv_capacity`), all at once,
        and give every tenant's router the capacities learnt. Returns each asked replica's
        capacity (None: not known). Runs on the event loop; never raises but for
        cancellation."""
        specs = [s for s in self.fleet.router.replicas if s.name in self.fleet.learn_kv_capacity]
        asked = [s for s in specs if s.base_url is not None]
        found = await asyncio.gather(*(learn_kv_capacity(s.base_url or "") for s in asked))
        learnt: dict[str, int | None] = {spec.name: None for spec in specs}
        for spec, tokens in zip(asked, found, strict=True):
            learnt[spec.name] = tokens
            if tokens is None:
                continue
            for router in self._routers.values():
                router.set_kv_capacity(spec.name, tokens)
            logger.info("replica %r: KV capacity %d tokens, told by its engine", spec.name, tokens)
        self.learnt_kv_capacity = learnt
        return learnt

    # ------------------------------------------------------------------ Public API: lifecycle
    def start(self) -> None:
        """Start every replica's engine link."""
        for shared in self._links.values():
            shared.link.start()

    async def aclose(self) -> None:
        """Close the replicas' upstream pools."""
        for upstream in self._upstreams.values():
            await upstream.aclose()

    def stop(self) -> None:
        """Stop every replica's engine link (idempotent)."""
        for shared in self._links.values():
            shared.link.stop()

    def stats(self) -> dict[str, Any]:
        """Per router (``tenant`` name or ``""`` for the shared one) its
        ``ReplicaRouter.stats()``, with its planning window's ``PlanningWindow.stats()`` as
        ``window`` (``None`` without one), for monitoring."""
        out: dict[str, Any] = {}
        for owner, router in self._routers.items():
            window = self._windows.get(owner)
            out[owner or ""] = {
                **router.stats(),
                "window": window.stats() if window is not None else None,
            }
        return out

    def tenant_stats(self, tenant: str | None) -> dict[str, Any]:
        """What ``GET /v1/stats`` shows ``tenant`` of the fleet: ``replicas``, its router's
        ``ReplicaRouter.stats()`` (its own router when partitioned, the shared one
        otherwise, as the index figures), and ``window``, its planning window's
        ``PlanningWindow.stats()`` (``None`` without one: windows, mean batch, ``held``,
        ``held_ms``). The door is shared by the tenants, so its counts stay out.

        Raises:
            KeyError: an unknown tenant.
        """
        owner = tenant if self._tenancy.partitioned else None
        window = self._windows.get(owner)
        return {
            "replicas": self._routers[owner].stats(),
            "window": window.stats() if window is not None else None,
        }

    # ------------------------------------------------------------------ internals
    def _backlogged(self) -> bool:
        """Whether every replica up has calls waiting at its door (the planning windows'
        ``hold``: a call planned now would wait behind them anyway)."""
        return self.order.backlogged(self.replicas_up())

    def _handed(self, plan: Plan) -> None:
        """A window's plan handed out (schedule order): its call's ticket at its replica."""
        if plan.replica is not None and plan.rid is not None:
            self.order.issue(plan.rid, plan.replica)

    def _link_factory(self, owner: str | None) -> Callable[[Mapping[str, Any]], _TenantLinkView]:
        specs = self.fleet.router.replicas

        def view(cache_sync: Mapping[str, Any]) -> _TenantLinkView:
            name = next(s.name for s in specs if s.cache_sync is cache_sync)
            return self._links[name].view(owner)

        return view

    def _bring_back(self) -> None:
        """Route again to the replicas left out for ``retry_down_s`` (:meth:`reroute`)."""
        with self._lock:
            if not self._down_until:
                return
            now = self._clock()
            back = [name for name, until in self._down_until.items() if until <= now]
            for name in back:
                del self._down_until[name]
        for name in back:
            for router in self._routers.values():
                router.set_health(name, True)
