"""The replicas a router plans over, and what their engines tell it.

Each replica (:class:`Replica`) has its own :class:`~.pilot.ContextPilot` (its own index) and,
with ``cache_sync``, its own engine link (the router's ``link_factory(cache_sync)``, bound here)
fed by that replica's KV events: an eviction on one replica touches only its index.
:class:`ReplicaFleet` keeps the replicas, where each routed request went (:class:`Route`), the
replicas' routing keys (:mod:`.route_keys`) and loads (:mod:`.replica_load`), all under one
lock. What it learns from the engines (each replica's link calls back):

- ``on_session(rid)``: replica X's events carry ``rid``. A gateway pins a key's group to a worker
  of its choosing, so the fleet learns where each key went (:meth:`RouteKeys.observe`) and,
  when a request landed elsewhere than planned, moves it to that replica's index
  (``remapped``);
- ``on_health(False)``: X's KV-event publisher has been unreachable for its grace period: X is
  marked down, its requests are evicted (its index cleared, its mirror reset) and routing goes
  on with the others; ``on_health(True)`` brings it back, empty. With every replica down,
  requests are still planned, over all of them (docs/DESIGN.md, "Never break a request").

Public API: :class:`ReplicaFleet`, :class:`Replica`, :class:`Route`, :data:`LinkFactory`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from contextpilot_integrations.core.engine_link_protocol import EngineLinkProtocol
from contextpilot_integrations.core.index.context_index import ContextIndex
from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.replicas.kv_budget import KvBudget
from contextpilot_integrations.core.replicas.replica_load import LoadBoard
from contextpilot_integrations.core.replicas.route_keys import RouteKeys
from contextpilot_integrations.core.replicas.routing_config import ReplicaSpec
from contextpilot_integrations.core.usage import UsageCounter

__all__ = ["Blocks", "LinkFactory", "PilotFactory", "Replica", "ReplicaFleet", "Route"]

logger = logging.getLogger(__name__)

Blocks = tuple[tuple[int, int], ...]
"""A request's indexed blocks, ``((block_id, tokens), ...)`` in prompt order."""

PilotFactory = Callable[[ContextIndex, EngineLinkProtocol | None], ContextPilot]
"""``(the replica's index, its engine link or None) -> its pilot`` (the router's settings)."""

LinkFactory = Callable[[Mapping[str, Any]], EngineLinkProtocol]
"""``(a replica's cache_sync mapping) -> its engine link``, unbound (``EngineLink``)."""


class Replica:
    """One replica's state: its spec, pilot and link, whether it is up, the requests evicted
    when it went down, the usage its engine reported for requests sent here, and, with its KV
    capacity known, what its cache can still hold of what was planned there (:class:`KvBudget`)."""

    __slots__ = ("spec", "pilot", "link", "up", "down_evictions", "usage", "budget")

    def __init__(
        self, spec: ReplicaSpec, pilot: ContextPilot, link: EngineLinkProtocol | None
    ) -> None:
        self.spec = spec
        self.pilot = pilot
        self.link = link
        self.up = True
        self.down_evictions = 0
        self.usage = UsageCounter()  # what the engine reported for requests sent here
        capacity = spec.kv_capacity_tokens
        self.budget = KvBudget(capacity) if capacity is not None else None

    def held(self, rid: str, blocks: Blocks, prompt_tokens: int) -> list[str]:
        """``rid`` was planned or landed here (fleet lock held): the requests its KV cache can
        no longer hold, to drop from its index (none without a known capacity)."""
        if self.budget is None:
            return []
        return self.budget.add(rid, blocks, prompt_tokens)

    def forget_held(self, rid: str) -> None:
        """``rid`` left this replica's cache or went elsewhere (fleet lock held)."""
        if self.budget is not None:
            self.budget.discard(rid)


class Route:
    """Where a request was sent: its replica (corrected when its events come from another),
    its routing key and what its index entry holds (to move it)."""

    __slots__ = ("replica", "key", "blocks")

    def __init__(self, replica: str, key: str | None, blocks: Blocks) -> None:
        self.replica = replica
        self.key = key
        self.blocks = blocks


class ReplicaFleet:
    """The replicas, their routes, keys and loads (module docstring). Thread-safe.

    Args:
        new_pilot: builds each replica's pilot (:data:`PilotFactory`).
        new_link: builds the engine link of a replica with ``cache_sync``
            (:data:`LinkFactory`); None: no replica may have one.
        loads: the replicas' loads.
        keys: the replicas' routing keys.
        max_requests: the LRU bound of each replica's index.
        max_routes: requests whose route is remembered (for usage, re-mapping, routing keys).

    Attributes:
        lock: guards everything below; a caller that reads or changes them holds it (it is
            re-entrant).
        replicas: name -> :class:`Replica`, in routing order (ties go to the first).
        routes: rid -> :class:`Route` (an LRU of ``max_routes``).
        keys, loads: as given.
        remapped: requests that landed on another replica than planned.
    """

    def __init__(
        self,
        new_pilot: PilotFactory,
        new_link: LinkFactory | None = None,
        *,
        loads: LoadBoard,
        keys: RouteKeys,
        max_requests: int | None,
        max_routes: int,
    ) -> None:
        self.lock = threading.RLock()
        self.replicas: dict[str, Replica] = {}
        self.routes: LRU[str, Route] = LRU(max_routes)
        self.keys = keys
        self.loads = loads
        self.remapped = 0
        self._new_pilot = new_pilot
        self._new_link = new_link
        self._max_requests = max_requests

    # ------------------------------------------------------------------ Public API: replicas
    def add(self, replica: ReplicaSpec | Mapping[str, Any]) -> None:
        """Build one more replica (its engine link starts here) and route to it.

        Raises:
            TypeError / ValueError: a bad replica, its name is taken, or it has ``cache_sync``
                and the fleet no link factory.
        """
        spec = replica if isinstance(replica, ReplicaSpec) else ReplicaSpec.from_mapping(replica)
        with self.lock:
            if spec.name in self.replicas:
                raise ValueError(f"replica {spec.name!r} is already routed to")
        built = self._build(spec)
        with self.lock:
            if spec.name not in self.replicas:
                self.replicas[spec.name] = built
                return
        if built.link is not None:
            built.link.stop()
        raise ValueError(f"replica {spec.name!r} is already routed to")

    def remove(self, name: str) -> None:
        """Stop routing to ``name``: its link stops, its index is dropped, its keys forgotten.

        Raises:
            KeyError: no such replica.
            ValueError: it is the last one.
        """
        with self.lock:
            if name not in self.replicas:
                raise KeyError(f"no replica {name!r}")
            if len(self.replicas) == 1:
                raise ValueError("cannot remove the last replica")
            replica = self.replicas.pop(name)
            self.keys.drop_replica(name)
            self.loads.forget_replica(name)
        if replica.link is not None:
            replica.link.stop()
        replica.pilot.index.clear()

    def candidates(self) -> list[str]:
        """The replicas up, in order (all of them when none is up)."""
        with self.lock:
            up = [name for name, r in self.replicas.items() if r.up]
            return up or list(self.replicas)

    def close(self) -> None:
        """Stop every replica's engine link (idempotent); the indexes stay usable."""
        for replica in list(self.replicas.values()):
            if replica.link is not None:
                replica.link.stop()

    # ------------------------------------------------------------------ Public API: requests
    def evict(self, rid: str, *, withdrawn: bool = False) -> bool:
        """Drop ``rid`` from the index of the replica it was routed to (every replica's when
        its route is forgotten), no longer in flight, and with ``withdrawn`` (it was never
        served) out of the load as if never routed; False if none held it."""
        with self.lock:
            route = self.routes.peek(rid)
            if withdrawn:
                self.loads.cancel(rid)
            else:
                self.loads.complete(rid)
            names = [route.replica] if route is not None else list(self.replicas)
            replicas = [self.replicas[n] for n in names if n in self.replicas]
            for replica in replicas:
                replica.forget_held(rid)
        return any([replica.pilot.evict(rid) for replica in replicas])

    def record_usage(
        self, rid: str, prompt_tokens: int, cached_tokens: int, cache_write_tokens: int | None
    ) -> bool:
        """The engine's usage of ``rid``: no longer in flight, counted for its replica and
        passed to that replica's pilot; whether that replica indexes ``rid`` (False when its
        route is forgotten)."""
        with self.lock:
            route = self.routes.peek(rid)
            self.loads.complete(rid)
            replica = self.replicas.get(route.replica) if route is not None else None
        if replica is None:
            return False
        replica.usage.add(prompt_tokens, cached_tokens, cache_write_tokens)
        return replica.pilot.record_usage(rid, prompt_tokens, cached_tokens, cache_write_tokens)

    def complete(self, rid: str) -> None:
        """``rid``'s call ended without a usage report (it failed, or its answer carried
        none): no longer in flight."""
        with self.lock:
            self.loads.complete(rid)

    def landed(self, name: str, rid: str) -> None:
        """``rid`` reached replica ``name`` (its engine's events, or a caller that sent it
        there instead of the planned replica): learn where its key went, and move it there if
        it was planned for another replica."""
        self._landed(name, rid)

    def set_health(self, name: str, up: bool) -> None:
        """Mark replica ``name`` down (its requests evicted; routing goes on with the others)
        or up again: what its link's ``on_health`` does, for a caller that found it
        unreachable itself."""
        self._health(name, up)

    def set_kv_capacity(self, name: str, capacity_tokens: int) -> None:
        """Replica ``name``'s KV cache holds ``capacity_tokens`` (learnt after it was added):
        its budget counts the requests planned there from now on; an unknown name is
        ignored (the replica was removed).

        Raises:
            ValueError: ``capacity_tokens`` is not an int > 0.
        """
        budget = KvBudget(capacity_tokens)
        with self.lock:
            replica = self.replicas.get(name)
            if replica is None:
                return
            if replica.budget is None:
                replica.budget = budget
            else:
                replica.budget.capacity_tokens = capacity_tokens

    def stats(self) -> dict[str, Any]:
        """``replicas`` (name -> the per-replica figures of ``ReplicaRouter.stats``),
        ``remapped``, ``remapped_keys`` and ``balance`` (of the replicas that are up)."""
        with self.lock:
            replicas = dict(self.replicas)
            loads = self.loads.loads(list(replicas))
            routed = {name: self.loads.routed(name) for name in replicas}
            keys = {name: self.keys.stats(name) for name in replicas}
            remapped, remapped_keys = self.remapped, self.keys.remapped_keys
            budgets = {
                name: (
                    {
                        "capacity_tokens": r.budget.capacity_tokens,
                        "used_tokens": r.budget.used_tokens,
                        "requests": len(r.budget),
                        "dropped": r.budget.dropped,
                    }
                    if r.budget is not None
                    else None
                )
                for name, r in replicas.items()
            }
        out: dict[str, Any] = {}
        for name, replica in replicas.items():
            index = replica.pilot.index.stats()
            out[name] = {
                "up": replica.up,
                "base_url": replica.spec.base_url,
                "routed_requests": routed[name][0],
                "routed_prompt_tokens": routed[name][1],
                "load": loads[name],
                "down_evictions": replica.down_evictions,
                **keys[name],
                "index": {f: getattr(index, f) for f in index.__dataclass_fields__},
                "usage": replica.usage.stats(),
                "kv_budget": budgets[name],
                "sync": replica.link.stats() if replica.link is not None else None,
            }
        up = [routed[name] for name, replica in replicas.items() if replica.up]
        return {
            "replicas": out,
            "remapped": remapped,
            "remapped_keys": remapped_keys,
            "balance": {
                "requests": _max_over_min([r for r, _ in up]),
                "prompt_tokens": _max_over_min([t for _, t in up]),
            },
        }

    # ------------------------------------------------------------------ the engines call back
    def _landed(self, name: str, rid: str) -> None:
        """Replica ``name``'s KV events carry ``rid`` (its link's ``on_session``): learn where
        its key went, and move it there if it was planned for another replica."""
        with self.lock:
            route = self.routes.peek(rid)
            if route is None:
                return
            if route.key is not None:
                self.keys.observe(route.key, name)
            if route.replica == name:
                return
            planned_name = route.replica
            planned, landed = self.replicas.get(planned_name), self.replicas.get(name)
            route.replica = name
            self.loads.move(rid, name)
            self.remapped += 1
            blocks = route.blocks
            if planned is None or landed is None or rid not in planned.pilot.index:
                return
            planned.forget_held(rid)
            dropped = landed.held(rid, blocks, sum(t for _, t in blocks)) if blocks else []
        planned.pilot.evict(rid)
        if blocks and rid not in landed.pilot.index:
            landed.pilot.index.insert(rid, [b for b, _ in blocks], [t for _, t in blocks])
        for other in dropped:
            landed.pilot.index.evict(other)
        logger.debug("rid %r was planned for replica %r and reached %r", rid, planned_name, name)

    def _health(self, name: str, up: bool) -> None:
        """Replica ``name``'s KV-event publisher went away for its grace period (``up`` False)
        or came back (its link's ``on_health``)."""
        with self.lock:
            replica = self.replicas.get(name)
            if replica is None or replica.up == up:
                return
            replica.up = up
            if not up:
                self.keys.drop_replica(name)
                self.loads.forget_replica(name)
            left = sum(r.up for r in self.replicas.values())
        if up:
            logger.info("replica %r is up again; routing to it", name)
            return
        evicted = replica.pilot.index.clear()
        with self.lock:
            if replica.budget is not None:
                replica.budget = KvBudget(replica.budget.capacity_tokens)
        if replica.link is not None:
            replica.link.reset()
        replica.down_evictions += evicted
        logger.warning(
            "replica %r is down (its KV events stopped): %d requests evicted, routing goes on "
            "with %d replica(s)",
            name,
            evicted,
            left,
        )

    # ------------------------------------------------------------------ internals
    def _build(self, spec: ReplicaSpec) -> Replica:
        name = spec.name
        holder: list[Replica] = []

        def dropped(rid: str) -> None:
            # The index's own LRU bound dropped ``rid`` (under the index lock).
            if holder and holder[0].link is not None:
                holder[0].link.forget(rid)

        index = ContextIndex(max_requests=self._max_requests, on_evict=dropped)
        link = None
        if spec.cache_sync is not None:
            if self._new_link is None:
                raise ValueError(
                    f"replica {name!r} has cache_sync: give the router link_factory=EngineLink "
                    "(contextpilot_integrations.sync.engine_link)"
                )
            link = self._new_link(spec.cache_sync)

            def evicted(rid: str) -> bool:
                # The engine dropped ``rid``: out of the replica's budget, then its index.
                if holder:
                    with self.lock:
                        holder[0].forget_held(rid)
                return index.evict(rid)

            link.bind(
                evicted,
                on_session=functools.partial(self._landed, name),
                on_health=functools.partial(self._health, name),
            )
        replica = Replica(spec, self._new_pilot(index, link), link)
        holder.append(replica)
        if link is not None:
            link.start()
        return replica


def _max_over_min(values: Sequence[int]) -> float | None:
    if not values or min(values) <= 0:
        return None
    return max(values) / min(values)
