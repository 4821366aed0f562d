"""A planner over several engine replicas: the replica is chosen together with the order.

Gateways in front of N replicas (SMG's ``cache_aware``, llm-d, Dynamo) route the prompt as it is
given; a pilot over one index assumes one engine, so a request aligned to a prefix cached on
replica A and sent to B misses while the index believes a hit. :class:`ReplicaRouter` keeps one
:class:`~.pilot.ContextPilot` per replica (its own index, and its own engine link fed by that
replica's KV events: an eviction on one replica touches only its index), and for each request

1. searches every replica's index for the longest aligned prefix of the request's blocks;
2. picks the replica by that prefix, within the bounded-imbalance rule over the replicas' loads
   (:mod:`.replica_load`), with a conversation's last replica credited with its history;
3. plans there (alignment against that index, de-duplication, insert) and returns the plan with
   the replica's name and how to reach it: ``routing_key`` (``"gateway"`` mode: a gateway header,
   ``engine_fields.engine_headers``) or ``base_url`` (``"direct"`` mode).

A batch is partitioned across replicas by the top of its prefix tree and balanced by load
(:func:`~.replica_load.partition_batch`); each part is ordered and scheduled by its replica's
pilot, and the parts' schedules are interleaved (replicas run in parallel). Conversations
de-duplicate alike wherever they go: the replicas' pilots share one conversation store.

The router meets the planner contract (:mod:`.planner_protocol`), so every face takes it as it
takes a pilot. What it learns from the engines (each replica's link calls back):

- ``on_session(rid)``: replica X's events carry ``rid``. A gateway pins a key's group to a worker
  of its choosing, so the router learns where each key went (:mod:`.route_keys`) and, when a
  request landed elsewhere than planned, moves it to that replica's index (``remapped``);
- ``on_health(False)``: X's KV-event publisher has been unreachable for its grace period: X is
  marked down, its requests are evicted (its index cleared, its mirror reset) and routing goes
  on with the others; ``on_health(True)`` brings it back, empty. With every replica down,
  requests are still planned, over all of them (DESIGN.md invariant 5).

Replicas are added and removed at run time (:meth:`ReplicaRouter.add_replica`,
:meth:`~ReplicaRouter.remove_replica`). Thread-safe; the per-request work is bounded by the
request's size times the number of replicas (invariant 7).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .blocks import ApproxTokenCounter, TokenCounter, block_id
from .context_index import ContextIndex
from .dedup import Deduplicator
from .lru import LRU
from .pilot import ContextPilot
from .plan import BatchPlan, Placement, Plan
from .rendering import PromptLayout
from .replica_load import LoadBoard, batch_items, interleave, partition_batch, pick_replica
from .request import NO_SCOPE, PlanRequest, RidConflictError, Scope, check_batch, is_block_text
from .request import new_rid as _new_rid
from .route_keys import RouteKeys
from .routing_config import LoadKind, ReplicaSpec, RouterConfig, RoutingMode
from .usage import UsageCounter

if TYPE_CHECKING:
    from contextpilot_integrations.sync.engine_link import EngineLink

__all__ = ["ReplicaRouter"]

logger = logging.getLogger(__name__)

Blocks = tuple[tuple[int, int], ...]
"""A request's indexed blocks, ``((block_id, tokens), ...)`` in prompt order."""


class _Replica:
    __slots__ = ("spec", "pilot", "link", "up", "down_evictions", "usage")

    def __init__(self, spec: ReplicaSpec, pilot: ContextPilot, link: EngineLink | None) -> None:
        self.spec = spec
        self.pilot = pilot
        self.link = link
        self.up = True
        self.down_evictions = 0
        self.usage = UsageCounter()  # what the engine reported for requests sent here


class _Route:
    """Where a request was sent: its replica (corrected when its events come from another),
    its routing key and what its index entry holds (to move it)."""

    __slots__ = ("replica", "key", "blocks")

    def __init__(self, replica: str, key: str | None, blocks: Blocks) -> None:
        self.replica = replica
        self.key = key
        self.blocks = blocks


class ReplicaRouter:
    """Plans requests over several engine replicas (module docstring).

    Args:
        replicas: :class:`~.routing_config.ReplicaSpec` or their mappings
            (``{"name", "base_url", "cache_sync"}``); at least one, names unique. A replica with
            ``cache_sync`` gets its own engine link (the ``sync`` extra), started here.
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
        pilot_options: passed to every replica's :class:`~.pilot.ContextPilot` (``reorder``,
            ``build_method``, ``rest_order``, ...).

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
        **pilot_options: Any,
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
        self._max_requests = max_requests
        self._pilot_options = pilot_options
        self._lock = threading.RLock()
        self._loads = LoadBoard(
            load, window=load_window, timeout_s=in_flight_timeout_s, clock=clock
        )
        self._keys = RouteKeys(mode, key_prefix)
        self._routes: LRU[str, _Route] = LRU(max_routes)
        self._conversations: LRU[tuple[str, str], tuple[str, int]] = LRU(max_conversations)
        self._planning: set[str] = set()
        self._usage = UsageCounter()
        self._identify = functools.lru_cache(maxsize=65_536)(self._identify_uncached)
        self._remapped = 0
        self._replicas: dict[str, _Replica] = {}
        try:
            for spec in self.config.replicas:
                self._replicas[spec.name] = self._build(spec)
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
        with self._lock:
            return list(self._replicas)

    # ------------------------------------------------------------------ Public API: planning
    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        """Pick the replica for one request and plan it there (module docstring).

        Returns:
            The replica pilot's :class:`~.plan.Plan` with ``replica`` and ``routing_key`` or
            ``base_url`` set.

        Raises:
            TypeError / ValueError: a bad argument (as :meth:`ContextPilot.plan`).
            RidConflictError: ``rid`` is indexed on a replica or being planned.
        """
        request = PlanRequest(query, blocks, rid, scope or NO_SCOPE)
        rid = request.rid or _new_rid()
        ids, tokens, cost = self._measure(request)
        candidates = self._candidates()
        scores = self._scores([ids], [tokens], candidates)[0]
        with self._reserved([rid]) as replicas:
            self._credit_conversation(request.scope, scores)
            names = [name for name in candidates if name in replicas]
            loads = self._loads.loads(names)
            name = pick_replica(names, scores, loads, self._loads.cost(cost), self._imbalance)
            self._loads.add(rid, name, cost)
            replica, key = replicas[name], self._keys.key_for(name)
        try:
            plan = replica.pilot.plan(query, blocks, rid=rid, scope=scope)
        except BaseException:
            self._abandon([rid])
            raise
        return self._routed([plan], replica, key)[0]

    async def aplan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        """:meth:`plan` in a worker thread."""
        return await asyncio.to_thread(self.plan, query, blocks, rid=rid, scope=scope)

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """Partition a batch across the replicas and plan each part on its replica.

        Requests whose aligned order starts with the same block (the cached prefix they match
        on some replica, else their block most frequent in the batch) form a group; groups are
        assigned by :func:`~.replica_load.partition_batch`; each replica's part is planned with
        its pilot's ``plan_batch`` (joint order, schedule). The schedule interleaves the parts'
        schedules, one request per replica in turn.

        Returns:
            :class:`~.plan.BatchPlan`, plans in input order.

        Raises:
            TypeError / ValueError: as :func:`~.request.check_batch`.
            RidConflictError: a rid is indexed on a replica or being planned.
        """
        batch = check_batch(requests)
        if not batch:
            return BatchPlan(plans=(), schedule=())
        batch = [r if r.rid is not None else dataclasses.replace(r, rid=_new_rid()) for r in batch]
        rids = [r.rid or "" for r in batch]
        measured = [self._measure(r) for r in batch]
        candidates = self._candidates()
        found = self._found([m[0] for m in measured], [m[1] for m in measured], candidates)
        with self._reserved(rids) as replicas:
            names = [name for name in candidates if name in replicas]
            scores = [{name: tokens for name, (_, tokens) in f.items()} for f in found]
            for request, credited in zip(batch, scores):
                self._credit_conversation(request.scope, credited)
            prefixes = [_best_prefix(f) for f in found]
            items = batch_items(measured, prefixes, scores, self._loads.cost)
            assigned = partition_batch(items, names, self._loads.loads(names), self._imbalance)
            for rid, name, (_, _, cost) in zip(rids, assigned, measured):
                self._loads.add(rid, name, cost)
            parts = {name: [i for i, n in enumerate(assigned) if n == name] for name in names}
            targets = {name: (replicas[name], self._keys.key_for(name)) for name in parts}
        plans: list[Plan | None] = [None] * len(batch)
        schedules: list[list[int]] = []
        try:
            for name, part in parts.items():
                if not part:
                    continue
                replica, key = targets[name]
                planned = replica.pilot.plan_batch([batch[i] for i in part])
                for i, plan in zip(part, self._routed(planned.plans, replica, key)):
                    plans[i] = plan
                schedules.append([part[j] for j in planned.schedule])
        except BaseException:
            self._abandon([rid for rid, plan in zip(rids, plans) if plan is None])
            raise
        done = [plan for plan in plans if plan is not None]
        assert len(done) == len(batch)
        return BatchPlan(plans=tuple(done), schedule=tuple(interleave(schedules)))

    async def aplan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """:meth:`plan_batch` in a worker thread."""
        return await asyncio.to_thread(self.plan_batch, requests)

    # ------------------------------------------------------------------ Public API: the engines
    def evict(self, rid: str) -> bool:
        """Drop ``rid`` from the index of the replica it was routed to (every replica's when
        its route is forgotten); False if none held it."""
        with self._lock:
            route = self._routes.peek(rid)
            self._loads.complete(rid)
            names = [route.replica] if route is not None else list(self._replicas)
            pilots = [self._replicas[n].pilot for n in names if n in self._replicas]
        return any([pilot.evict(rid) for pilot in pilots])

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
        with self._lock:
            route = self._routes.peek(rid)
            self._loads.complete(rid)
            replica = self._replicas.get(route.replica) if route is not None else None
        if replica is None:
            return False
        replica.usage.add(prompt_tokens, cached_tokens, cache_write_tokens)
        return replica.pilot.record_usage(rid, prompt_tokens, cached_tokens, cache_write_tokens)

    def routing_key(self, rid: str) -> str | None:
        """The routing key ``rid`` was planned with (the gateway header's value), or None."""
        with self._lock:
            route = self._routes.peek(rid)
            return route.key if route is not None else None

    def replica_of(self, rid: str) -> str | None:
        """The replica ``rid`` went to (as its engine events tell, once they came), or None."""
        with self._lock:
            route = self._routes.peek(rid)
            return route.replica if route is not None else None

    # ------------------------------------------------------------------ Public API: replicas
    def add_replica(self, replica: ReplicaSpec | Mapping[str, Any]) -> None:
        """Start routing to one more replica (its engine link starts here).

        Raises:
            TypeError / ValueError: a bad replica, or its name is taken.
        """
        spec = replica if isinstance(replica, ReplicaSpec) else ReplicaSpec.from_mapping(replica)
        with self._lock:
            if spec.name in self._replicas:
                raise ValueError(f"replica {spec.name!r} is already routed to")
        built = self._build(spec)
        with self._lock:
            if spec.name not in self._replicas:
                self._replicas[spec.name] = built
                return
        if built.link is not None:
            built.link.stop()
        raise ValueError(f"replica {spec.name!r} is already routed to")

    def remove_replica(self, name: str) -> None:
        """Stop routing to ``name``: its link stops, its index is dropped, its keys forgotten.

        Raises:
            KeyError: no such replica.
            ValueError: it is the last one.
        """
        with self._lock:
            if name not in self._replicas:
                raise KeyError(f"no replica {name!r}")
            if len(self._replicas) == 1:
                raise ValueError("cannot remove the last replica")
            replica = self._replicas.pop(name)
            self._keys.drop_replica(name)
            self._loads.forget_replica(name)
        if replica.link is not None:
            replica.link.stop()
        replica.pilot.index.clear()

    def stats(self) -> dict[str, Any]:
        """``replicas`` (name -> ``up``, ``base_url``, ``routed_requests`` and
        ``routed_prompt_tokens`` so far, ``load`` now, ``down_evictions``, the routing key
        (``key``, ``confirmed``, ``aliases``), ``index`` and ``usage`` of its pilot (its
        engine-reported ``hit_ratio``), ``sync`` of its link or None), ``routing`` (``mode``,
        ``load``, ``max_imbalance``, ``remapped`` requests, ``remapped_keys``, ``balance``:
        max/min of routed requests and prompt tokens over the replicas that are up, None while
        one has none), ``usage`` (the fleet's) and ``conversations``."""
        with self._lock:
            replicas = dict(self._replicas)
            loads = self._loads.loads(list(replicas))
            routed = {name: self._loads.routed(name) for name in replicas}
            keys = {name: self._keys.stats(name) for name in replicas}
            remapped, remapped_keys = self._remapped, self._keys.remapped_keys
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
                "sync": replica.link.stats() if replica.link is not None else None,
            }
        up = [routed[name] for name, replica in replicas.items() if replica.up]
        return {
            "replicas": out,
            "routing": {
                "mode": self.config.mode,
                "load": self.config.load,
                "max_imbalance": self.config.max_imbalance,
                "remapped": remapped,
                "remapped_keys": remapped_keys,
                "balance": {
                    "requests": _max_over_min([r for r, _ in up]),
                    "prompt_tokens": _max_over_min([t for _, t in up]),
                },
            },
            "usage": self._usage.stats(),
            "conversations": self.deduplicator.store.stats(),
        }

    def close(self) -> None:
        """Stop every replica's engine link (idempotent); the indexes stay usable."""
        for replica in list(self._replicas.values()):
            if replica.link is not None:
                replica.link.stop()

    def __enter__(self) -> ReplicaRouter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the engines call back
    def _landed(self, name: str, rid: str) -> None:
        """Replica ``name``'s KV events carry ``rid`` (its link's ``on_session``): learn where
        its key went, and move it there if it was planned for another replica."""
        with self._lock:
            route = self._routes.peek(rid)
            if route is None:
                return
            if route.key is not None:
                self._keys.observe(route.key, name)
            if route.replica == name:
                return
            planned_name = route.replica
            planned, landed = self._replicas.get(planned_name), self._replicas.get(name)
            route.replica = name
            self._loads.move(rid, name)
            self._remapped += 1
            blocks = route.blocks
        if planned is None or landed is None or rid not in planned.pilot.index:
            return
        planned.pilot.evict(rid)
        if blocks and rid not in landed.pilot.index:
            landed.pilot.index.insert(rid, [b for b, _ in blocks], [t for _, t in blocks])
        logger.debug("rid %r was planned for replica %r and reached %r", rid, planned_name, name)

    def _health(self, name: str, up: bool) -> None:
        """Replica ``name``'s KV-event publisher went away for its grace period (``up`` False)
        or came back (its link's ``on_health``)."""
        with self._lock:
            replica = self._replicas.get(name)
            if replica is None or replica.up == up:
                return
            replica.up = up
            if not up:
                self._keys.drop_replica(name)
                self._loads.forget_replica(name)
            left = sum(r.up for r in self._replicas.values())
        if up:
            logger.info("replica %r is up again; routing to it", name)
            return
        evicted = replica.pilot.index.clear()
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
    @property
    def _imbalance(self) -> float:
        return float(self.config.max_imbalance)

    def _build(self, spec: ReplicaSpec) -> _Replica:
        name = spec.name
        holder: list[_Replica] = []

        def dropped(rid: str) -> None:
            # The index's own LRU bound dropped ``rid`` (under the index lock).
            if holder and holder[0].link is not None:
                holder[0].link.forget(rid)

        index = ContextIndex(max_requests=self._max_requests, on_evict=dropped)
        link = None
        if spec.cache_sync is not None:
            from contextpilot_integrations.sync.engine_link import EngineLink

            link = EngineLink(
                spec.cache_sync,
                on_evict=index.evict,
                on_session=functools.partial(self._landed, name),
                on_health=functools.partial(self._health, name),
            )
        pilot = ContextPilot(
            layout=self._layout,
            token_counter=self.token_counter,
            index=index,
            deduplicator=self.deduplicator,
            cache_salt=self.cache_salt,
            engine=link,
            **self._pilot_options,
        )
        replica = _Replica(spec, pilot, link)
        holder.append(replica)
        if link is not None:
            link.start()
        return replica

    def _candidates(self) -> list[str]:
        """The replicas up, in order (all of them when none is up)."""
        with self._lock:
            up = [name for name, r in self._replicas.items() if r.up]
            return up or list(self._replicas)

    @contextlib.contextmanager
    def _reserved(self, rids: Sequence[str]) -> Iterator[dict[str, _Replica]]:
        """Under the lock: refuse rids indexed on a replica or being planned, hold them for
        the call (released when the plans are recorded) and yield the replicas."""
        with self._lock:
            busy = next((rid for rid in rids if rid in self._planning), None)
            if busy is not None:
                raise RidConflictError(f"rid {busy!r} is being planned by a concurrent call")
            for rid in rids:
                for name, replica in self._replicas.items():
                    if rid in replica.pilot.index:
                        raise RidConflictError(f"rid {rid!r} is already indexed on {name!r}")
            self._planning.update(rids)
            try:
                yield dict(self._replicas)
            except BaseException:
                self._planning.difference_update(rids)
                raise

    def _abandon(self, rids: Sequence[str]) -> None:
        """Their plans failed: not routed after all, the rids free again."""
        with self._lock:
            for rid in rids:
                self._loads.cancel(rid)
            self._planning.difference_update(rids)

    def _routed(self, plans: Sequence[Plan], replica: _Replica, key: str | None) -> list[Plan]:
        """Record each plan's route and conversation, release its rid; the plans as returned
        (``replica``, ``routing_key`` or ``base_url`` set)."""
        name, direct = replica.spec.name, self.config.mode == "direct"
        out = []
        with self._lock:
            for plan in plans:
                blocks = tuple(self._indexed(p) for p in plan.blocks)
                self._routes.put(plan.rid, _Route(name, key, blocks))
                conversation = plan.scope.conversation
                if conversation is not None:
                    self._conversations.put(conversation, (name, plan.prompt_tokens))
                self._planning.discard(plan.rid)
                out.append(
                    dataclasses.replace(
                        plan,
                        replica=name,
                        routing_key=None if direct else key,
                        base_url=replica.spec.base_url if direct else None,
                    )
                )
        return out

    def _indexed(self, placement: Placement) -> tuple[int, int]:
        """What the pilot indexed for a shown block: the block as given, or as rendered when
        sub-blocks were replaced (as :meth:`ContextPilot.plan` does)."""
        rendered = placement.rendered_text
        if rendered is None or rendered == placement.text:
            return placement.block_id or 0, placement.tokens
        return self._identify(rendered)

    def _credit_conversation(self, scope: Scope, scores: dict[str, int]) -> None:
        """A conversation's last replica holds its history: credit it with that prompt's
        tokens (lock held)."""
        conversation = scope.conversation
        last = self._conversations.get(conversation) if conversation is not None else None
        if last is not None:
            scores[last[0]] = scores.get(last[0], 0) + last[1]

    def _measure(self, request: PlanRequest) -> tuple[list[int], list[int], int]:
        """The request's distinct block ids and tokens (as the pilot identifies them) and its
        prompt tokens (blocks and question)."""
        ids: list[int] = []
        tokens: list[int] = []
        seen: set[int] = set()
        for text in request.blocks:
            if is_block_text(text):
                bid, count = self._identify(text)
                if bid not in seen:
                    seen.add(bid)
                    ids.append(bid)
                    tokens.append(count)
        return ids, tokens, sum(tokens) + self.token_counter.count(request.query)

    def _found(
        self, ids: Sequence[list[int]], tokens: Sequence[list[int]], names: Sequence[str]
    ) -> list[dict[str, tuple[tuple[int, ...], int]]]:
        """Per request, replica -> (its longest aligned prefix there, its tokens); outside
        the lock (each index is thread-safe)."""
        with self._lock:
            indexes = [(n, self._replicas[n].pilot.index) for n in names if n in self._replicas]
        out = []
        for request_ids, request_tokens in zip(ids, tokens):
            found = {}
            for name, index in indexes:
                if request_ids:
                    result = index.search(request_ids, request_tokens)
                    found[name] = (result.prefix, result.prefix_tokens)
            out.append(found)
        return out

    def _scores(
        self, ids: Sequence[list[int]], tokens: Sequence[list[int]], names: Sequence[str]
    ) -> list[dict[str, int]]:
        return [
            {name: matched for name, (_, matched) in found.items()}
            for found in self._found(ids, tokens, names)
        ]

    def _identify_uncached(self, text: str) -> tuple[int, int]:
        return block_id(text), max(1, self.token_counter.count(text))


def _best_prefix(found: Mapping[str, tuple[tuple[int, ...], int]]) -> tuple[int, ...]:
    """The longest (in tokens) of a request's cached prefixes over the replicas; the first
    replica's on a tie."""
    return max(found.values(), key=lambda match: match[1], default=((), 0))[0]


def _max_over_min(values: Sequence[int]) -> float | None:
    if not values or min(values) <= 0:
        return None
    return max(values) / min(values)
